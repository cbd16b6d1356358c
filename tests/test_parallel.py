"""toolkit.parallel: one layout object's arithmetic and error text, used by the runner (axes a strategy
supports), the megatron engine and exporter, and the planner."""

from __future__ import annotations

import pytest

from toolkit.errors import LayoutError
from toolkit.parallel import ModelShape, ParallelLayout

LLAMA = ModelShape(heads=4, kv_heads=2, ffn=256, layers=4, model_type="llama")
MOE = ModelShape(heads=4, kv_heads=2, ffn=256, layers=4, experts=4, model_type="qwen3_moe")


def problems(layout: ParallelLayout, shape: ModelShape, world: int, seq_len: int | None = None) -> str:
    return "\n".join(layout.world_problems(world) + layout.model_problems(shape, seq_len))


def test_bad_layouts_show_the_arithmetic():
    text = problems(ParallelLayout(tensor=4, pipeline=3), LLAMA, 8)
    assert "world size 8 is not divisible by tp*pp*cp = 4*3*1 = 12" in text
    assert "key/value heads 2 / tp 4 = 0.50" in text
    assert "num_hidden_layers 4 / (pp 3 * vpp 1) = 1.33" in text
    assert "seq_len 30 % (2 * cp 2) = 2" in problems(ParallelLayout(context=2), LLAMA, 2, 30)
    assert "sequence parallelism needs tp >= 2" in problems(ParallelLayout(sequence_parallel=True), LLAMA, 1)
    assert "vpp 2 needs pp >= 2" in problems(ParallelLayout(virtual=2), LLAMA, 1)
    assert problems(ParallelLayout(tensor=2, pipeline=2, virtual=2), LLAMA, 4, 32) == ""
    assert "ep 2 needs a mixture-of-experts model (llama has no experts)" in problems(ParallelLayout(expert=2), LLAMA, 2)
    assert "num_experts 4 / ep 3 = 1.33" in problems(ParallelLayout(expert=3), MOE, 3)
    assert "etp 2 needs a mixture-of-experts model" in problems(ParallelLayout(expert_tensor=2), LLAMA, 2)
    assert "world size 2 is not divisible by ep*etp*pp = 2*2*1" in problems(ParallelLayout(expert=2, expert_tensor=2), MOE, 2)
    assert "MoE with tp > 1 needs --sequence-parallel" in problems(ParallelLayout(tensor=2), MOE, 2)


def test_latent_attention_widths_must_split_over_tp():
    """MLA's down-projections are column-parallel in Megatron: their widths divide by TP, in the engine and the planner."""
    from toolkit.models import preset_config
    from toolkit.plan.memory import Layout, Workload
    from toolkit.plan.model import shape_from_config
    from toolkit.plan.search import structural_problem

    config = preset_config("tiny-deepseek-v3", kv_lora_rank=30)  # + qk_rope_head_dim 16 = 46
    text = problems(ParallelLayout(tensor=4, sequence_parallel=True), ModelShape.of(config), 4)
    assert "kv_lora_rank + qk_rope_head_dim 46 / tp 4 = 11.50" in text and "q_lora_rank" not in text
    assert "q_lora_rank 64 / tp 3" in problems(ParallelLayout(tensor=3, sequence_parallel=True), ModelShape.of(config), 3)
    assert problems(ParallelLayout(tensor=2, sequence_parallel=True), ModelShape.of(config), 2, 32) == ""
    planned = structural_problem(shape_from_config(config.to_dict()), Layout("megatron", tp=4), Workload(seq_len=64), 64)
    assert planned is not None and "kv_lora_rank + qk_rope_head_dim 46 / tp 4" in planned


def test_one_process_is_told_how_many_to_launch_and_how():
    [text] = ParallelLayout(tensor=2, pipeline=2).world_problems(1)
    assert "needs a multiple of 4 processes and this is one process" in text and "torchrun --nproc-per-node 4" in text
    assert ParallelLayout(expert=4, expert_tensor=1).needed_processes() == 4  # experts alone ask for processes
    assert ParallelLayout(tensor=2, expert=4, expert_tensor=1).needed_processes() == 4


def test_check_raises_one_error_with_every_problem():
    from toolkit.models import preset_config

    config = preset_config("tiny-llama")
    with pytest.raises(LayoutError) as error:
        ParallelLayout(tensor=3, virtual=2).check(config, 3)
    lines = str(error.value).splitlines()
    assert lines[0].startswith("layout tp=3 pp=1 vpp=2 cannot run llama") and len(lines) >= 3


def test_flags_parse_back_to_the_same_layout():
    from toolkit.recipe import resolve_recipe

    layout = ParallelLayout(tensor=2, pipeline=2, virtual=2, context=2, sequence_parallel=True, expert=2, expert_tensor=2)
    flags = layout.flags().split()
    values, i = {}, 0
    names = {"--tp": "tensor_parallel", "--pp": "pipeline_parallel", "--vpp": "virtual_pipeline", "--cp": "context_parallel",
             "--ep": "expert_parallel", "--etp": "expert_tensor_parallel"}
    while i < len(flags):
        if flags[i] == "--sequence-parallel":
            values["sequence_parallel"], i = True, i + 1
        else:
            values[names[flags[i]]], i = int(flags[i + 1]), i + 2
    assert ParallelLayout.from_recipe(resolve_recipe(values)) == layout


