"""Per-family facts the Megatron bridge needs, registered through ``toolkit_register_architectures``.

An architecture says how an HF config becomes Megatron's ``TransformerConfig`` options and what
the HF tensor names of each weight are. A third party adds a dense family by registering a
subclass of :class:`DenseArchitecture` named ``megatron:<model_type>`` with its ``families``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from toolkit.errors import ModelError


class DenseArchitecture:
    """A Llama-shaped decoder: RMSNorm, RoPE, SwiGLU MLP, GQA, optional QKV bias / QK norm."""

    name: ClassVar[str] = "megatron:llama"
    families: ClassVar[tuple[str, ...]] = ("llama",)
    rope_by_layer_type: ClassVar[bool] = False
    """``rope_parameters`` is keyed by layer type (Gemma 3)."""
    qkv_bias: ClassVar[bool | None] = None
    """``None``: read ``attention_bias`` from the HF config."""
    attention_bias_on_output: ClassVar[bool] = True
    """HF's ``attention_bias`` puts a bias on ``o_proj`` too (Llama, Qwen3, InternLM3; not GLM-4); the bridge has none
    there, so such a config is refused."""
    qk_norm: ClassVar[bool] = False
    moe: ClassVar[bool] = False
    rope_interleaved: ClassVar[bool] = False
    """RoPE pairs dims (0, 1), (2, 3)... (GLM) instead of the two halves of each head (Llama)."""
    sublayer_post_norms: ClassVar[bool] = False
    """An RMSNorm on each sublayer's output before the residual add (GLM-4's ``post_self_attn_layernorm`` and
    ``post_mlp_layernorm``: the ``post_attn_out_norm`` / ``post_mlp_out_norm`` names below)."""
    mla: ClassVar[bool] = False
    """Multi-head latent attention (megatron-core's ``MLASelfAttention``) instead of fused-QKV attention."""
    zero_centered_norms: ClassVar[bool] = False
    """Every RMSNorm scales by ``1 + weight`` in fp32 (Gemma; megatron-core's ``layernorm_zero_centered_gamma``): the
    weights stay as HF stores them, so round trips are bit-exact."""
    activation: ClassVar[str] = "silu"
    """The HF activation of the gated MLP: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (Gemma's GeGLU)."""

    # HF names; ``{i}`` is the global layer index.
    embedding: ClassVar[str] = "model.embed_tokens.weight"
    final_norm: ClassVar[str] = "model.norm.weight"
    lm_head: ClassVar[str] = "lm_head.weight"
    layer: ClassVar[dict[str, str]] = {
        "q": "model.layers.{i}.self_attn.q_proj",
        "k": "model.layers.{i}.self_attn.k_proj",
        "v": "model.layers.{i}.self_attn.v_proj",
        "o": "model.layers.{i}.self_attn.o_proj.weight",
        "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
        "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
        "gate": "model.layers.{i}.mlp.gate_proj.weight",
        "up": "model.layers.{i}.mlp.up_proj.weight",
        "down": "model.layers.{i}.mlp.down_proj.weight",
        "input_norm": "model.layers.{i}.input_layernorm.weight",
        "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
        "post_attn_out_norm": "model.layers.{i}.post_self_attn_layernorm.weight",
        "post_mlp_out_norm": "model.layers.{i}.post_mlp_layernorm.weight",
    }

    Config: ClassVar[type] = None  # set below: architectures take no options

    def __init__(self, config: Any = None):
        self.config = config

    @classmethod
    def has_qkv_bias(cls, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "attention_bias", False)) if cls.qkv_bias is None else cls.qkv_bias

    @classmethod
    def head_dim(cls, hf_config: Any) -> int:
        return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        return None

    @classmethod
    def refusal(cls, config: dict[str, Any]) -> str | None:
        """``contracts.Architecture``'s optional check, which the planner asks: why the bridge refuses the model of
        this config.json (``check`` and the per-layer attention, as ``build`` runs them), None when it builds it.

        Without torch or transformers (``toolkit plan`` imports neither): the dict is read like the HF config and
        RoPE is judged by its type alone (:func:`rope_type_problem`, the rule ``Rope.from_hf_config`` applies).
        A key config.json leaves out means the family's default: the checks' own defaults are transformers' for
        every key they read but the activation, whose default differs by family and is the one the bridge
        implements. A config the checks cannot read is left to the loader, which names what is missing."""
        judge = type(cls.__name__, (cls,), {"rope": classmethod(_judge_rope), "layer_rope": classmethod(_judge_layer_rope)})
        defaults = {} if {"hidden_act", "hidden_activation"} & set(config) else {"hidden_act": cls.activation}
        settings = ConfigSettings({**defaults, **config})
        try:
            judge.check(settings)
            judge.layer_attention(settings)
        except ModelError as exc:
            return str(exc)
        except (AttributeError, KeyError, TypeError, ValueError):
            return None
        return None

    @classmethod
    def rope(cls, hf_config: Any) -> Any:
        """The :class:`~toolkit_megatron.attention.Rope` HF applies (refuses rope types whose frequencies change
        with the sequence length in ways the bridge does not follow)."""
        from toolkit_megatron.attention import Rope

        return Rope.from_hf_config(hf_config, cls.rope_interleaved)

    @classmethod
    def layer_attention(cls, hf_config: Any) -> list[tuple[Any, int | None]]:
        """Per decoder layer, the :class:`~toolkit_megatron.attention.Rope` its core attention applies (``None``:
        MLA rotates itself) and its sliding window (``None``: full attention). Families alternating window and
        full layers override it."""
        rope = None if cls.mla else cls.rope(hf_config)
        return [(rope, cls.sliding_window(hf_config))] * hf_config.num_hidden_layers

    @classmethod
    def attention_softcap(cls, hf_config: Any) -> float | None:
        """``c`` of the attention logit soft-capping ``c * tanh(scores / c)`` before masking (Gemma 2)."""
        return None

    @classmethod
    def final_logit_softcap(cls, hf_config: Any) -> float | None:
        """``c`` of the output logits' soft-capping ``c * tanh(logits / c)`` (Gemma 2 and 3)."""
        return None

    @classmethod
    def embedding_scale(cls, hf_config: Any) -> float | None:
        """The factor the embedding output is multiplied by, in the embedding's dtype (Gemma: sqrt(hidden_size))."""
        return None

    @classmethod
    def hf_activation(cls, hf_config: Any) -> str:
        return getattr(hf_config, "hidden_act", "silu")

    @classmethod
    def check(cls, hf_config: Any) -> None:
        problems = []
        if getattr(hf_config, "mlp_bias", False):
            problems.append("mlp_bias=true (biases on MLP projections)")
        if cls.qkv_bias is None and getattr(hf_config, "attention_bias", False) and cls.attention_bias_on_output:
            problems.append("attention_bias=true (o_proj bias)")
        if cls.hf_activation(hf_config) != cls.activation:
            problems.append(f"hidden_act={cls.hf_activation(hf_config)!r} (only {cls.activation} for {hf_config.model_type})")
        if problems:
            raise ModelError(f"{hf_config.model_type} config not supported by the Megatron bridge: {'; '.join(problems)}")
        cls.rope(hf_config)

    @classmethod
    def transformer_options(cls, hf_config: Any) -> dict[str, Any]:
        """``TransformerConfig`` keyword arguments that describe the model (not the layout)."""
        import torch.nn.functional as F

        cls.check(hf_config)
        return dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            kv_channels=cls.head_dim(hf_config),
            ffn_hidden_size=hf_config.intermediate_size,
            normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps,
            layernorm_zero_centered_gamma=cls.zero_centered_norms,
            gated_linear_unit=True,
            activation_func={"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}[cls.activation],
            add_bias_linear=False,
            add_qkv_bias=cls.has_qkv_bias(hf_config),
            qk_layernorm=cls.qk_norm,
            hidden_dropout=0.0,
            attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
            init_method_std=getattr(hf_config, "initializer_range", 0.02),
        )


