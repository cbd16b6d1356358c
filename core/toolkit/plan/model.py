"""The shape of a decoder-only transformer as the planner sees it, read from an HF ``config.json``.

Only the numbers that decide memory and FLOPs are kept (hidden size, layers, heads, FFN, vocab,
experts); no weights are read, so a hand-written config of a 70B model plans as well as a real one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.errors import ModelError

# model_type -> how its MoE fields are spelled; dense families need nothing special.
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "glm4", "internlm3", "olmo",
                  "olmo2", "granite")
# model_type -> hidden-sized RMSNorms per layer beyond the two every family has (post-sublayer norms)
EXTRA_NORMS = {"glm4": 2, "gemma2": 2, "gemma3_text": 2}
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3_text")
# model_type -> RMSNorms computed in fp32 throughout and scaled by (1 + weight) (Gemma): they keep an fp32 normalised value
ZERO_CENTERED_NORM_FAMILIES = ("gemma", "gemma2", "gemma3_text")
# model_type -> transformers runs it with eager attention (SDPA has no attention soft-capping): the [b, h, s, s] scores
# are kept for backward on the HF-module strategies under --local-packed-attention sdpa-mask (and on CPU); FlexAttention
# (the GPU's auto) and the Megatron bridge cap the scores inside the kernel and keep none
EAGER_ATTENTION_FAMILIES = ("gemma2",)
# model_type -> HF linears that hold several projections (LoRA adapts the fused module: one A for all its parts)
FUSED_LINEARS = {"phi3": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
                 "glm4": {"gate_up_proj": ("gate_proj", "up_proj")}}
# MoE families: transformers 5 keeps each layer's experts as 3-D parameters (gate_up_proj, down_proj)
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention
# model_type -> every layer attends within ``sliding_window`` when it is set (transformers' modeling code ignores
# ``layer_types`` for these; qwen3_moe only with ``use_sliding_window``)
WINDOW_EVERY_LAYER_FAMILIES = ("mistral", "mixtral", "phi3", "qwen3_moe")
USE_SLIDING_WINDOW_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
"""Families whose ``sliding_window`` counts only with ``use_sliding_window: true`` (their config classes drop it)."""


@dataclass(frozen=True)
class ModelShape:
    """Sizes of one model. ``experts == 0`` means dense; MoE layers replace the dense MLP."""

    name: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = True
    moe_layers: int = 0
    moe_pattern: tuple[bool, ...] = ()
    """Per layer, whether its MLP is MoE, where dense and MoE layers mix (``mlp_only_layers``,
    ``decoder_sparse_step``, ``first_k_dense_replace``); empty when every layer is alike."""
    q_lora_rank: int = 0
    """Multi-head latent attention (``kv_lora_rank > 0``): the query latent (0: queries projected directly),
    the key/value latent, the rotary part of ``head_dim`` (shared by all heads) and the value head size."""
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_windows: tuple[int, ...] = ()
    """Per layer, the sliding window of its attention (0: full causal attention), as transformers decides it
    (:func:`attention_windows`); empty when no layer is windowed."""
    config: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The config.json it was read from (None: built by hand), for strategies' own checks of it."""

    # ------------------------------------------------------------------ parameter counts
    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_width(self) -> int:
        """Mean of the query-key and value widths: the attention scores' FLOPs per token are ``4 * seq * width``."""
        return (self.q_dim + self.heads * self.v_head_dim) // 2 if self.is_mla else self.q_dim

    @property
    def attention_matmul_params(self) -> int:
        """Weights of one layer's attention projections (MLA: down- and up-projections of the latents)."""
        h = self.hidden
        if self.is_mla:
            q = h * self.q_lora_rank + self.q_lora_rank * self.q_dim if self.q_lora_rank else h * self.q_dim
            nope = self.head_dim - self.rope_head_dim
            kv = h * (self.kv_lora_rank + self.rope_head_dim) + self.kv_lora_rank * self.heads * (nope + self.v_head_dim)
            return q + kv + self.heads * self.v_head_dim * h
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h

    @property
    def attention_params(self) -> int:
        """Q, K, V, O projections (+ biases) and the two norms of one layer (MLA: and its latents' norms)."""
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.model_type in QK_NORM_FAMILIES else 0
        latent_norms = self.q_lora_rank + self.kv_lora_rank
        return self.attention_matmul_params + bias + qk_norm + latent_norms + (2 + EXTRA_NORMS.get(self.model_type, 0)) * self.hidden

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.ffn

    @property
    def expert_params_per_layer(self) -> int:
        """Routed experts of one MoE layer (these are what expert parallelism splits)."""
        return self.experts * 3 * self.hidden * self.expert_ffn

    @property
    def moe_shared_params_per_layer(self) -> int:
        """Router, shared expert and its gate: replicated over expert-parallel ranks."""
        gate = self.hidden if self.shared_expert_ffn and self.shared_expert_gate else 0
        shared = 3 * self.hidden * self.shared_expert_ffn + gate
        return self.hidden * self.experts + shared

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def output_params(self) -> int:
        """The LM head; zero extra parameters when tied to the embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def layer_params_nonexpert(self) -> int:
        """All parameters of the decoder layers except routed experts."""
        moe = self.moe_layers * self.moe_shared_params_per_layer
        return self.layers * self.attention_params + self.dense_layers * self.dense_mlp_params + moe

    @property
    def expert_params(self) -> int:
        return self.moe_layers * self.expert_params_per_layer

    @property
    def total_params(self) -> int:
        return (self.embedding_params + self.output_params + self.hidden
                + self.layer_params_nonexpert + self.expert_params)

    @property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies by (top-k experts only, LM head included once)."""
        attention = self.layers * self.attention_matmul_params
        dense = self.dense_layers * self.dense_mlp_params
        moe = self.moe_layers * (self.experts_per_token * 3 * self.hidden * self.expert_ffn
                                 + 3 * self.hidden * self.shared_expert_ffn + self.hidden * self.experts)
        return attention + dense + moe + self.vocab * self.hidden

    def attention_pairs(self, seq_len: int) -> int:
        """Query-key pairs the attention masks of all layers allow in a row of ``seq_len`` tokens (the useful work of
        the scores and of their product with the values: ``4 x attention_width`` FLOPs a pair in forward)."""
        windows = self.attention_windows or (0,) * self.layers
        return sum(causal_pairs(seq_len, window) for window in windows)

    def moe_layers_among(self, layers: list[int]) -> float:
        """How many of ``layers`` (indices) are MoE (without a pattern: their share of ``moe_layers``)."""
        if self.moe_pattern:
            return sum(self.moe_pattern[i] for i in layers)
        return self.moe_layers * len(layers) / self.layers

    def linear_params_per_layer(self, moe: bool | None = None) -> dict[str, tuple[int, int]]:
        """(in, out) features of the linears LoRA adapts in one layer: its dense MLP's, or (``moe``, the default
        for an MoE model) one expert's; a family's fused linears (Phi-3's qkv_proj, gate_up_proj) as one; MLA's
        latent projections."""
        ffn = self.expert_ffn if (self.is_moe if moe is None else moe) else self.ffn
        mlp = {"gate_proj": (self.hidden, ffn), "up_proj": (self.hidden, ffn), "down_proj": (ffn, self.hidden)}
        if self.is_mla:
            h, nope = self.hidden, self.head_dim - self.rope_head_dim
            query = ({"q_a_proj": (h, self.q_lora_rank), "q_b_proj": (self.q_lora_rank, self.q_dim)} if self.q_lora_rank
                     else {"q_proj": (h, self.q_dim)})
            return {**query, "kv_a_proj_with_mqa": (h, self.kv_lora_rank + self.rope_head_dim),
                    "kv_b_proj": (self.kv_lora_rank, self.heads * (nope + self.v_head_dim)),
                    "o_proj": (self.heads * self.v_head_dim, h), **mlp}
        linears = {"q_proj": (self.hidden, self.q_dim), "k_proj": (self.hidden, self.kv_dim),
                   "v_proj": (self.hidden, self.kv_dim), "o_proj": (self.q_dim, self.hidden), **mlp}
        for fused, parts in FUSED_LINEARS.get(self.model_type, {}).items():
            linears[fused] = (linears[parts[0]][0], sum(linears.pop(part)[1] for part in parts))
        return linears

    def lora_params(self, rank: int) -> int:
        """Adapter parameters PEFT (>= 0.22) creates for LoRA with ``target_modules="all-linear"``: rank ``r`` on
        every linear (dense MLPs, shared experts and Qwen2-MoE's shared-expert gate included) and, on every MoE
        family transformers 5 fuses (:data:`MOE_FAMILIES`), the router's ``gate.weight`` at rank r and the experts'
        3-D parameters through PEFT's ``target_parameters`` (``peft.utils.transformers_weight_conversion``): one
        A/B per expert, ``gate_up_proj`` at rank 2r (gate and up keep rank r each) and ``down_proj`` at rank r.
        tests/test_plan.py checks every family against PEFT."""
        mlp_names = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
        linears = self.linear_params_per_layer(False)
        attention = sum(rank * (i + o) for name, (i, o) in linears.items() if name not in mlp_names)
        dense_mlp = sum(rank * (i + o) for name, (i, o) in linears.items() if name in mlp_names)
        if not self.is_moe:
            return self.layers * (attention + dense_mlp)
        h, e, ffn = self.hidden, self.experts, self.expert_ffn
        router_and_experts = rank * (h + e) + e * 2 * rank * (h + 2 * ffn) + e * rank * (ffn + h)
        shared = 3 * rank * (h + self.shared_expert_ffn) if self.shared_expert_ffn else 0
        gate = rank * (h + 1) if self.shared_expert_ffn and self.shared_expert_gate else 0
        return (self.moe_layers * (attention + router_and_experts + shared + gate)
                + self.dense_layers * (attention + dense_mlp))

    def describe(self) -> str:
        kind = (f"MoE {self.experts} experts top-{self.experts_per_token}, expert FFN {self.expert_ffn}"
                if self.is_moe else f"dense, FFN {self.ffn}")
        if self.is_moe and self.dense_layers:
            kind += f" in {self.moe_layers} of {self.layers} layers (the others dense, FFN {self.ffn})"
        windowed = [w for w in self.attention_windows if w]
        if windowed:
            sizes = "/".join(str(w) for w in sorted(set(windowed)))
            kind += f"; sliding-window attention ({sizes} tokens) in {len(windowed)} of {self.layers} layers"
        return (f"{self.name}: {self.total_params / 1e9:.2f}B parameters ({self.active_matmul_params / 1e9:.2f}B active "
                f"per token), {self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_heads} KV, "
                f"vocab {self.vocab}, {kind}")


