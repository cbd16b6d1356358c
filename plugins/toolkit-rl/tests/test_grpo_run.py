"""End to end on the tiny preset: toolkit grpo trains, logs, samples rollouts, resumes exactly, refuses bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from toolkit.recipe import resolve_recipe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOWELS = f"{Path(__file__).parent / 'toy_rewards.py'}:vowels"

BASE = {"model": "tiny-llama", "dataset": ["demo"], "loss": "grpo", "max_samples": 16, "micro_batch_size": 4,
        "seq_len": 96, "lr": 1e-2, "schedule": "constant", "seed": 3,
        "grpo": {"rewards": ["answer:1", VOWELS], "num_generations": 4, "prompts_per_rollout": 2,
                 "max_new_tokens": 6}, "answer": {"mode": "contains"}}


def run(tmp_path, name, **overrides):
    from toolkit_rl.loop import run_grpo

    values = {**BASE, "output": str(tmp_path / name), **overrides}
    values["grpo"] = {**BASE["grpo"], **overrides.get("grpo", {})}
    return run_grpo(resolve_recipe(values))


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_trains_logs_and_samples_rollouts(tmp_path, cli_runner):
    out = tmp_path / "cli"
    result = cli_runner.invoke("grpo", "--model", "tiny-llama", "--dataset", "demo", "--max-samples", "8",
                               "--reward", "answer", "--reward", "length:0.1", "--num-generations", "4",
                               "--grpo-prompts-per-rollout", "2", "--max-new-tokens", "6", "--grpo-beta", "0.04",
                               "--loss-type", "dapo", "--max-steps", "2", "--micro-batch-size", "4", "--seq-len", "96",
                               "--output", str(out))
    assert result.exit_code == 0, result.output
    lines = metrics(out)
    assert [m["step"] for m in lines] == [1, 2]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "reward/mean", "reward/std", "rewards/answer/mean",
                "rewards/length/std", "completion_length", "clip_ratio/region", "kl", "entropy", "rollout_time",
                "train_time", "groups_dropped"):
        assert key in lines[0], key
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rollouts} == {1, 2} and rollouts[0]["prompt"].endswith("assistant\n")
    assert set(rollouts[0]["rewards"]) == {"answer", "length"}
    assert (out / "checkpoints" / "step-2").is_dir() and (out / "recipe.yaml").is_file()


def test_sampling_flags_reach_the_rollout_sampler(tmp_path, cli_runner):
    """``toolkit grpo`` takes ``toolkit infer``'s sampling flags and the rollouts are drawn with them: at a tiny
    --temperature the sampler is greedy (each prompt's group holds one completion, the one --top-k 1 gives, the
    same seed), at the default temperature the tiny model's near-uniform distribution gives a group distinct
    completions. A sampler that ignored --temperature (or --top-k) would sample every run at temperature 1."""

    def groups(*flags: str) -> list[list[str]]:
        out = tmp_path / "-".join(flags or ("default",))
        result = cli_runner.invoke("grpo", "--model", "tiny-llama", "--dataset", "demo", "--max-samples", "8",
                                   "--reward", "length:0.1", "--num-generations", "4", "--grpo-prompts-per-rollout", "2",
                                   "--max-new-tokens", "6", "--grpo-log-completions", "8", "--max-steps", "1",
                                   "--micro-batch-size", "4", "--seq-len", "96", "--output", str(out), *flags)
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
        assert len(rows) == 8
        return [[r["completion"] for r in rows if r["prompt"] == prompt] for prompt in dict.fromkeys(r["prompt"] for r in rows)]

    greedy = groups("--top-k", "1")
    assert all(len(set(group)) == 1 for group in greedy), greedy
    assert groups("--temperature", "1e-4") == greedy
    assert groups("--top-p", "1e-6") == greedy
    assert any(len(set(group)) > 1 for group in groups()), "temperature 1 sampled one completion per prompt"


def test_entropy_of_completions_sampled_elsewhere_equals_generates_own():
    """The vLLM backends get each completion's sampling entropy from one forward of the HF copy over prompt +
    completion; on the completions transformers' ``generate`` sampled (left padded, a KV cache, its own
    logits) that forward gives generate's entropies, for prompts of different lengths (padded left by generate,
    right by the forward)."""
    import torch

    from toolkit.data.template import ChatTemplate
    from toolkit.models import resolve_model
    from toolkit.recipe import Recipe
    from toolkit_rl.losses import GRPOConfig
    from toolkit_rl.rollout import HFRollouts

    source = resolve_model("tiny-llama")
    config = GRPOConfig(num_generations=3, max_new_tokens=10, temperature=0.7)
    rollouts = HFRollouts(source, Recipe(model="tiny-llama", precision="fp32"), config, torch.device("cpu"))
    template = ChatTemplate(source.tokenizer)
    prompts = [source.tokenizer(template.render([{"role": "user", "content": text}], add_generation_prompt=True),
                                add_special_tokens=False)["input_ids"] for text in ("What is the capital of Lopehes?", "Hi")]
    assert len(prompts[0]) != len(prompts[1])
    sampled = rollouts.generate(prompts, seed=11)
    rows = [p for p in prompts for _ in range(config.num_generations)]
    forward = rollouts.sampling_entropy(rows, sampled.ids, chunk=4)
    assert forward == pytest.approx(sampled.entropy, rel=1e-4, abs=1e-5)
    assert min(sampled.entropy) > 0.01
    rollouts.config = GRPOConfig(num_generations=3, max_new_tokens=10, temperature=1.4)
    assert all(hot > cold for hot, cold in zip(rollouts.sampling_entropy(rows, sampled.ids), forward, strict=True))


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_rollouts_use_the_weights_of_the_last_step(tmp_path, monkeypatch, tuner):
    """One optimizer step per rollout batch: the rollout policy IS the trained policy, so every ratio is 1 and
    the clipped objective is minus the mean advantage, zero per group. A stale rollout model breaks that
    (with LoRA: the adapters must arrive merged)."""
    from toolkit_rl import loop

    if tuner == "lora":
        pytest.importorskip("toolkit_peft")
    grpo = {"steps_per_rollout": 1, "iterations": 1}
    fresh = metrics(run(tmp_path, "fresh", max_steps=3, tuner=tuner, grpo=grpo))
    assert all(abs(m["loss"]) < 1e-6 for m in fresh), [m["loss"] for m in fresh]
    monkeypatch.setattr(loop.GRPORun, "sync_weights", lambda self, step: None)
    stale = metrics(run(tmp_path, "stale", max_steps=3, tuner=tuner, grpo=grpo))
    assert max(abs(m["loss"]) for m in stale[1:]) > 1e-5, [m["loss"] for m in stale]


def test_a_run_saved_with_trls_option_name_resumes(tmp_path):
    """A recipe.yaml written before --max-new-tokens (TRL's max_completion_length) is the same training; a real
    change of a sampling option is still refused."""
    import copy

    import yaml

    from toolkit.errors import ConfigError
    from toolkit.train.runner import check_resume_changes

    recipe = resolve_recipe({**BASE, "output": str(tmp_path), "resume": "auto"})
    saved = copy.deepcopy(recipe.to_yaml_dict())
    saved["grpo"]["max_completion_length"] = saved["grpo"].pop("max_new_tokens")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(saved))
    check_resume_changes(recipe, is_main=True)
    hotter = resolve_recipe({**BASE, "output": str(tmp_path), "resume": "auto", "grpo": {**BASE["grpo"], "temperature": 1.5}})
    with pytest.raises(ConfigError, match="'temperature': 1.0.*'temperature': 1.5"):
        check_resume_changes(hotter, is_main=True)


def test_resume_is_exact(tmp_path):
    """Prompt order, rollout sampling and weights continue as if never stopped (two optimizer steps per batch)."""
    from safetensors.torch import load_file

    grpo = {"steps_per_rollout": 2, "iterations": 1, "loss_type": "gspo"}
    straight = run(tmp_path, "straight", max_steps=6, save_every=2, grpo=grpo)
    stopped = run(tmp_path, "resumed", max_steps=6, save_every=2, stop_after=2, grpo=grpo)
    assert sorted(p.name for p in (stopped / "checkpoints").iterdir()) == ["step-2"]
    resumed = run(tmp_path, "resumed", max_steps=6, save_every=2, resume="auto", grpo=grpo)
    a, b = load_file(straight / "checkpoints/step-6/model.safetensors"), load_file(resumed / "checkpoints/step-6/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    timing = {"tokens_per_s", "train_time", "rollout_time"}
    clean = [{k: v for k, v in m.items() if k not in timing} for m in metrics(straight)]
    again = [{k: v for k, v in m.items() if k not in timing} for m in metrics(resumed)]
    assert clean == again
    assert (straight / "rollouts.jsonl").read_text() == (resumed / "rollouts.jsonl").read_text()


@pytest.mark.parametrize("method,what", [("generate", "sampling"), ("load_weights", "loading the policy's weights"),
                                         ("token_logps", "scoring log-probs")])
def test_a_dying_rollout_backend_names_itself_and_the_run_saves_and_resumes_exactly(tmp_path, monkeypatch, method, what):
    """The backend fails at the start of the third rollout batch (whichever of its calls fails): the run saves
    step 2 with the prompt draws of the batch boundary, so --resume auto ends where a run never stopped ends."""
    from safetensors.torch import load_file

    from toolkit_rl import loop, rollout
    from toolkit_rl.rollout import RolloutError

    grpo = {"loss_type": "gspo"}
    straight = run(tmp_path, "straight", max_steps=4, grpo=grpo)
    batches = {"n": 0}
    rollout_batch, real = loop.GRPORun.rollout_batch, getattr(rollout.HFRollouts, method)

    def counting(self, step):
        batches["n"] += 1
        return rollout_batch(self, step)

    def flaky(self, *args, **kwargs):
        if batches["n"] == 3:
            raise RuntimeError("engine process exited")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(loop.GRPORun, "rollout_batch", counting)
    monkeypatch.setattr(rollout.HFRollouts, method, flaky)
    with pytest.raises(RolloutError, match=rf"rollout backend 'hf' failed {what} before step 3: RuntimeError: engine "
                                           r"process exited \(checkpoint .*step-2; continue with --resume auto\)"):
        run(tmp_path, "dies", max_steps=4, grpo=grpo)
    assert (tmp_path / "dies" / "checkpoints" / "step-2").is_dir()
    monkeypatch.undo()
    resumed = run(tmp_path, "dies", max_steps=4, resume="auto", grpo=grpo)
    a, b = load_file(straight / "checkpoints/step-4/model.safetensors"), load_file(resumed / "checkpoints/step-4/model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_dynamic_sampling_drops_equal_groups_and_every_batch_stays_full(tmp_path, monkeypatch, capfd):
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts drawn (up to 4
    draws); a batch those draws do not fill is topped up, so every rank's step has the same completions."""
    from toolkit.train.checkpoint import read_state
    from toolkit_rl import loop

    script = tmp_path / "first_group.py"
    script.write_text("calls = [0]\n\n\ndef spread(prompts, completions, completion_ids, **columns):\n"
                      "    calls[0] += 1  # only the first group of the first call has unequal rewards\n"
                      "    return [float(i) if calls[0] == 1 and i < 4 else 0.0 for i in range(len(completions))]\n")
    sizes = []
    rollout_batch = loop.GRPORun.rollout_batch

    def counting(self, step):
        batch = rollout_batch(self, step)
        sizes.append(sum(mb["num_sequences"] for micro_batches in batch.steps for mb in micro_batches))
        return batch

    monkeypatch.setattr(loop.GRPORun, "rollout_batch", counting)
    out = run(tmp_path, "dapo", max_steps=2, grpo={"rewards": [f"{script}:spread"], "loss_type": "dapo"})
    assert sizes == [8, 8]  # 2 prompts x 4 completions, though only one group had unequal rewards
    lines = metrics(out)
    assert lines[0]["groups_dropped"] == pytest.approx(7 / 8)  # 4 draws of 2 prompts: one group kept
    assert lines[1]["groups_dropped"] == 1.0
    assert read_state(out / "checkpoints" / "step-2")["rl"]["draws"] == 8
    first = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()][:4]
    assert [r["reward"] for r in first] == [0.0, 1.0, 2.0, 3.0]  # the kept group comes first
    err = capfd.readouterr().err  # one line per step that stayed short, with the run's counts
    assert err.count("draws held") == 2
    assert "step 1: 4 draws held 1 of 2 groups" in err and "step 2: 4 draws held 0 of 2 groups" in err


