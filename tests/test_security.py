"""Nobody's code runs by accident: crafted pickles in checkpoints, model code (auto_map) without this command's
--trust-remote-code, a plugin that exits at import; each refusal is one line naming the file or flag."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest

from toolkit.testing import CodePayload as Payload
from toolkit.testing import plant_model_code, point_dcp_entry_at, run_python
from toolkit.testing import reseal_checkpoint as reseal

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
TRAIN = ["sft", "--dataset", "demo", "--seq-len", "64", "--micro-batch-size", "2", "--max-steps", "2", "--save-every", "1"]


def one_line_refusal(result, expected: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.exception is None and "Traceback" not in result.output, result.output
    assert expected in result.stderr, result.stderr


# ----------------------------------------------------------------------------------------------- pickles
@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("fsdp") / "run"
    done = run_python(["-m", "toolkit", *TRAIN, "--model", "tiny-llama", "--strategy", "fsdp", "--output", str(run)],
                      env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_a_real_dcp_metadata_passes_the_restricted_unpickler(fsdp_run):
    from toolkit.train.safe_load import check_dcp_metadata

    check_dcp_metadata(fsdp_run / "checkpoints" / "step-2" / "dcp")


@pytest.mark.parametrize("command", ["export", "resume"])
def test_a_crafted_dcp_metadata_is_refused_before_torch_unpickles_it(fsdp_run, tmp_path, cli_runner, command):
    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    marker = tmp_path / "ran"
    step = run / "checkpoints" / "step-2"
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(step)
    if command == "export":
        result = cli_runner.invoke("export", run, "--output", tmp_path / "out")
    else:
        result = cli_runner.invoke(*TRAIN[:-4], "--max-steps", "3", "--model", "tiny-llama", "--strategy", "fsdp",
                                   "--resume", "auto", "--output", run)
    one_line_refusal(result, f"{step / 'dcp' / '.metadata'} is not torch.distributed.checkpoint metadata: loading it "
                             "would call builtins.exec")
    assert not marker.exists()


# a real entry (optimizer hyper-parameters are stored pickled) for resume; a weight declared pickled for export
@pytest.mark.parametrize("command,key", [("resume", "optimizer.param_groups.0.lr"),
                                         ("export", "model.model.embed_tokens.weight")])
def test_a_pickled_entry_of_a_distributed_checkpoint_is_read_weights_only(fsdp_run, tmp_path, cli_runner, command, key):
    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    marker = tmp_path / "ran"
    step = run / "checkpoints" / "step-2"
    point_dcp_entry_at(step / "dcp", key, Payload(marker))
    reseal(step)
    from toolkit.train.safe_load import check_dcp_metadata

    check_dcp_metadata(step / "dcp")  # only torch's classes: the .metadata check alone lets it through
    if command == "export":
        result = cli_runner.invoke("export", run, "--output", tmp_path / "out")
    else:
        result = cli_runner.invoke(*TRAIN[:-4], "--max-steps", "3", "--model", "tiny-llama", "--strategy", "fsdp",
                                   "--resume", "auto", "--output", run)
    one_line_refusal(result, f"{step / 'dcp'}: entry {key!r} holds objects a weights-only load refuses")
    assert "GLOBAL exec" in result.stderr
    assert not marker.exists()


def test_a_crafted_optimizer_pt_is_a_one_line_refusal(tmp_path, cli_runner):
    import torch

    run = tmp_path / "run"
    assert cli_runner.invoke(*TRAIN, "--model", "tiny-llama", "--output", run).exit_code == 0
    step = run / "checkpoints" / "step-2"
    marker = tmp_path / "ran"
    torch.save({"state": Payload(marker)}, step / "optimizer.pt")
    reseal(step)
    result = cli_runner.invoke(*TRAIN[:-4], "--max-steps", "3", "--model", "tiny-llama", "--resume", "auto", "--output", run)
    one_line_refusal(result, f"{step / 'optimizer.pt'} holds objects a weights-only load refuses")
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------- remote code
@pytest.fixture
def remote_code_model(tmp_path):
    """tiny-llama whose config names its own code (auto_map) for a model type transformers does not have, so
    transformers asks whether to run it; importing that code writes the marker."""
    from toolkit.models import materialize_preset

    model = tmp_path / "model"
    shutil.copytree(materialize_preset("tiny-llama"), model)
    marker = tmp_path / "ran"
    plant_model_code(model, "evil-llama", marker)
    return model, marker


def test_infer_refuses_model_code_even_when_someone_answers_yes(remote_code_model, cli_runner):
    model, marker = remote_code_model
    result = cli_runner.invoke("infer", model, "--prompt", "hi", input="y\n")
    one_line_refusal(result, f"{model / 'config.json'} asks to run the model's own Python code (configuration_evil)")
    assert "--trust-remote-code" in result.stderr and not marker.exists()


def test_export_of_a_run_ignores_trust_remote_code_in_its_recipe(remote_code_model, tmp_path, cli_runner):
    model, marker = remote_code_model
    plain = tmp_path / "plain"
    shutil.copytree(model, plain)
    config = {k: v for k, v in json.loads((model / "config.json").read_text()).items() if k != "auto_map"}
    (plain / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    run = tmp_path / "run"
    assert cli_runner.invoke(*TRAIN, "--model", plain, "--output", run).exit_code == 0
    recipe = (run / "recipe.yaml").read_text().replace(f"model: {plain}", f"model: {model}")
    (run / "recipe.yaml").write_text(recipe.replace("trust_remote_code: false", "trust_remote_code: true"))
    result = cli_runner.invoke("export", run, "--output", tmp_path / "out")
    one_line_refusal(result, "Remote code runs only when --trust-remote-code is given on this command line")
    assert not marker.exists()


def test_a_recipe_file_cannot_turn_on_remote_code(tmp_path, cli_runner):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: tiny-llama\ntrust_remote_code: true\n")
    result = cli_runner.invoke("sft", "--config", recipe, "--output", tmp_path / "run")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{recipe} sets trust_remote_code: true" in result.stderr and "--trust-remote-code" in result.stderr


def test_infer_refuses_pickled_bin_weights_in_one_line(tmp_path, cli_runner):
    from toolkit.models import materialize_preset

    model = tmp_path / "model"
    shutil.copytree(materialize_preset("tiny-llama"), model)
    (model / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(marker)))
    result = cli_runner.invoke("infer", model, "--prompt", "hi")
    one_line_refusal(result, f"model directory {model} has no *.safetensors weights (.bin weights are pickles")
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------- plugins, stdout
def run_toolkit(site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}
    return run_python(["-m", "toolkit", *args], env=env, timeout=300)


def test_a_plugin_that_calls_sys_exit_at_import_is_contained(tmp_path):
    from toolkit.testing import write_plugin_distribution

    site = tmp_path / "site"
    write_plugin_distribution(site, "toolkit-quitter", "import sys\nsys.exit(1)\n", version="0.3.0")
    listed = run_toolkit(site, "plugins")
    assert listed.returncode == 0, listed.stderr
    assert "plugin quitter 0.3.0 failed and was skipped" in listed.stderr and "SystemExit: 1" in listed.stderr
    assert "quitter  (toolkit-quitter 0.3.0)  FAILED: SystemExit" in listed.stdout


NOISY_BACKEND = '''
import os, sys, dataclasses
from typing import ClassVar
from toolkit import hookimpl
from toolkit.builtins.inference import GenerateConfig

class Noisy:
    """Prints like vLLM does: warnings through Python's stdout and from C code on file descriptor 1."""
    name: ClassVar[str] = "noisy"
    Config: ClassVar[type] = GenerateConfig

    def __init__(self, config=None):
        self.config = config or GenerateConfig()

    def generate(self, model_dir, prompts, options):
        print("WARNING engine: something about CUDA graphs")
        os.write(1, b"INFO from C++\\n")
        return ["the completion"]