def gelu_tanh(x: Any) -> Any:
    """GELU with the tanh approximation (HF's ``gelu_pytorch_tanh``), Gemma's GeGLU activation; a module-level
    function so ``TransformerConfig`` stays picklable."""
    import torch.nn.functional as F

    return F.gelu(x, approximate="tanh")


@dataclass(kw_only=True)
class NoOptions:
    """Architectures take no options."""


DenseArchitecture.Config = NoOptions


class MistralArchitecture(DenseArchitecture):
    name = "megatron:mistral"
    families = ("mistral",)
    qkv_bias = False

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        return getattr(hf_config, "sliding_window", None)


class Qwen2Architecture(DenseArchitecture):
    name = "megatron:qwen2"
    families = ("qwen2",)
    qkv_bias = True

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        if getattr(hf_config, "use_sliding_window", False) and getattr(hf_config, "sliding_window", None):
            raise ModelError("qwen2 with use_sliding_window=true mixes window and full layers: not supported by the Megatron bridge")
        return None


class Qwen3Architecture(DenseArchitecture):
    name = "megatron:qwen3"
    families = ("qwen3",)
    qk_norm = True

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        return Qwen2Architecture.sliding_window(hf_config)


class InternLM3Architecture(DenseArchitecture):
    """InternLM 3 as transformers ships it (``internlm3``: a Llama config and LlamaForCausalLM, no remote code).
    InternLM 2 exists only as remote code: the bridge refuses it like any unknown family."""

    name = "megatron:internlm3"
    families = ("internlm3",)


