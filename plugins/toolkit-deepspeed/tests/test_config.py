"""Flag -> DeepSpeed JSON mapping, merging a user's JSON, and refusals before any model is built."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from typing import Any, ClassVar

import pytest

from toolkit import hookimpl
from toolkit.errors import LayoutError
from toolkit.plugins import build_plugin_manager, set_plugin_manager
from toolkit.recipe import resolve_recipe
from toolkit_deepspeed.config import merge_config
from toolkit_deepspeed.strategy import DeepSpeedStrategy


@dataclasses.dataclass(kw_only=True)
class _NoOptions:
    pass


class FourBitTuner:
    """Stands in for QLoRA: loads its base through a bitsandbytes quantization config."""

    name: ClassVar[str] = "fourbit"
    Config: ClassVar[type] = _NoOptions

    def __init__(self, config: Any = None):
        self.config = config

    def validate(self, recipe, source):
        return []

    def model_load_kwargs(self):
        return {"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}}


@pytest.fixture
def manager():
    plugin = types.SimpleNamespace(toolkit_register_tuners=hookimpl(lambda register: register(FourBitTuner)))
    previous = set_plugin_manager(build_plugin_manager(extra_plugins=[("test-fourbit", plugin)]))
    yield
    set_plugin_manager(previous)


def recipe(manager=None, **values):
    return resolve_recipe({"strategy": "deepspeed", "zero": 2, **values}, source="test")


def validate(values: dict, world_size: int = 2) -> list[str]:
    r = recipe(**values)
    return DeepSpeedStrategy(DeepSpeedStrategy.Config(**r.section("deepspeed"))).validate(r, world_size)


def write_json(tmp_path, data) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data, indent=2))
    return str(path)


def test_plugin_registers_the_strategy_without_importing_torch():
    code = ("import sys; from toolkit.plugins import get_plugin_manager; m = get_plugin_manager(); "
            "cls = m.get('strategy', 'deepspeed'); assert m.registry('strategy').owner('deepspeed') == 'deepspeed'; "
            "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_flags_map_to_deepspeed_keys(manager):
    r = recipe(zero=3, micro_batch_size=2, global_batch_size=16, max_grad_norm=0.5, precision="bf16",
               deepspeed={"offload_optimizer": "cpu", "offload_param": "cpu"})
    config, problems = merge_config(r, DeepSpeedStrategy.Config(**r.section("deepspeed")), world_size=2, user={})
    assert problems == []
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"], config["train_batch_size"]) == (2, 4, 16)
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    assert "optimizer" not in config and "scheduler" not in config  # the engine passes its own AdamW + schedule


def test_user_json_is_merged_keeping_keys_the_flags_do_not_cover(manager, tmp_path):
    path = write_json(tmp_path, {"zero_optimization": {"stage": "auto", "reduce_bucket_size": 1234, "overlap_comm": False},
                                 "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0,
                                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.0}},
                                 "communication_data_type": "fp32"})
    r = recipe(zero=2, deepspeed={"config": path})
    options = DeepSpeedStrategy.Config(**r.section("deepspeed"))
    config, problems = merge_config(r, options, world_size=2)
    assert problems == []
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["reduce_bucket_size"] == 1234 and config["zero_optimization"]["overlap_comm"] is False
    assert config["communication_data_type"] == "fp32" and config["train_micro_batch_size_per_gpu"] == 1


def test_json_contradicting_flags_lists_every_conflict(manager, tmp_path):
    path = write_json(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                 "bf16": {"enabled": True}, "gradient_clipping": 5.0,
                                 "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR"}})
    problems = validate({"zero": 3, "lr": 1e-4, "deepspeed": {"config": path}})
    text = "\n".join(problems)
    assert path in text
    for needle in ("zero_optimization.stage = 2 contradicts --zero", "offload_optimizer.device = \"cpu\" contradicts --deepspeed-offload-optimizer",
                   "bf16.enabled = true contradicts --precision", "gradient_clipping = 5.0 contradicts --max-grad-norm",
                   "optimizer.params.lr = 0.1 contradicts --lr", "'scheduler' section is not supported"):
        assert needle in text, (needle, text)


def test_runner_refuses_conflicts_before_loading_the_model(manager, tmp_path):
    from toolkit.train.runner import resolve_components

    path = write_json(tmp_path, {"zero_optimization": {"stage": 1}})
    with pytest.raises(LayoutError, match=r"zero_optimization.stage = 1 contradicts --zero \(which gives 3\)"):
        resolve_components(recipe(zero=3, deepspeed={"config": path}), world_size=2)


def test_broken_json_names_the_line(manager, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "zero_optimization": {"stage": 3,}\n}\n')
    problems = validate({"zero": 3, "deepspeed": {"config": str(path)}})
    assert any("not valid JSON at line 2" in p for p in problems), problems


def test_missing_json_file_is_reported_before_training(manager, tmp_path):
    problems = validate({"zero": 3, "deepspeed": {"config": str(tmp_path / "absent.json")}})
    assert any("absent.json: no such file" in p for p in problems), problems


def test_zero3_refuses_a_quantized_tuner_with_the_reason(manager):
    problems = validate({"zero": 3, "tuner": "fourbit"})
    assert any("--zero 3 cannot shard --tuner fourbit" in p and "quantized" in p for p in problems), problems
    assert validate({"zero": 2, "tuner": "fourbit"}) == []


@pytest.mark.parametrize(("values", "needle"), [
    ({"zero": 0}, "needs --zero 1, 2 or 3"),
    ({"zero": 2, "deepspeed": {"offload_param": "cpu"}}, "--deepspeed-offload-param cpu needs --zero 3"),
    ({"zero": 2, "precision": "fp16"}, "--precision fp16 is not supported"),
    ({"zero": 2, "global_batch_size": 3}, "must be a multiple of --micro-batch-size 1 x 2"),
])
def test_layouts_it_cannot_run_are_refused(manager, values, needle):
    problems = validate(values)
    assert any(needle in p for p in problems), problems


def test_model_splitting_axes_are_refused_before_validate_naming_who_splits(manager):
    from toolkit.plugins import get_plugin_manager
    from toolkit.train.runner import unsupported_axes

    problems = unsupported_axes(recipe(zero=2, tensor_parallel=2, sequence_parallel=True), DeepSpeedStrategy, get_plugin_manager())
    assert len(problems) == 2 and problems[0].startswith("--tp 2 needs --strategy megatron")
    assert problems[1].startswith("--sequence-parallel needs --strategy megatron")
    assert all("--strategy deepspeed splits models along data parallelism only" in p for p in problems)


def test_consistent_layout_has_no_problems(manager):
    assert validate({"zero": 3, "precision": "bf16", "deepspeed": {"offload_optimizer": "cpu", "offload_param": "cpu"}}) == []


def test_resume_on_another_number_of_ranks_is_refused_with_what_to_do(tmp_path):
    from toolkit.errors import ToolkitError
    from toolkit_deepspeed.engine import check_checkpoint

    with pytest.raises(ToolkitError, match="holds no DeepSpeed checkpoint"):
        check_checkpoint(tmp_path, 2, 3)
    shards = tmp_path / "deepspeed"
    shards.mkdir()
    for rank in range(2):
        (shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    check_checkpoint(tmp_path, 2, 3)
    with pytest.raises(ToolkitError, match="written by 2 data-parallel ranks and this run has 4.*--nproc 2"):
        check_checkpoint(tmp_path, 4, 3)
    (tmp_path / "deepspeed-layout.json").write_text('{"zero_stage": 2, "world_size": 2}')
    with pytest.raises(ToolkitError, match="written with --zero 2 and this run has --zero 3; resume with --zero 2"):
        check_checkpoint(tmp_path, 2, 3)
