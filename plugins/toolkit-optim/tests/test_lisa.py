"""--tuner lisa trains embeddings + head + the sampled decoder layers only, a period equals freeze tuning
of the same layers (the core's freeze tuner as the reference), layers are redrawn every interval, the
optimizer keeps state only for what trains, and a stopped run resumes bit-identically."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

LAYERS = 4


@pytest.fixture
def model_dir(tiny_model_factory):
    return tiny_model_factory.directory("llama", num_hidden_layers=LAYERS)


def common(model_dir):
    return ["sft", "--model", str(model_dir), "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--micro-batch-size", "2",
            "--schedule", "constant", "--seed", "7"]


LISA = ["--tuner", "lisa", "--lisa-layers", "2", "--lisa-interval", "2"]


def invoke(cli_runner, args, code=0):
    result = cli_runner.invoke([str(a) for a in args])
    assert result.exit_code == code, result
    return result


def sampled(period, seed=7):
    from toolkit_optim.lisa import LISATuner

    tuner = LISATuner(LISATuner.Config(layers=2, interval=2))
    tuner.seed, tuner.num_layers = seed, LAYERS
    return tuner.sampled_layers(period)


def changed_layers(before, after):
    """Decoder layers with a changed tensor, and whether every tensor outside the layers changed."""
    layers = {int(m.group(1)) for k in after if (m := re.search(r"\.layers\.(\d+)\.", k)) and not torch.equal(before[k], after[k])}
    outside = [k for k in after if ".layers." not in k]
    return layers, all(not torch.equal(before[k], after[k]) for k in outside)


def test_only_the_sampled_layers_train_and_they_are_redrawn(tmp_path, cli_runner, model_dir):
    assert sampled(0) != sampled(1), "seed 7 must draw two different sets for this test to mean anything"
    run = tmp_path / "run"
    invoke(cli_runner, [*common(model_dir), *LISA, "--max-steps", "4", "--save-every", "2", "--output", run])
    initial = load_file(str(model_dir / "model.safetensors"))
    step2 = load_file(str(run / "checkpoints/step-2/model.safetensors"))
    step4 = load_file(str(run / "checkpoints/step-4/model.safetensors"))
    assert step2.keys() == initial.keys()  # every tensor is saved, frozen ones too
    assert changed_layers(initial, step2) == (set(sampled(0)), True)
    assert changed_layers(step2, step4) == (set(sampled(1)), True)
    # the optimizer holds state only for what trains in the current period
    state = torch.load(run / "checkpoints/step-4/optimizer.pt", weights_only=True)["state"]
    per_layer = sum(1 for k in initial if ".layers.0." in k)
    outside = sum(1 for k in initial if ".layers." not in k)
    assert len(state) == outside + 2 * per_layer


def test_a_period_equals_freeze_tuning_of_the_sampled_layers(tmp_path, cli_runner, model_dir):
    layers = "|".join(str(i) for i in sampled(0))
    invoke(cli_runner, [*common(model_dir), *LISA, "--max-steps", "2", "--output", tmp_path / "lisa"])
    invoke(cli_runner, [*common(model_dir), "--tuner", "freeze", "--freeze-trainable-layers", "0", "--freeze-trainable",
                        rf"\.layers\.({layers})\.|embed_tokens|lm_head|model\.norm", "--max-steps", "2",
                        "--output", tmp_path / "freeze"])
    lisa = load_file(str(tmp_path / "lisa/checkpoints/step-2/model.safetensors"))
    freeze = load_file(str(tmp_path / "freeze/checkpoints/step-2/model.safetensors"))
    assert freeze.keys() < lisa.keys()
    for name, tensor in freeze.items():
        torch.testing.assert_close(lisa[name], tensor, rtol=0, atol=1e-7, msg=name)


def test_a_stopped_run_resumes_bit_identically(tmp_path, cli_runner, model_dir):
    args = [*common(model_dir), *LISA, "--max-steps", "6"]
    invoke(cli_runner, [*args, "--output", tmp_path / "straight"])
    invoke(cli_runner, [*args, "--output", tmp_path / "half", "--stop-after", "3"], code=75)  # inside period 1
    invoke(cli_runner, [*args, "--output", tmp_path / "half", "--resume", "auto"])
    a = load_file(str(tmp_path / "straight/checkpoints/step-6/model.safetensors"))
    b = load_file(str(tmp_path / "half/checkpoints/step-6/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("straight", "half")]
    assert losses[0] == losses[1] and len(losses[0]) == 6


def test_lisa_refuses_strategies_that_fix_the_trainable_set_and_too_many_layers(tmp_path, cli_runner, model_dir):
    pytest.importorskip("toolkit_deepspeed")
    zero = invoke(cli_runner, [*common(model_dir), *LISA, "--strategy", "deepspeed", "--zero", "2", "--max-steps", "1", "--output", tmp_path / "a"],
                  code=1)
    assert "--strategy deepspeed fixes the trainable set" in zero.output and "Traceback" not in zero.output
    many = invoke(cli_runner, [*common(model_dir), "--tuner", "lisa", "--lisa-layers", "9", "--max-steps", "1",
                               "--output", tmp_path / "b"], code=1)
    assert "--lisa-layers 9 exceeds the model's 4 decoder layers" in many.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