class Phi3Architecture(DenseArchitecture):
    """Phi-3 / Phi-4 (mini): Llama-shaped with fused ``qkv_proj`` and ``gate_up_proj`` weights (the bridge reads
    and writes the parts of one tensor), every layer windowed when ``sliding_window`` is set, ``longrope`` and
    partial rotary from the config."""

    name = "megatron:phi3"
    families = ("phi3",)
    qkv_bias = False
    layer = {**DenseArchitecture.layer,
             **dict.fromkeys(("q", "k", "v"), "model.layers.{i}.self_attn.qkv_proj"),
             **dict.fromkeys(("gate", "up"), "model.layers.{i}.mlp.gate_up_proj.weight")}

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        return getattr(hf_config, "sliding_window", None)

    @classmethod
    def check(cls, hf_config: Any) -> None:
        super().check(hf_config)
        dropped = [f"{key}={getattr(hf_config, key)}" for key in ("resid_pdrop", "embd_pdrop")
                   if getattr(hf_config, key, 0.0)]
        if dropped:
            raise ModelError(f"phi3 config not supported by the Megatron bridge: {', '.join(dropped)} (residual/embedding "
                             "dropout); set them to 0.0 in config.json or train with --strategy local")


class Glm4Architecture(DenseArchitecture):
    """GLM-4 (``glm4``): QKV bias, fused ``gate_up_proj``, partial rotary (half of each head by default) with
    interleaved pairs, and an RMSNorm on the attention and MLP outputs before each residual add."""

    name = "megatron:glm4"
    families = ("glm4",)
    attention_bias_on_output = False
    rope_interleaved = True
    sublayer_post_norms = True
    layer = {**DenseArchitecture.layer, **dict.fromkeys(("gate", "up"), "model.layers.{i}.mlp.gate_up_proj.weight")}


class GemmaArchitecture(DenseArchitecture):
    """Gemma (v1): GeGLU (tanh GELU), RMSNorms scaling by ``1 + weight`` in fp32, embeddings multiplied by
    sqrt(hidden_size) in their dtype."""

    name = "megatron:gemma"
    families = ("gemma",)
    zero_centered_norms = True
    activation = "gelu_pytorch_tanh"

    @classmethod
    def embedding_scale(cls, hf_config: Any) -> float | None:
        return hf_config.hidden_size ** 0.5