def test_a_strategy_is_refused_the_axes_it_does_not_declare_naming_one_that_has_them(toolkit_manager):
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import unsupported_axes

    manager = toolkit_manager(installed=False)  # the core's strategies only: none splits models
    local = manager.get("strategy", "local")
    recipe = resolve_recipe({"tensor_parallel": 2, "context_parallel": 2})
    found = unsupported_axes(recipe, local, manager)
    assert [p.split(" needs")[0] for p in found] == ["--tp 2", "--cp 2"]
    assert all("--strategy megatron (pip install toolkit-megatron" in p and "splits models along data parallelism only" in p
               for p in found)
    assert unsupported_axes(resolve_recipe({}), local, manager) == []

    class Splitter:  # a third party's strategy that declares tp
        name, parallel_axes = "splitter", frozenset({"tp"})

    assert unsupported_axes(recipe, Splitter, manager) == [found[1].replace("--strategy local splits models along data "
                                                                            "parallelism only", "--strategy splitter splits models along tp")]


def test_a_plugin_adds_an_axis_to_a_strategy_it_did_not_register(toolkit_manager):
    """toolkit_strategy_axes: the axis becomes supported by that strategy only, and is named as its provider."""
    from toolkit import hookimpl
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import unsupported_axes

    class ContextForLocal:
        @staticmethod
        @hookimpl
        def toolkit_strategy_axes(strategy):
            return ["cp"] if strategy == "local" else []

    manager = toolkit_manager(ContextForLocal, installed=False)
    local, fsdp = manager.get("strategy", "local"), manager.get("strategy", "fsdp")
    assert manager.parallel_axes(local) == {"cp"} and manager.parallel_axes(fsdp) == frozenset()
    recipe = resolve_recipe({"tensor_parallel": 2, "context_parallel": 2})
    assert [p.split(" (")[0] for p in unsupported_axes(recipe, local, manager)] == ["--tp 2 needs --strategy megatron"]
    assert unsupported_axes(resolve_recipe({"context_parallel": 2}), fsdp, manager) == [
        "--cp 2 needs --strategy local: --strategy fsdp splits models along data parallelism only"]


def test_the_planner_refuses_what_the_layout_refuses():
    """The planner's structural check and ParallelLayout agree on every rule they share."""
    from toolkit.plan.memory import Layout, Workload
    from toolkit.plan.model import ModelShape as PlanShape
    from toolkit.plan.search import structural_problem

    shape = PlanShape(name="t", model_type="llama", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=256, vocab=1000)
    work = Workload(seq_len=64)
    for tp, pp, vpp, cp in [(4, 1, 1, 1), (1, 3, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1), (1, 1, 1, 2), (8, 1, 1, 1)]:
        planned = structural_problem(shape, Layout("megatron", tp=tp, pp=pp, vpp=vpp, cp=cp), work, 64)
        rules = ParallelLayout(tensor=tp, pipeline=pp, virtual=vpp, context=cp, sequence_parallel=tp > 1).model_problems(
            ModelShape(heads=4, kv_heads=2, ffn=256, layers=4), work.seq_len)
        assert (planned is None) == (rules == []), (tp, pp, vpp, cp, planned, rules)


def test_the_planner_counts_global_batch_zero_as_training_does():
    """--global-batch-size 0: one micro-batch per data-parallel rank, in the planner's step and in Batches."""
    from toolkit.contracts import Example, Sequence
    from toolkit.data.pipeline import Batches
    from toolkit.plan import Workload, make_cluster, plan
    from toolkit.plan.model import ModelShape as PlanShape

    shape = PlanShape(name="t", model_type="llama", hidden=512, layers=4, heads=8, kv_heads=8, head_dim=64, ffn=1024, vocab=1000)
    result = plan(shape, make_cluster(4, 1, "80GiB"), Workload(seq_len=256, micro_batch_size=2, global_batch_size=0), ("local",))
    best = result.ranked[0]
    assert best.layout.dp == 4 and result.global_rows == 2 * 4 == best.time.tokens_per_step // 256
    examples = [Example([Sequence([1, 2, 3], [2, 3, -100])]) for _ in range(64)]
    batches = Batches(examples, seed=0, seq_len=16, packing=False, micro_batch_size=2, global_batch_size=0, dp_rank=0,
                      dp_world_size=best.layout.dp, pad_id=0)
    assert batches.global_batch_size == result.global_rows and batches.accumulation == 1


def test_export_layout_flags_reach_a_layout_exporter_and_are_refused_elsewhere(toolkit_manager):
    import dataclasses
    from typing import ClassVar

    from toolkit import hookimpl
    from toolkit.commands.export import layout_options
    from toolkit.config import option
    from toolkit.errors import ConfigError

    @dataclasses.dataclass(kw_only=True)
    class Sizes:
        tp: int = option(1, help="tp")
        pp: int = option(1, help="pp")

    class Sharded:
        name: ClassVar[str] = "sharded"
        Config: ClassVar[type] = Sizes

    class plugin:  # noqa: N801
        @staticmethod
        @hookimpl
        def toolkit_register_exporters(register):
            register(Sharded)

    toolkit_manager(("sharded-plugin", plugin), installed=False)
    assert layout_options("sharded", {"tp": 2, "pp": 4, "vpp": None, "ep": None}) == ["tp=2", "pp=4"]
    assert layout_options("hf", {"tp": None, "pp": None, "vpp": None, "ep": None}) == []
    with pytest.raises(ConfigError, match="--tp set the parallel layout an exporter writes .*--to hf writes none"):
        layout_options("hf", {"tp": 2, "pp": None, "vpp": None, "ep": None})
    with pytest.raises(ConfigError, match="--vpp"):
        layout_options("sharded", {"tp": None, "pp": None, "vpp": 2, "ep": None})