def causal_pairs(length: int, window: int = 0) -> int:
    """Pairs (query i, key j) a causal mask allows in a row of ``length`` tokens: ``j <= i``, and with a sliding
    ``window`` also ``i - j < window`` (transformers' ``sliding_window_overlay``: the window holds the query itself,
    so query i sees ``min(i + 1, window)`` keys)."""
    if window <= 0 or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def attention_windows(config: dict[str, Any], model_type: str, layers: int, where: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention) by transformers 5's rules, or ``()`` when none is windowed.

    ``layer_types`` (``"sliding_attention"`` / ``"full_attention"`` per layer) is the general source; without it
    the families' config classes derive it: Gemma 2 windows every other layer (the first of each pair), Gemma 3
    all but every ``sliding_window_pattern``-th (6), Qwen2/Qwen3 the layers from ``max_window_layers`` (28) on and
    Qwen2-MoE the even layers below it (both only with ``use_sliding_window``). Mistral, Mixtral, Phi-3 and
    Qwen3-MoE window every layer when ``sliding_window`` is set (their modeling code reads no ``layer_types``)."""
    window = config.get("sliding_window")
    if model_type in ("gemma2", "gemma3_text") and "sliding_window" not in config:
        window = 4096  # the config classes' default
    if model_type in USE_SLIDING_WINDOW_FAMILIES and not config.get("use_sliding_window", False):
        window = None
    if not window:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelError(f"{where}: 'sliding_window' must be a positive integer, got {window!r}")
    if model_type in WINDOW_EVERY_LAYER_FAMILIES:
        return (window,) * layers
    kinds = config.get("layer_types")
    if kinds is None:
        kinds = _default_layer_types(config, model_type, layers)
    if len(kinds) != layers or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise ModelError(f"{where}: 'layer_types' must name 'sliding_attention' or 'full_attention' for each of the "
                         f"{layers} layers, got {kinds!r}")
    windows = tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
    return windows if any(windows) else ()


def _default_layer_types(config: dict[str, Any], model_type: str, layers: int) -> list[str]:
    """``layer_types`` as the family's transformers config class fills it in when config.json has none."""
    if model_type == "gemma2":
        windowed = [i % 2 == 0 for i in range(layers)]
    elif model_type == "gemma3_text":
        pattern = config.get("sliding_window_pattern", 6) or 6
        windowed = [(i + 1) % pattern != 0 for i in range(layers)]
    elif model_type in ("qwen2", "qwen3"):
        windowed = [i >= config.get("max_window_layers", 28) for i in range(layers)]
    elif model_type == "qwen2_moe":
        windowed = [i % 2 == 0 and i < config.get("max_window_layers", 28) for i in range(layers)]
    else:  # a family whose config names no windowed layers: sliding_window alone does not window them
        windowed = [False] * layers
    return ["sliding_attention" if w else "full_attention" for w in windowed]


