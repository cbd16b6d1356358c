"""Per-family MoE facts (transformers 5.x): where the sparse block is and how it routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeFamily:
    """What differs between the HF MoE families this plugin patches."""

    model_type: str
    block_class: str
    """Class name of the HF sparse MoE block the patch replaces."""
    num_experts_key: str
    shared_expert: bool
    """Qwen2-MoE: a dense shared expert added through a sigmoid gate."""
    always_normalize: bool = False
    """Mixtral renormalises top-k (top-k then softmax); Qwen follows ``norm_topk_prob``."""
    jitter_key: str | None = None

    def num_experts(self, config: Any) -> int:
        return int(getattr(config, self.num_experts_key))

    def top_k(self, config: Any) -> int:
        return int(config.num_experts_per_tok)

    def normalize(self, config: Any) -> bool:
        return self.always_normalize or bool(getattr(config, "norm_topk_prob", False))

    def jitter(self, config: Any) -> float:
        return float(getattr(config, self.jitter_key, 0.0) or 0.0) if self.jitter_key else 0.0

    def aux_loss_coef(self, config: Any) -> float:
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)

    def z_loss_coef(self, config: Any) -> float:
        return float(getattr(config, "router_z_loss_coef", 0.0) or 0.0)


FAMILIES: dict[str, MoeFamily] = {
    f.model_type: f
    for f in (
        MoeFamily("qwen2_moe", "Qwen2MoeSparseMoeBlock", "num_experts", shared_expert=True),
        MoeFamily("qwen3_moe", "Qwen3MoeSparseMoeBlock", "num_experts", shared_expert=False),
        MoeFamily("mixtral", "MixtralSparseMoeBlock", "num_local_experts", shared_expert=False,
                  always_normalize=True, jitter_key="router_jitter_noise"),
    )
}
