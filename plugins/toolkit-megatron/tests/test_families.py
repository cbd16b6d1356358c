"""Per-family facts of the bridge checked in one process (no Megatron model): RoPE variants equal HF's
rotary embedding, configs the bridge cannot reproduce are refused in one line naming the piece."""

from __future__ import annotations

import pytest
import torch

from toolkit.errors import ModelError
from toolkit_megatron.architectures import architecture_for


def _hf_rotated(hf_config, module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x [b, h, s, d]`` rotated by HF's own rotary embedding and ``apply_rotary_pos_emb`` of ``module``."""
    rotary = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))(hf_config)
    cos, sin = rotary(x, positions)
    return module.apply_rotary_pos_emb(x, x, cos, sin)[0]


ROPES = {
    "llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "yarn": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64})),
}


@pytest.mark.parametrize("variant", list(ROPES))
def test_rope_equals_hf_rotary_embedding(variant):
    import importlib

    from transformers import AutoConfig

    from toolkit_megatron.attention import apply_rope

    model_type, extra = ROPES[variant]
    hf_config = AutoConfig.for_model(model_type, hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                                     **extra)
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    x = torch.randn(2, 4, 16, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16)[None].repeat(2, 1)
    expected = _hf_rotated(hf_config, module, x, positions)
    rope = architecture_for(model_type).rope(hf_config)
    inv_freq = torch.tensor(rope.long_inv_freq if rope.long_inv_freq and 16 > rope.long_after else rope.inv_freq)
    got = apply_rope(x.permute(2, 0, 1, 3), positions, inv_freq, rope.scaling, rope.interleaved).permute(1, 2, 0, 3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_rope_whose_frequencies_follow_the_length_is_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ModelError, match="rope_type 'dynamic' is not supported by the Megatron bridge.*--strategy local"):
        architecture_for("llama").check(config)
