"""Layout validation, the architecture registry and the CPU compatibility layer (one process)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from toolkit.errors import LayoutError, ModelError
from toolkit.parallel import ParallelLayout
from toolkit_megatron.model import padded_vocab_size


def test_bad_layouts_show_the_arithmetic():
    config = tiny_config("llama")  # 4 heads, 2 kv heads, 4 layers, ffn 256
    with pytest.raises(LayoutError) as error:
        ParallelLayout(tensor=4, pipeline=3).check(config, 8)
    text = str(error.value)
    assert "world size 8 is not divisible by tp*pp*cp = 4*3*1 = 12" in text
    assert "key/value heads 2 / tp 4 = 0.50" in text
    assert "num_hidden_layers 4 / (pp 3 * vpp 1) = 1.33" in text
    with pytest.raises(LayoutError, match=r"seq_len 30 % \(2 \* cp 2\) = 2"):
        ParallelLayout(context=2).check(config, 2, 30)
    with pytest.raises(LayoutError, match="sequence parallelism needs tp >= 2"):
        ParallelLayout(sequence_parallel=True).check(config, 1)
    with pytest.raises(LayoutError, match="vpp 2 needs pp >= 2"):
        ParallelLayout(virtual=2).check(config, 1)
    ParallelLayout(tensor=2, pipeline=2, virtual=2).check(config, 4, 32)
    with pytest.raises(LayoutError, match="ep 2 needs a mixture-of-experts model"):
        ParallelLayout(expert=2).check(config, 2)
    with pytest.raises(LayoutError, match=r"num_experts 4 / ep 3 = 1.33"):
        ParallelLayout(expert=3).check(tiny_config("qwen3_moe"), 3)
    with pytest.raises(LayoutError, match="etp 2 needs a mixture-of-experts model"):
        ParallelLayout(expert_tensor=2).check(config, 2)
    with pytest.raises(LayoutError, match=r"world size 2 is not divisible by ep\*etp\*pp = 2\*2\*1"):
        ParallelLayout(expert=2, expert_tensor=2).check(tiny_config("mixtral"), 2)
    with pytest.raises(LayoutError, match="MoE with tp > 1 needs --sequence-parallel"):
        ParallelLayout(tensor=2).check(tiny_config("mixtral"), 2)


def test_vocab_padding():
    assert padded_vocab_size(301, 2) == 302
    assert padded_vocab_size(301, 1) == 301
    assert padded_vocab_size(128256, 8) == 128256


def test_third_party_architecture_is_found():
    from toolkit import hookimpl
    from toolkit.plugins import build_plugin_manager, set_plugin_manager
    from toolkit_megatron.architectures import DenseArchitecture, architecture_for

    class Granite(DenseArchitecture):
        name = "megatron:granite-like"
        families = ("granite-like",)

    class Plugin:
        @hookimpl
        def toolkit_register_architectures(self, register):
            register(Granite)

    previous = set_plugin_manager(build_plugin_manager([("granite-like", Plugin())]))
    try:
        assert architecture_for("granite-like") is Granite
        assert architecture_for("qwen3").qk_norm
        with pytest.raises(ModelError, match="no architecture for model_type 'gpt2'.*toolkit_register_architectures"):
            architecture_for("gpt2")
    finally:
        set_plugin_manager(previous)


def test_an_unknown_family_is_refused_first_by_training_and_export(tmp_path):
    """Before the layout check reads sizes the config may not have (GPT-2 has no intermediate_size), before any
    process group: one line listing the known families and the hook that adds one."""
    from types import SimpleNamespace

    from transformers import GPT2Config

    from toolkit.contracts import ExportModel
    from toolkit.plugins import get_plugin_manager
    from toolkit_megatron.strategy import MegatronEngine

    source = SimpleNamespace(config=GPT2Config(n_layer=2, n_embd=64, n_head=4), directory=tmp_path)
    refusal = r"no architecture for model_type 'gpt2'; supported: (.*, )?llama, .*qwen3_moe.*toolkit_register_architectures"
    with pytest.raises(ModelError, match=refusal):
        MegatronEngine(source, None, None, None, None)
    with pytest.raises(ModelError, match=refusal):
        get_plugin_manager().create("exporter", "mcore").export(ExportModel(source=source, tensors=iter), tmp_path / "out", {"tp": 1})
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is inactive with CUDA")
def test_cpu_compat_redirects_cuda_sites_only_inside():
    from toolkit_megatron.compat import cpu_compat, redirected_sites

    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")
    with cpu_compat():
        with cpu_compat():  # re-entrant
            x = torch.zeros(2, device="cuda")
        y = torch.ones(3, device=torch.cuda.current_device())
        assert x.device.type == y.device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.ones(1).type() == "torch.cuda.FloatTensor"
        state = torch.cuda.get_rng_state()
        first = torch.rand(1)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(1), first)
        torch.cuda.synchronize()
        torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    assert any("test_layout.py" in site for site in redirected_sites())
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(2, device="cuda")
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_the_checkpoint_writers_results_queue_is_forked_not_spawned():
    """Megatron-Core starts the manager of its write-results queue by spawn: a fresh interpreter that imports torch
    to unpickle the results, 3.5 s of CPU in every process that saves. save_mcore starts it by fork first (CPU-only
    processes: a CUDA one keeps the spawn)."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from toolkit_megatron.checkpoint import _start_results_queue, stop_checkpoint_workers

    _start_results_queue()
    try:
        managers = [c for c in multiprocessing.active_children() if c.name.startswith("SyncManager")]
        assert filesystem_async._results_queue is not None and managers
        assert {type(c._popen).__module__ for c in managers} == {"multiprocessing.popen_fork"}
        get_queue = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
        assert get_queue() is filesystem_async._results_queue  # megatron-core 0.19 names it without the underscore
    finally:
        stop_checkpoint_workers()
    assert filesystem_async._results_queue is None
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("SyncManager")]


def test_a_parallel_layout_in_one_process_says_how_to_launch_it():
    from toolkit.recipe import resolve_recipe
    from toolkit_megatron.strategy import MegatronStrategy

    recipe = resolve_recipe({"strategy": "megatron", "tensor_parallel": 2})
    [problem] = MegatronStrategy().validate(recipe, world_size=1)
    assert "needs a multiple of 2 processes and this is one process" in problem
    assert "toolkit launch --nproc 2 " in problem and "torchrun --nproc-per-node 2 -m toolkit " in problem
    [problem] = MegatronStrategy().validate(recipe, world_size=3)
    assert "world size 3 is not divisible by tp*pp*cp = 2*1*1 = 2; launch a multiple of 2 processes" in problem


def test_megatron_fallback_warnings_become_one_line(recwarn):
    import warnings

    from toolkit_megatron.notices import fallback_notice, silence_fallback_warnings

    silence_fallback_warnings()
    warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning, stacklevel=2)
    warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=2)
    warnings.warn("an unrelated warning", UserWarning, stacklevel=2)
    assert [str(w.message) for w in recwarn] == ["an unrelated warning"]
    line = fallback_notice(on_cuda=True, tensor_parallel=2)
    assert line.startswith("toolkit-megatron: ") and "\n" not in line
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in line and "no cost on CPU" not in line
