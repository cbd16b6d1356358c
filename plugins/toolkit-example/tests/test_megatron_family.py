"""The family this plugin teaches the Megatron bridge: found through the installed entry point, and a tiny
IQuest-Coder model converted by the bridge gives transformers' logits (one process, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from toolkit.errors import ModelError

pytest.importorskip("toolkit_megatron", reason="the family extends toolkit-megatron's bridge")


def test_the_family_is_registered_through_the_entry_point(toolkit_manager):
    from toolkit_example.megatron_family import IQuestCoderArchitecture
    from toolkit_megatron.architectures import architecture_for

    registry = toolkit_manager().registry("architecture")  # the installed plugins, found by their entry points
    assert registry.get("megatron:iquestcoder") is IQuestCoderArchitecture and registry.owner("megatron:iquestcoder") == "example"
    assert architecture_for("iquestcoder") is IQuestCoderArchitecture
    toolkit_manager(installed=False)  # without this plugin the bridge refuses the family, naming the hook
    with pytest.raises(ModelError, match="no architecture for model_type 'iquestcoder'.*toolkit_register_architectures"):
        architecture_for("iquestcoder")


def test_the_bridge_converts_the_family_to_transformers_logits(toolkit_manager, tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.bridge import SafetensorsReader, load_hf_weights
    from toolkit_megatron.model import build_model, initialize_parallel
    from toolkit_megatron.schedule import gather_logits

    toolkit_manager()
    config = AutoConfig.for_model("iquestcoder", vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        initialize_parallel(ParallelLayout())
        models = build_model(hf.config, ParallelLayout())
        load_hf_weights(models, hf.config, SafetensorsReader.from_directory(tmp_path))
        logits = gather_logits(models, ids)
    finally:
        parallel_state.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
    with torch.no_grad():
        reference = hf(ids).logits
    assert (logits - reference).abs().max().item() <= 1e-4