def _need(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if value is None:
        raise ModelError(f"{where}: the config has no {key!r}; the planner needs it to size the model "
                         "(write it into config.json, as in examples/configs/llama-70b.json)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    return value


def shape_from_config(config: dict[str, Any], name: str = "model", where: str | None = None) -> ModelShape:
    """Build a :class:`ModelShape` from the dict of an HF ``config.json``; clear errors for gaps."""
    where = where or name
    if not isinstance(config, dict):
        raise ModelError(f"{where}: expected a JSON object of model settings, got {type(config).__name__}")
    if "text_config" in config and "hidden_size" not in config:
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type", config.get("model_type"))}
    model_type = str(config.get("model_type", ""))
    if not model_type:
        raise ModelError(f"{where}: the config has no 'model_type' (e.g. \"llama\", \"qwen2\", \"mixtral\")")
    hidden = _need(config, "hidden_size", where)
    layers = _need(config, "num_hidden_layers", where)
    heads = _need(config, "num_attention_heads", where)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    vocab = _need(config, "vocab_size", where)
    if heads % kv_heads:
        raise ModelError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    common = dict(name=name, model_type=model_type, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                  head_dim=head_dim, vocab=vocab, tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                  qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False)),
                  attention_windows=attention_windows(config, model_type, layers, where), config=dict(config))
    if model_type == "mixtral":
        experts = _need(config, "num_local_experts", where)
        ffn = _need(config, "intermediate_size", where)
        return ModelShape(**common, ffn=ffn, experts=experts, experts_per_token=_need(config, "num_experts_per_tok", where),
                          expert_ffn=ffn, moe_layers=layers)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        key = "num_experts" if "num_experts" in config else "num_local_experts"  # transformers 5 renames it
        experts = _need(config, key, where)
        step = config.get("decoder_sparse_step", 1) or 1
        dense_only = set(config.get("mlp_only_layers") or [])
        pattern = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))  # as transformers builds them
        moe_layers = sum(pattern)
        return ModelShape(**common, ffn=config.get("intermediate_size") or _need(config, "moe_intermediate_size", where),
                          experts=experts, experts_per_token=_need(config, "num_experts_per_tok", where),
                          expert_ffn=_need(config, "moe_intermediate_size", where),
                          shared_expert_ffn=config.get("shared_expert_intermediate_size", 0) or 0, moe_layers=moe_layers,
                          moe_pattern=pattern if not all(pattern) else ())
    if model_type in MLA_FAMILIES:
        return _mla_shape(config, common, where)
    if model_type not in DENSE_FAMILIES and any(k in config for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ModelError(f"{where}: MoE model_type {model_type!r} is not known to the planner; known MoE families: "
                         f"{', '.join(MOE_FAMILIES)}")
    return ModelShape(**common, ffn=_need(config, "intermediate_size", where))


def _mla_shape(config: dict[str, Any], common: dict[str, Any], where: str) -> ModelShape:
    """DeepSeek-V2/V3: latent attention (every head its own keys), routed + shared experts, dense first layers."""
    rope = _need(config, "qk_rope_head_dim", where)
    layers, experts = common["layers"], _need(config, "n_routed_experts", where)
    expert_ffn = _need(config, "moe_intermediate_size", where)
    dense = config.get("first_k_dense_replace", 0) or 0
    return ModelShape(**{**common, "kv_heads": common["heads"], "head_dim": _need(config, "qk_nope_head_dim", where) + rope,
                         "qkv_bias": False},
                      ffn=_need(config, "intermediate_size", where), experts=experts,
                      experts_per_token=_need(config, "num_experts_per_tok", where), expert_ffn=expert_ffn,
                      shared_expert_ffn=expert_ffn * (config.get("n_shared_experts") or 0), shared_expert_gate=False,
                      moe_layers=max(layers - dense, 0), moe_pattern=tuple(i >= dense for i in range(layers)) if dense else (),
                      q_lora_rank=config.get("q_lora_rank") or 0,
                      kv_lora_rank=_need(config, "kv_lora_rank", where), rope_head_dim=rope,
                      v_head_dim=_need(config, "v_head_dim", where))


def load_shape(reference: str | Path) -> ModelShape:
    """A model directory (its ``config.json``) or a JSON config file -> :class:`ModelShape`."""
    path = Path(reference)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelError(f"{reference}: the directory has no config.json; give an HF model directory or a config file")
    elif not path.is_file():
        raise ModelError(f"{reference}: no such model directory or config file (the planner reads config.json only, "
                         "no weights; see examples/configs/)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    name = path.parent.name if path.name == "config.json" else path.stem
    return shape_from_config(config, name=name, where=str(path))