@hookimpl
def toolkit_register_inference_backends(register):
    register(Noisy)
'''


def test_infer_stdout_holds_only_the_completion(tmp_path):
    from toolkit.testing import write_plugin_distribution

    site = tmp_path / "site"
    write_plugin_distribution(site, "toolkit-noisy", NOISY_BACKEND)
    done = run_toolkit(site, "infer", "tiny-llama", "--backend", "noisy", "--prompt", "hi")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the completion\n"
    assert "WARNING engine" in done.stderr and "INFO from C++" in done.stderr


def test_a_tokenizer_with_its_own_code_is_refused_in_one_line(tmp_path, cli_runner):
    from toolkit.models import materialize_preset

    model = tmp_path / "model"
    shutil.copytree(materialize_preset("tiny-llama"), model)
    marker = tmp_path / "ran"
    (model / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for command in (["infer", model, "--prompt", "hi"], ["export", model, "--output", tmp_path / "out"],
                    [*TRAIN, "--model", model, "--output", tmp_path / "run"]):
        result = cli_runner.invoke(*command, input="y\n")
        one_line_refusal(result, f"{model / 'tokenizer_config.json'} asks to run the model's own Python code (tokenization_evil)")
    assert not marker.exists()


def test_infer_with_a_chat_template_that_escapes_the_sandbox_is_one_line(tmp_path, cli_runner):
    from toolkit.models import materialize_preset

    model = tmp_path / "model"
    shutil.copytree(materialize_preset("tiny-llama"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja", "chat_template.json"):
        (model / name).unlink(missing_ok=True)
    result = cli_runner.invoke("infer", model, "--prompt", "hi")
    one_line_refusal(result, "chat template tried something jinja's sandbox forbids")


def test_data_inspect_refuses_model_code_and_has_the_flag_its_refusal_names(remote_code_model, cli_runner):
    model, marker = remote_code_model
    refused = cli_runner.invoke("data", "inspect", "demo", "--model", model, input="y\n")
    one_line_refusal(refused, f"{model / 'config.json'} asks to run the model's own Python code (configuration_evil)")
    assert "--trust-remote-code" in refused.stderr and not marker.exists()
    cli_runner.invoke("data", "inspect", "demo", "--model", model, "--trust-remote-code")
    assert marker.exists(), "asked for on the command line, the model's code runs"


def test_serve_refuses_model_code_without_naming_a_flag_it_lacks(remote_code_model, cli_runner):
    """``toolkit serve`` has no --trust-remote-code: its refusal says what to do instead of naming one."""
    pytest.importorskip("toolkit_lmdeploy", reason="a backend that can serve (the refusal comes before its engine)")
    model, marker = remote_code_model
    result = cli_runner.invoke("serve", model, "--backend", "lmdeploy", input="y\n")
    one_line_refusal(result, f"{model / 'config.json'} asks to run the model's own Python code (configuration_evil)")
    assert "never runs a model's own code" in result.stderr and "given on this command line" not in result.stderr
    assert not marker.exists()
