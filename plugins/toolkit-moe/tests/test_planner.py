"""``toolkit plan`` plans toolkit-moe's expert parallelism under ``--strategy local`` (the ``ep`` axis it adds through
``toolkit_strategy_axes``): the candidate is listed, its per-rank state is what the engine holds on two gloo ranks,
and the command it prints is accepted by the real CLI and the runner's layout check."""

from __future__ import annotations

import shlex

import pytest

PRESET = "tiny-qwen3-moe"
SEQ_LEN = 32


def _plan(gpus: int = 2, **workload):
    from toolkit.models import preset_config
    from toolkit.plan import Workload, make_cluster, plan, shape_from_config

    shape = shape_from_config(preset_config(PRESET).to_dict(), name=PRESET)
    return plan(shape, make_cluster(gpus, 1, "80GiB"), Workload(seq_len=SEQ_LEN, **workload), ("local",), model=PRESET)


def _local_ep(result, ep: int = 2):
    found = [c for c in result.ranked if c.layout.strategy == "local" and c.layout.ep == ep and not c.layout.recompute]
    assert found, [c.layout.describe() for c in result.ranked + result.rejected]
    return found[0]


def test_the_plan_lists_local_expert_parallel_layouts_from_the_strategy_axes():
    result = _plan()
    candidate = _local_ep(result)
    assert candidate.layout.describe() == "local EP2 DP2"
    assert candidate.time.expert_parallel > 0  # the routed rows' all-to-alls
    from toolkit.plan.report import render

    assert "--strategy local --ep 2 --moe-enabled" in render(result, top=len(result.ranked))


def test_without_the_hook_local_gets_no_expert_parallel_layouts(toolkit_manager):
    """The planner reads the axes from the registry: the core alone (no toolkit-moe) plans local without --ep, and a
    plugin that adds ``ep`` to another strategy gets its layouts planned."""
    from toolkit import hookimpl

    toolkit_manager(installed=False)
    assert not any(c.layout.ep > 1 for c in _plan().ranked)

    class ExpertsForFsdp:
        @staticmethod
        @hookimpl
        def toolkit_strategy_axes(strategy):
            return ["ep"] if strategy == "fsdp" else []

    toolkit_manager(ExpertsForFsdp, installed=False)
    from toolkit.models import preset_config
    from toolkit.plan import Workload, make_cluster, plan, shape_from_config

    shape = shape_from_config(preset_config(PRESET).to_dict())
    result = plan(shape, make_cluster(2, 1, "80GiB"), Workload(seq_len=SEQ_LEN), ("local", "fsdp"))
    assert {c.layout.describe() for c in result.ranked if c.layout.ep > 1} == {"fsdp EP2 DP2", "fsdp EP2 DP2 recompute"}


def test_a_family_toolkit_moe_does_not_patch_gets_no_local_expert_parallelism():
    from toolkit.models import preset_config
    from toolkit.plan import Workload, make_cluster, plan, shape_from_config

    shape = shape_from_config(preset_config("tiny-deepseek-v3").to_dict())
    result = plan(shape, make_cluster(2, 1, "80GiB"), Workload(seq_len=SEQ_LEN), ("local",))
    assert not any(c.layout.ep > 1 for c in result.ranked)
    assert any("toolkit-moe" in c.rejected and "deepseek_v3" in c.rejected for c in result.rejected if c.layout.ep > 1)


def test_the_printed_command_is_accepted_by_the_cli_and_the_runner(monkeypatch):
    """The plan's command line for local EP2, parsed by the real ``toolkit`` CLI (training replaced by a recorder),
    resolves to the planned layout and passes the runner's check on two processes (the axis comes from toolkit-moe)."""
    import toolkit.train.runner as runner
    from toolkit.cli import main
    from toolkit.plan.search import training_command
    from toolkit.train.runner import resolve_components

    result = _plan(global_batch_size=4)
    command = training_command(result, _local_ep(result).layout)
    assert command[:4] == ["toolkit", "launch", "--nproc", "2"]
    line = shlex.join(command)
    from toolkit.plan.report import render

    assert line in render(result, top=len(result.ranked))
    seen = []
    monkeypatch.setattr(runner, "run_training", lambda recipe, **_: seen.append(recipe))
    main(command[4:])
    recipe = seen[0]
    assert (recipe.strategy, recipe.expert_parallel, recipe.section("moe")["enabled"]) == ("local", 2, True)
    assert (recipe.seq_len, recipe.micro_batch_size, recipe.global_batch_size, recipe.precision) == (SEQ_LEN, 1, 4, "bf16")
    resolve_components(recipe, world_size=2)  # raises LayoutError where the layout cannot run


def expert_parallel_state(directory: str) -> int:
    """On each of two gloo ranks: the bytes toolkit-moe's local EP2 engine holds for training after one step."""
    from toolkit.models import preset_config
    from toolkit.plan.measure import engine_allocated_bytes, local_engine

    config = {"model_type": "qwen3_moe", **preset_config(PRESET).to_diff_dict()}
    engine, _, step = local_engine(config, directory, seq_len=SEQ_LEN,
                                   extra={"expert_parallel": 2, "moe": {"enabled": True}})
    step()  # creates the AdamW moments
    return engine_allocated_bytes(engine)


@pytest.mark.slow
def test_planned_state_per_rank_equals_what_the_expert_parallel_engine_holds(tmp_path):
    """bf16 parameters, fp32 master weights and AdamW moments on each of two ranks of ``--strategy local --ep 2``
    (bf16, master weights): the planner's weights + masters + optimizer states of its local EP2 candidate, where the
    experts are halved and the rest replicated. The fp32 master gradients are freed after the step (set to None)."""
    import torch
    import transformers

    from toolkit.models import preset_config
    from toolkit.testing import run_distributed

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(preset_config(PRESET), dtype=torch.bfloat16).save_pretrained(tmp_path)
    held = run_distributed(expert_parallel_state, nproc=2, args=(str(tmp_path),), timeout=240)
    memory = _local_ep(_plan()).memory
    planned = memory.weights + memory.master + memory.optimizer
    assert held == [pytest.approx(planned, rel=1e-9)] * 2
    one_process = _plan(gpus=1).ranked[0].memory  # every expert on one rank: more than the EP2 rank holds
    assert one_process.weights + one_process.master + one_process.optimizer > 1.2 * planned