def write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("args,message", [
    (["--reward", "answer", "--dataset", "BAD"], r"bad.jsonl, record 2: a prompt record needs a 'prompt'"),
    (["--reward", "answer", "--dataset", "LONG", "--seq-len", "20"], r"long.jsonl, record 1: the prompt has \d+ tokens"),
    (["--dataset", "demo"], "needs at least one --reward"),
    (["--reward", "nope", "--dataset", "demo"], "unknown reward 'nope'"),
    (["--reward", "answer", "--dataset", "demo", "--save-every", "3", "--grpo-steps-per-rollout", "2"],
     "must be a multiple of the 2 optimizer steps"),
    (["--reward", "answer", "--dataset", "demo", "--vllm-server", "localhost:1"], "add --rollout-backend vllm"),
    (["--reward", "answer", "--dataset", "demo", "--rollout-backend", "vllm", "--vllm-server", "http://127.0.0.1:9"],
     r"cannot reach the server at http://127.0.0.1:9 \(listing its models\)"),
])
def test_bad_input_is_named_before_training(tmp_path, cli_runner, args, message):
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "a?", "answer": "b"}, {"question": "c?"}])
    long = write(tmp_path / "long.jsonl", [{"prompt": "word " * 40}])
    args = [{"BAD": bad, "LONG": long}.get(a, a) for a in args]
    result = cli_runner.invoke("grpo", "--model", "tiny-llama", "--output", str(tmp_path / "run"), *args)
    assert result.exit_code != 0 and "Traceback" not in result.output
    import re

    assert re.search(message, result.output), result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_train_loss_grpo_is_refused_before_training(tmp_path, cli_runner):
    """The core's runner has no rollouts: no dataset format makes 'rollout' examples, and it says so."""
    result = cli_runner.invoke("train", "--loss", "grpo", "--model", "tiny-llama", "--max-steps", "1",
                               "--output", str(tmp_path / "run"))
    assert result.exit_code != 0 and "needs rollout examples" in result.output, result.output
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_reward_model_exported_by_toolkit_rm_is_a_reward(tmp_path):
    """toolkit-dpo's `toolkit rm ... --export hf-rm` directory as `--reward DIR`: every logged rollout's reward is the
    exported classifier's score on the closed conversation (the text the reward model was trained on)."""
    pytest.importorskip("toolkit_dpo")
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from toolkit.train.runner import run_training

    rm_run = run_training(resolve_recipe({"model": "tiny-llama", "dataset": ["parity-prefs"], "loss": "rm", "max_steps": 2,
                                          "max_samples": 8, "micro_batch_size": 4, "seq_len": 96,
                                          "output": str(tmp_path / "rm"), "export": "hf-rm"}))
    directory = rm_run / "export-hf-rm"
    out = run(tmp_path, "grpo", max_steps=1, grpo={"rewards": [str(directory)], "log_completions": 8})
    assert "rewards/export-hf-rm/mean" in metrics(out)[0]
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    samples = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and len({s["reward"] for s in samples}) > 1
    for sample in samples:
        ids = tokenizer(sample["prompt"] + sample["completion"] + "<|im_end|>\n", add_special_tokens=False,
                        return_tensors="pt").input_ids
        with torch.no_grad():
            expected = float(model(input_ids=ids).logits[0, 0])
        assert sample["rewards"]["export-hf-rm"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_a_vllm_server_without_development_endpoints_is_named_before_training(tmp_path, cli_runner):
    """A server that answers /v1/models but not the development endpoints (no VLLM_SERVER_DEV_MODE=1) could never
    take the policy's weights: refused, saying how to start it, before any model loads."""
    import http.server
    import threading

    class NoDevMode(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps({"data": [{"id": "m"}]}).encode() if self.path == "/v1/models" else b"{}"
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoDevMode)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = cli_runner.invoke("grpo", "--model", "tiny-llama", "--dataset", "demo", "--reward", "answer",
                                   "--rollout-backend", "vllm", "--vllm-server", url, "--output", str(tmp_path / "run"))
    finally:
        server.shutdown()
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert f"(server {url}) has no development endpoints" in result.output and "VLLM_SERVER_DEV_MODE=1" in result.output
    assert not (tmp_path / "run").exists()
