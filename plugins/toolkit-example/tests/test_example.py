"""toolkit-example's own tests: it is discovered, its loss is chosen by name, and the loss math is right."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from toolkit.contracts import StepContext, TokenLogps
from toolkit.errors import ConfigError
from toolkit.recipe import resolve_recipe, thing_options
from toolkit.testing import run_distributed, run_python
from toolkit_example.losses import FocalConfig, FocalLoss


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> TokenLogps:
    """What a strategy hands a loss: label log-probs of ALREADY SHIFTED labels, one sequence per row."""
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    mask = labels != -100
    rows = labels.shape[0]
    sequence_ids = torch.arange(rows).unsqueeze(1).expand_as(labels).clone()
    meta = {"example_ids": torch.arange(rows), "roles": torch.zeros(rows, dtype=torch.long)}
    return TokenLogps(logps=logps * mask, mask=mask, sequence_ids=sequence_ids, num_sequences=rows, sequence_meta=meta)


def reference_focal(logits: torch.Tensor, labels: torch.Tensor, gamma: float) -> torch.Tensor:
    """Focal loss written from the paper on full logits (independent of TokenLogps)."""
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
    p = torch.exp(-ce)
    kept = labels.flatten() != -100
    return ((1 - p) ** gamma * ce)[kept].sum() / kept.sum()


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 7, 11, generator=generator) * 3
    labels = torch.randint(0, 11, (3, 7), generator=generator)
    labels[0, :2] = -100
    labels[2, 5:] = -100
    return logits, labels


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0, 5.0])
def test_focal_loss_and_gradients_match_the_reference(gamma):
    logits, labels = batch()
    ours_logits = logits.clone().requires_grad_(True)
    ref_logits = logits.clone().requires_grad_(True)
    tokens = int((labels != -100).sum())
    ours = FocalLoss(FocalConfig(gamma=gamma))(token_logps(ours_logits, labels), StepContext(tokens, 3, 3)).loss
    ref = reference_focal(ref_logits, labels, gamma)
    torch.testing.assert_close(ours, ref)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours_logits.grad, ref_logits.grad)


def test_gamma_zero_is_the_cores_cross_entropy():
    from toolkit.builtins.losses import SFTLoss

    logits, labels = batch(1)
    out = token_logps(logits, labels)
    ctx = StepContext(int((labels != -100).sum()), 3, 3)
    torch.testing.assert_close(FocalLoss(FocalConfig(gamma=0.0))(out, ctx).loss, SFTLoss()(out, ctx).loss)


def test_micro_batch_contributions_sum_to_the_step_loss():
    logits, labels = batch(2)
    ctx = StepContext(int((labels != -100).sum()), 3, 3)
    loss = FocalLoss()
    whole = loss(token_logps(logits, labels), ctx)
    parts = [loss(token_logps(logits[rows], labels[rows]), ctx) for rows in (slice(0, 1), slice(1, 3))]
    torch.testing.assert_close(parts[0].loss + parts[1].loss, whole.loss)
    torch.testing.assert_close(parts[0].metrics["nll"] + parts[1].metrics["nll"], whole.metrics["nll"])


def test_the_loss_is_chosen_by_name_with_its_options(toolkit_manager):
    manager = toolkit_manager()  # installed plugins, this one included
    assert manager.get("loss", "focal") is FocalLoss
    recipe = resolve_recipe({"loss": "focal", "focal": {"gamma": 0.5}}, manager=manager)
    assert thing_options(recipe, FocalLoss) == FocalConfig(gamma=0.5)
    with pytest.raises(ConfigError, match="gamma must be 0 or more, got -1"):
        resolve_recipe({"loss": "focal", "focal": {"gamma": -1}}, manager=manager)


def test_the_example_recipe_resolves(toolkit_manager):
    from pathlib import Path

    from toolkit.recipe import read_yaml

    recipe_file = Path(__file__).resolve().parents[3] / "examples" / "focal.yaml"
    if not recipe_file.is_file():
        pytest.skip("not inside the toolkit repository")
    recipe = resolve_recipe(read_yaml(recipe_file), source=str(recipe_file), manager=toolkit_manager())
    assert recipe.loss == "focal" and thing_options(recipe, FocalLoss).gamma == 1.0


def test_the_loss_is_a_training_command(toolkit_manager, cli_runner):
    toolkit_manager()
    result = cli_runner.invoke("focal", "--help")
    assert result.exit_code == 0, result.output
    assert "focal cross-entropy" in result.stdout and "--focal-gamma" in result.stdout


def test_toolkit_plugins_lists_this_plugin():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKIT_")}
    result = subprocess.run([sys.executable, "-m", "toolkit", "plugins", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    (row,) = [r for r in json.loads(result.stdout) if r["name"] == "example"]
    assert (row["distribution"], row["version"], row["error"]) == ("toolkit-example", "0.1.0", None)
    assert row["registers"] == {"loss": ["focal"], "reward": ["sentence"], "command": ["example"],
                                **({"architecture": ["megatron:iquestcoder"]} if megatron_installed() else {})}
    assert row["hooks"] == ["toolkit_register_architectures", "toolkit_register_commands", "toolkit_register_losses",
                            "toolkit_register_rewards"]


def megatron_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("toolkit_megatron") is not None


def test_the_command(toolkit_manager, cli_runner):
    toolkit_manager()
    result = cli_runner.invoke("example", "focal-weights", "--gamma", "2", "--prob", "0.5", "--prob", "0.9")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert rows == [["0.5", "0.6931", "0.1733", "0.2500"], ["0.9", "0.1054", "0.0011", "0.0100"]]


def train(tmp_path, name: str, *args: str, nproc: int = 1) -> list[dict]:
    """Run ``toolkit <args>`` (on ``nproc`` gloo processes) and return its metrics.jsonl rows."""
    output = tmp_path / name
    argv = ["-m", "toolkit", *args, "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3",
            "--output", str(output)]
    env = {"HF_HUB_OFFLINE": "1", "TOOLKIT_PLUGINS": "example"}
    if nproc > 1:
        run_distributed(argv, nproc=nproc, env=env, cwd=tmp_path)
    else:
        environment = {**{k: v for k, v in os.environ.items() if not k.startswith("TOOLKIT_")}, **env}
        result = run_python(argv, env=environment, timeout=300, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_training_with_the_focal_loss_through_the_core_engine(tmp_path):
    """End to end: 2-process DDP gives the same steps as 1 process accumulating the same global
    batch (the loss contract), and at the same initial weights focal's nll metric is sft's loss."""
    accumulated = train(tmp_path, "one", "focal", "--max-steps", "2", "--micro-batch-size", "2", "--global-batch-size", "4")
    ddp = train(tmp_path, "ddp", "focal", "--max-steps", "2", "--micro-batch-size", "2", nproc=2)
    (sft,) = train(tmp_path, "sft", "sft", "--max-steps", "1", "--micro-batch-size", "2", "--global-batch-size", "4")
    for one, two in zip(accumulated, ddp, strict=True):
        assert (one["step"], one["loss"], one["grad_norm"]) == pytest.approx((two["step"], two["loss"], two["grad_norm"]), rel=1e-5)
    first = accumulated[0]
    assert first["nll"] == pytest.approx(sft["loss"], rel=1e-5)
    assert 0 < first["loss"] < first["nll"] and 0 < first["focal_weight"] < 1


def test_the_sentence_reward_is_registered_and_scores_endings():
    from toolkit.plugins import get_plugin_manager
    from toolkit_example.rewards import SentenceConfig, SentenceReward

    assert get_plugin_manager().get("reward", "sentence") is SentenceReward
    assert SentenceReward()(["p"] * 4, ["It is Paris.", "Paris", "  Why? ", ""], [[1]] * 4, [{}] * 4) == [1.0, 0.0, 1.0, 0.0]
    options = thing_options(resolve_recipe({"sentence": {"endings": "!"}}), SentenceReward)
    assert options == SentenceConfig(endings="!")