class Gemma2Architecture(GemmaArchitecture):
    """Gemma 2: Gemma plus a norm on each sublayer's output (four per layer), softmax scale
    ``query_pre_attn_scalar ** -0.5``, attention and final logit soft-capping, and sliding-window / full
    layers as ``layer_types`` says."""

    name = "megatron:gemma2"
    families = ("gemma2",)
    sublayer_post_norms = True
    layer = {**DenseArchitecture.layer,
             "post_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
             "post_attn_out_norm": "model.layers.{i}.post_attention_layernorm.weight",
             "post_mlp_out_norm": "model.layers.{i}.post_feedforward_layernorm.weight"}

    @classmethod
    def hf_activation(cls, hf_config: Any) -> str:
        return getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"

    @classmethod
    def layer_types(cls, hf_config: Any) -> list[str]:
        """``sliding_attention`` or ``full_attention`` per layer (transformers fills them in from older configs)."""
        return list(hf_config.layer_types)

    @classmethod
    def layer_rope(cls, hf_config: Any, layer_type: str) -> Any:
        """The RoPE of ``layer_type``'s layers: Gemma 2 has one for all."""
        return cls.rope(hf_config)

    @classmethod
    def layer_attention(cls, hf_config: Any) -> list[tuple[Any, int | None]]:
        kinds = {kind: (cls.layer_rope(hf_config, kind), hf_config.sliding_window if kind == "sliding_attention" else None)
                 for kind in set(cls.layer_types(hf_config))}
        return [kinds[kind] for kind in cls.layer_types(hf_config)]

    @classmethod
    def attention_softcap(cls, hf_config: Any) -> float | None:
        return getattr(hf_config, "attn_logit_softcapping", None) or None

    @classmethod
    def final_logit_softcap(cls, hf_config: Any) -> float | None:
        return getattr(hf_config, "final_logit_softcapping", None) or None

    @classmethod
    def check(cls, hf_config: Any) -> None:
        super().check(hf_config)
        problems = []
        unknown = sorted(set(cls.layer_types(hf_config)) - {"sliding_attention", "full_attention"})
        if unknown:
            problems.append(f"layer_types {unknown} (sliding_attention and full_attention are known)")
        if len(cls.layer_types(hf_config)) != hf_config.num_hidden_layers:
            problems.append(f"{len(cls.layer_types(hf_config))} layer_types for {hf_config.num_hidden_layers} layers")
        if getattr(hf_config, "use_bidirectional_attention", False):
            problems.append("use_bidirectional_attention=true (the bridge's attention is causal)")
        if problems:
            raise ModelError(f"{hf_config.model_type} config not supported by the Megatron bridge: {'; '.join(problems)}")
        for kind in set(cls.layer_types(hf_config)):
            cls.layer_rope(hf_config, kind)

    @classmethod
    def transformer_options(cls, hf_config: Any) -> dict[str, Any]:
        options = super().transformer_options(hf_config)
        options["softmax_scale"] = hf_config.query_pre_attn_scalar ** -0.5
        return options


class Gemma3TextArchitecture(Gemma2Architecture):
    """Gemma 3's text model: Gemma 2 plus QK norm (``1 + weight`` too) and a RoPE per layer type (``rope_parameters``
    keyed by ``sliding_attention`` / ``full_attention``: the local base and the global base with its scaling).
    transformers passes no attention soft-capping to Gemma 3's attention, so neither does the bridge."""

    name = "megatron:gemma3_text"
    families = ("gemma3_text",)
    qk_norm = True
    rope_by_layer_type = True

    @classmethod
    def layer_rope(cls, hf_config: Any, layer_type: str) -> Any:
        from toolkit_megatron.attention import Rope

        return Rope.from_hf_config(hf_config, cls.rope_interleaved, layer_type=layer_type)

    @classmethod
    def rope(cls, hf_config: Any) -> Any:
        return cls.layer_rope(hf_config, "full_attention")

    @classmethod
    def attention_softcap(cls, hf_config: Any) -> float | None:
        return None


class MoEArchitecture(DenseArchitecture):
    """A decoder whose MLPs are top-k routed mixtures of SwiGLU experts (no shared expert); the layers
    :meth:`moe_layers` leaves out keep a dense SwiGLU MLP of ``intermediate_size``."""

    moe: ClassVar[bool] = True
    router: ClassVar[str] = "model.layers.{i}.mlp.gate.weight"
    expert: ClassVar[dict[str, str]] = {"gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
                                        "up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
                                        "down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight"}

    @classmethod
    def num_experts(cls, hf_config: Any) -> int:
        return hf_config.num_experts

    @classmethod
    def expert_ffn(cls, hf_config: Any) -> int:
        return hf_config.moe_intermediate_size

    @classmethod
    def renormalize(cls, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "norm_topk_prob", True))

    @classmethod
    def moe_layers(cls, hf_config: Any) -> list[bool]:
        """Per decoder layer, whether its MLP routes through experts, as transformers builds Qwen-MoE models:
        layer ``i`` is sparse unless listed in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``
        (families without those settings, such as Mixtral, are sparse everywhere)."""
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        return [i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)]

    @classmethod
    def transformer_options(cls, hf_config: Any) -> dict[str, Any]:
        options = super().transformer_options(hf_config)
        pattern = cls.moe_layers(hf_config)
        if not all(pattern):  # Megatron's per-layer pattern (1 = MoE, 0 = dense MLP of ffn_hidden_size)
            options["moe_layer_freq"] = [int(sparse) for sparse in pattern]
        options.update(
            num_moe_experts=cls.num_experts(hf_config),
            moe_router_topk=hf_config.num_experts_per_tok,
            moe_ffn_hidden_size=cls.expert_ffn(hf_config),
            # top-k over logits then softmax == softmax, top-k, renormalise (HF's norm_topk_prob)
            moe_router_pre_softmax=not cls.renormalize(hf_config),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
        )
        return options


