"""Tiny MoE configs of each supported family, built locally (tests, examples; no hub)."""

from __future__ import annotations


def tiny_config(model_type: str, **overrides):
    """A tiny transformers config of ``model_type`` (hidden 32, 8 experts, top-2)."""
    import transformers

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=64, num_experts_per_tok=2)
    if model_type == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=8, **common)
    elif model_type == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(num_experts=8, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                             norm_topk_prob=False, **common)
    elif model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=8, moe_intermediate_size=24, norm_topk_prob=True, **common)
    else:
        raise ValueError(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config