class Qwen2MoeArchitecture(MoEArchitecture):
    """Qwen2-MoE: routed experts plus one sigmoid-gated shared expert; no top-k renormalisation by default."""

    name = "megatron:qwen2_moe"
    families = ("qwen2_moe",)
    qkv_bias = True
    shared: ClassVar[dict[str, str]] = {"gate": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
                                        "up": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
                                        "down": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
                                        "gate_weight": "model.layers.{i}.mlp.shared_expert_gate.weight"}

    @classmethod
    def renormalize(cls, hf_config: Any) -> bool:
        return bool(getattr(hf_config, "norm_topk_prob", False))

    @classmethod
    def transformer_options(cls, hf_config: Any) -> dict[str, Any]:
        options = super().transformer_options(hf_config)
        options.update(moe_shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
                       moe_shared_expert_gate=True)
        return options


class Qwen3MoeArchitecture(MoEArchitecture):
    name = "megatron:qwen3_moe"
    families = ("qwen3_moe",)
    qk_norm = True


class MixtralArchitecture(MoEArchitecture):
    name = "megatron:mixtral"
    families = ("mixtral",)
    qkv_bias = False
    router = "model.layers.{i}.block_sparse_moe.gate.weight"
    expert = {"gate": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
              "up": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
              "down": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"}

    @classmethod
    def num_experts(cls, hf_config: Any) -> int:
        return hf_config.num_local_experts

    @classmethod
    def expert_ffn(cls, hf_config: Any) -> int:
        return hf_config.intermediate_size

    @classmethod
    def renormalize(cls, hf_config: Any) -> bool:
        return True

    @classmethod
    def sliding_window(cls, hf_config: Any) -> int | None:
        return getattr(hf_config, "sliding_window", None)


class DeepseekV3Architecture(MoEArchitecture):
    """DeepSeek-V3: multi-head latent attention, sigmoid-scored grouped top-k routing with a score-correction
    bias, shared experts, and dense MLPs in the first ``first_k_dense_replace`` layers."""

    name = "megatron:deepseek_v3"
    families = ("deepseek_v3",)
    qkv_bias = False
    mla = True
    layer = {
        **DenseArchitecture.layer,
        "q_proj": "model.layers.{i}.self_attn.q_proj.weight",
        "q_a": "model.layers.{i}.self_attn.q_a_proj.weight",
        "q_norm": "model.layers.{i}.self_attn.q_a_layernorm.weight",
        "q_b": "model.layers.{i}.self_attn.q_b_proj.weight",
        "kv_a": "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
        "kv_norm": "model.layers.{i}.self_attn.kv_a_layernorm.weight",
        "kv_b": "model.layers.{i}.self_attn.kv_b_proj.weight",
    }
    router_bias: ClassVar[str] = "model.layers.{i}.mlp.gate.e_score_correction_bias"
    shared: ClassVar[dict[str, str]] = {"gate": "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
                                        "up": "model.layers.{i}.mlp.shared_experts.up_proj.weight",
                                        "down": "model.layers.{i}.mlp.shared_experts.down_proj.weight"}
    score_function: ClassVar[str] = "sigmoid"

    @classmethod
    def num_experts(cls, hf_config: Any) -> int:
        return hf_config.n_routed_experts

    @classmethod
    def head_dim(cls, hf_config: Any) -> int:
        return hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim

    @classmethod
    def moe_layers(cls, hf_config: Any) -> list[bool]:
        dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
        return [i >= dense for i in range(hf_config.num_hidden_layers)]

    @classmethod
    def router_problems(cls, hf_config: Any) -> list[str]:
        """Routing details megatron-core's TopKRouter cannot reproduce (each names the config field)."""
        problems = []
        topk, groups = hf_config.num_experts_per_tok, getattr(hf_config, "n_group", None) or 1
        chosen = getattr(hf_config, "topk_group", None) or groups
        if not getattr(hf_config, "norm_topk_prob", True) and topk > 1:
            problems.append("norm_topk_prob=false (megatron-core renormalises sigmoid top-k scores)")
        if 1 < groups and chosen < groups and topk != 2 * chosen:
            problems.append(f"n_group={groups}, topk_group={chosen}, num_experts_per_tok={topk}: a group's score is the "
                            "sum of its top 2 experts in HF, of its top num_experts_per_tok/topk_group in megatron-core; "
                            "they agree only when num_experts_per_tok == 2 * topk_group")
        return problems

    @classmethod
    def check(cls, hf_config: Any) -> None:
        DenseArchitecture.check(hf_config)
        problems = cls.router_problems(hf_config)
        if getattr(hf_config, "attention_bias", False):
            problems.append("attention_bias=true (megatron-core's MLA projections have no bias)")
        if not getattr(hf_config, "rope_interleave", True):
            problems.append("rope_interleave=false (megatron-core's MLA rotates interleaved pairs)")
        rope = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in ("default", "yarn"):
            problems.append(f"rope_parameters.rope_type={rope!r} (megatron-core's MLA has rope and yarn)")
        if problems:
            raise ModelError(f"{hf_config.model_type} config not supported by the Megatron bridge: {'; '.join(problems)}")

    @classmethod
    def group_routing(cls, hf_config: Any) -> dict[str, Any]:
        groups = getattr(hf_config, "n_group", None) or 1
        chosen = getattr(hf_config, "topk_group", None) or groups
        if groups > 1 and chosen < groups:
            return {"moe_router_num_groups": groups, "moe_router_group_topk": chosen}
        return {}

    @classmethod
    def mla_options(cls, hf_config: Any) -> dict[str, Any]:
        """``MLATransformerConfig`` fields: latent ranks, head dimensions and RoPE (default or YaRN)."""
        rope = getattr(hf_config, "rope_parameters", None) or {}
        options = dict(multi_latent_attention=True, q_lora_rank=hf_config.q_lora_rank, kv_lora_rank=hf_config.kv_lora_rank,
                       qk_head_dim=hf_config.qk_nope_head_dim, qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
                       v_head_dim=hf_config.v_head_dim, rotary_base=rope.get("rope_theta", 10000.0),
                       rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        if rope.get("rope_type") == "yarn":
            options.update(rope_type="yarn", rotary_scaling_factor=rope["factor"],
                           original_max_position_embeddings=rope["original_max_position_embeddings"],
                           beta_fast=rope.get("beta_fast") or 32, beta_slow=rope.get("beta_slow") or 1,
                           mscale=rope.get("mscale") or 1.0, mscale_all_dim=rope.get("mscale_all_dim") or 0.0)
        return options

    @classmethod
    def transformer_options(cls, hf_config: Any) -> dict[str, Any]:
        options = super().transformer_options(hf_config)
        options.update(cls.mla_options(hf_config))
        options.update(cls.group_routing(hf_config))
        scaling = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
        options.update(
            num_query_groups=hf_config.num_attention_heads,
            moe_layer_freq=[int(moe) for moe in cls.moe_layers(hf_config)],
            moe_shared_expert_intermediate_size=hf_config.moe_intermediate_size * hf_config.n_shared_experts
            if getattr(hf_config, "n_shared_experts", 0) else None,
            moe_router_score_function=cls.score_function,
            moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
        )
        if cls.score_function == "sigmoid":
            # HF's e_score_correction_bias: loaded, never updated (HF does not train it either)
            options.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
        return options


class DeepseekV2Architecture(DeepseekV3Architecture):
    """DeepSeek-V2 / V2-Lite: as V3 but softmax-scored routing (greedy or group-limited), no score bias and no
    top-k renormalisation."""

    name = "megatron:deepseek_v2"
    families = ("deepseek_v2",)
    score_function = "softmax"

    @classmethod
    def renormalize(cls, hf_config: Any) -> bool:
        return False  # HF's DeepseekV2TopkRouter ignores norm_topk_prob

    @classmethod
    def router_problems(cls, hf_config: Any) -> list[str]:
        method = getattr(hf_config, "topk_method", "greedy")
        if method == "greedy":
            return []
        if method != "group_limited_greedy":
            return [f"topk_method={method!r} (greedy and group_limited_greedy are known)"]
        groups, chosen = hf_config.n_group, hf_config.topk_group
        if chosen < groups and hf_config.num_experts_per_tok != chosen:
            return [f"topk_method=group_limited_greedy with num_experts_per_tok={hf_config.num_experts_per_tok}, "
                    f"topk_group={chosen}: a group's score is its best expert in HF, the sum of its top "
                    "num_experts_per_tok/topk_group in megatron-core; they agree only when num_experts_per_tok == topk_group"]
        return []

    @classmethod
    def group_routing(cls, hf_config: Any) -> dict[str, Any]:
        if getattr(hf_config, "topk_method", "greedy") == "greedy":
            return {}
        return super().group_routing(hf_config)

    @classmethod
    def check(cls, hf_config: Any) -> None:
        if not hasattr(hf_config, "rope_interleave"):
            hf_config = _with(hf_config, rope_interleave=True)  # V2 always rotates interleaved pairs
        super().check(hf_config)


def _with(hf_config: Any, **values: Any) -> Any:
    import copy

    clone = copy.copy(hf_config)
    for key, value in values.items():
        setattr(clone, key, value)
    return clone


BUILTIN = (DenseArchitecture, MistralArchitecture, Qwen2Architecture, Qwen3Architecture, InternLM3Architecture, Phi3Architecture,
           Glm4Architecture, GemmaArchitecture, Gemma2Architecture, Gemma3TextArchitecture, Qwen2MoeArchitecture, Qwen3MoeArchitecture, MixtralArchitecture, DeepseekV2Architecture,
           DeepseekV3Architecture)


REFUSED: dict[str, str] = {
    "gemma3": "a vision-language wrapper (Gemma 3's vision tower and projector; its text model, model_type gemma3_text, "
              "is bridged)",
}
"""Families the bridge refuses by name, with the pieces it lacks (``--strategy local`` trains them)."""


def architecture_for(model_type: str) -> type[DenseArchitecture]:
    """The registered ``megatron:*`` architecture covering ``model_type`` (plugins included)."""
    from toolkit.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("architecture")
    known = []
    for name, cls in registry.items():
        if name.startswith("megatron:"):
            known.append(name.split(":", 1)[1])
            if model_type in getattr(cls, "families", ()):
                return cls
    if model_type in REFUSED:
        raise ModelError(f"the Megatron bridge does not support {model_type}: megatron-core (so the bridge) lacks "
                         f"{REFUSED[model_type]}. "
                         "Train it with --strategy local (or fsdp/deepspeed), which run the HF model itself.")
    raise ModelError(f"the Megatron bridge has no architecture for model_type {model_type!r}; "
                     f"supported: {', '.join(sorted(known)) or 'none'}. A plugin can add one with "
                     f"toolkit_register_architectures (a DenseArchitecture subclass named 'megatron:{model_type}' whose "
                     f"families hold {model_type!r}; docs/megatron.md, 'Adding a family', shows a plugin doing it).")


STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rope types whose frequencies do not depend on the sequence (``longrope`` picks one of two sets by length)."""


def rope_type_problem(hf_config: Any, layer_type: str | None = None) -> str | None:
    """Why the bridge cannot reproduce this RoPE (its frequencies change with the sequence length), or None."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type in (*STATIC_ROPE_TYPES, "longrope"):
        return None
    return (f"{hf_config.model_type}: rope_type {rope_type!r} is not supported by the Megatron bridge (its frequencies "
            f"change with the sequence length); supported: {', '.join((*STATIC_ROPE_TYPES, 'longrope'))}. "
            "Train it with --strategy local.")


class ConfigSettings:
    """A config.json dict read as an HF config: its keys as attributes (a missing one raises AttributeError, so
    ``getattr`` defaults apply), a legacy ``rope_scaling`` / ``rope_theta`` read as transformers 5's ``rope_parameters``."""

    def __init__(self, config: dict[str, Any]):
        self.__dict__.update(config)
        if "rope_parameters" not in config:
            legacy = dict(config.get("rope_scaling") or {})
            if "type" in legacy:
                legacy.setdefault("rope_type", legacy.pop("type"))
            self.rope_parameters = {**legacy, **({"rope_theta": config["rope_theta"]} if "rope_theta" in config else {})}


def _judge_rope(cls: Any, hf_config: Any) -> None:
    return _judge_layer_rope(cls, hf_config, "full_attention")


def _judge_layer_rope(cls: Any, hf_config: Any, layer_type: str) -> None:
    """``rope`` / ``layer_rope`` of :meth:`DenseArchitecture.refusal`: the type's rule, no frequencies."""
    problem = rope_type_problem(hf_config, layer_type if cls.rope_by_layer_type else None)
    if problem:
        raise ModelError(problem)
