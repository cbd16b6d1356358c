"""Megatron process groups and GPTModel construction for a :class:`toolkit.parallel.ParallelLayout`.

Everything that builds Megatron-Core model objects goes through :func:`build_model`, so the
switch from ``GPTModel`` to ``HybridModel`` (megatron-core 0.19+) is one change here.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from toolkit.errors import LayoutError
from toolkit.parallel import ParallelLayout
from toolkit_megatron.architectures import architecture_for
from toolkit_megatron.compat import cpu_compat, router_expert_bias_with_padding

AttentionKind = Literal["sdpa", "local"]
ExpertsKind = Literal["grouped", "sequential"]


def megatron_sizes(layout: ParallelLayout) -> dict[str, Any]:
    """The layout's sizes under Megatron-Core's names, shared by ``initialize_model_parallel`` and ``TransformerConfig``."""
    return {"tensor_model_parallel_size": layout.tensor, "pipeline_model_parallel_size": layout.pipeline,
            "virtual_pipeline_model_parallel_size": layout.virtual if layout.virtual > 1 else None,
            "context_parallel_size": layout.context, "expert_model_parallel_size": layout.expert,
            "expert_tensor_parallel_size": layout.expert_tensor}


def padded_vocab_size(vocab_size: int, tensor: int) -> int:
    """Vocabulary rounded up to a multiple of the tensor-parallel size (Megatron splits it evenly)."""
    return -(-vocab_size // tensor) * tensor


def initialize_parallel(layout: ParallelLayout, seed: int = 42) -> None:
    """Create Megatron's process groups for ``layout`` (torch.distributed must be initialised)."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        raise LayoutError("torch.distributed is not initialised: launch with torchrun (or toolkit launch)")
    if parallel_state.model_parallel_is_initialized():
        destroy_parallel()
    with cpu_compat():
        parallel_state.initialize_model_parallel(**megatron_sizes(layout))
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Megatron's process groups torn down, not only forgotten, so the next ``initialize_parallel`` in this process
    starts clean. ``destroy_model_parallel`` sets its globals to None and destroys only its gloo data-parallel
    groups; every other group keeps its sockets and threads, and a process that lays out several models (the
    bridge's checks, an export at another layout) ran out of them on megatron-core 0.19, which creates more groups
    per layout ("Resource temporarily unavailable" from a gloo group)."""
    import torch
    from megatron.core import parallel_state

    world = torch.distributed.distributed_c10d._world  # the group registry megatron-core itself consults
    groups = {}
    for value in vars(parallel_state).values():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, torch.distributed.ProcessGroup) and item is not torch.distributed.GroupMember.WORLD:
                groups[id(item)] = item
    parallel_state.destroy_model_parallel()
    for group in groups.values():
        if world.pg_map.get(group) is not None:
            torch.distributed.destroy_process_group(group)


def transformer_config(hf_config: Any, layout: ParallelLayout, dtype: Any, **overrides: Any) -> Any:
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    options = architecture_for(hf_config.model_type).transformer_options(hf_config)
    options.update(megatron_sizes(layout))
    options.update(
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cp_comm_type="all_gather" if layout.context > 1 else None,
    )
    options.update(overrides)
    if options.get("bias_activation_fusion") and options["activation_func"] is not torch.nn.functional.silu:
        options["bias_activation_fusion"] = False  # megatron-core fuses SwiGLU and erf-GELU only, not Gemma's tanh GeGLU
    return (MLATransformerConfig if options.get("multi_latent_attention") else TransformerConfig)(**options)


def layer_spec(hf_config: Any, config: Any, attention: AttentionKind = "sdpa", vp_stage: int | None = None,
               compiled_rope: bool = False, kernel_ops: Any = None, experts: ExpertsKind = "grouped",
               packed_flex: bool = False) -> Any:
    """Megatron's local layer spec with our SDPA core attention and sequence-parallel RMSNorm
    (through ``kernel_ops``' fused kernel when given), and (MoE) grouped-matmul experts
    (``experts="sequential"``: Megatron's ``SequentialMLP``)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
        get_transformer_layer_offset,
    )

    from toolkit_megatron.attention import LocalAttention, SDPAAttention
    from toolkit_megatron.norm import NormedBiasDropoutAdd, RMSNorm

    arch = architecture_for(hf_config.model_type)
    core = {"sdpa": SDPAAttention, "local": LocalAttention}[attention]
    norm = ModuleSpec(module=RMSNorm, params={"kernel_ops": kernel_ops})
    qk_norm = norm if arch.qk_norm else IdentityOp
    if arch.mla:  # megatron-core's MLA rotates the positional part itself (interleaved pairs, as DeepSeek's weights)
        from toolkit_megatron.compat import mla_without_transformer_engine

        mla_without_transformer_engine()

    def self_attention(rope: Any, window: int | None) -> Any:
        core_attention = ModuleSpec(module=core, params={
            "rope": rope, "sliding_window": window, "compiled_rope": compiled_rope, "packed_flex": packed_flex,
            "softcap": arch.attention_softcap(hf_config)})
        if arch.mla:
            from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

            from toolkit_megatron.mla import latent_attention_class

            return ModuleSpec(
                module=latent_attention_class(),
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=MLASelfAttentionSubmodules(
                    linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                    linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
                    linear_kv_up_proj=ColumnParallelLinear, core_attention=core_attention, linear_proj=RowParallelLinear,
                    q_layernorm=norm, kv_layernorm=norm))
        return ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=core_attention,
                                               linear_proj=RowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm))
    post_norm = ModuleSpec(module=NormedBiasDropoutAdd, params={"config": config, "hidden_size": config.hidden_size,
                                                                "eps": config.layernorm_epsilon, "kernel_ops": kernel_ops})
    bda = post_norm if arch.sublayer_post_norms else get_bias_dropout_add
    dense_mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    moe_mlp = _moe_spec(config, experts) if arch.moe else None

    attentions = {}  # one spec per distinct (RoPE, window): Gemma's layer types

    def layer(moe: bool, rope: Any, window: int | None) -> Any:
        attention = attentions.setdefault((rope, window), self_attention(rope, window))
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=norm, self_attention=attention, self_attn_bda=bda,
            pre_mlp_layernorm=norm, mlp=moe_mlp if moe else dense_mlp, mlp_bda=bda))

    # one spec per global layer (dense MLPs where the family has them, e.g. DeepSeek's first_k_dense_replace; a
    # window and RoPE per layer type, Gemma's), of which this pipeline stage builds its slice
    kinds = arch.moe_layers(hf_config) if arch.moe else [False] * config.num_layers
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    built = slice(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    layers = [layer(moe, rope, window)
              for moe, (rope, window) in zip(kinds[built], arch.layer_attention(hf_config)[built], strict=True)]
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm))


def _moe_spec(config: Any, experts: ExpertsKind = "grouped") -> Any:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.experts import SequentialMLP

    # megatron-core 0.16 reads this name even when Transformer Engine is absent (NameError).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    spec = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if experts == "grouped":
        from toolkit_megatron.experts import GroupedExperts

        # same parameters and checkpoint keys as SequentialMLP, one grouped matmul instead of a loop over experts
        _replace_experts(spec, SequentialMLP, GroupedExperts)
    return spec


def _replace_experts(spec: Any, old: type, new: type) -> None:
    """Swap the MoE layer's experts class in ``spec``, in place.

    megatron-core up to 0.18 describes the experts as a ``ModuleSpec`` (``module=SequentialMLP``);
    0.19 as a builder, ``functools.partial(SequentialMLP, submodules=...)``, inside a
    ``partial(MoELayer, submodules=MoESubmodules(...))``.
    """
    import functools

    submodules = spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules
    builder = submodules.experts
    if isinstance(builder, functools.partial):
        if builder.func is old:
            submodules.experts = functools.partial(new, *builder.args, **builder.keywords)
    elif builder.module is old:
        builder.module = new


def build_model(hf_config: Any, layout: ParallelLayout, dtype: Any = None, attention: AttentionKind = "sdpa",
                vocab_size: int | None = None, compiled_rope: bool = False, kernel_ops: Any = None,
                experts: ExpertsKind = "grouped", packed_flex: bool = False, **config_overrides: Any) -> list[Any]:
    """One ``GPTModel`` per virtual pipeline stage of this rank (process groups must exist).

    ``compiled_rope``: rotary embeddings under ``torch.compile`` (one fused kernel per tensor);
    ``kernel_ops``: a :mod:`toolkit.train.kernels` backend for the RMSNorms; ``experts``: MoE experts as
    :class:`~toolkit_megatron.experts.GroupedExperts` or Megatron's ``SequentialMLP``; ``packed_flex``: packed
    rows' attention through FlexAttention (:class:`~toolkit_megatron.attention.SDPAAttention`).
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    dtype = dtype or torch.float32
    config = transformer_config(hf_config, layout, dtype, **config_overrides)
    vocab = vocab_size or padded_vocab_size(hf_config.vocab_size, layout.tensor)
    chunks = []
    with cpu_compat():
        for stage in range(layout.virtual):
            vp_stage = stage if layout.virtual > 1 else None
            model = GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(hf_config, config, attention, vp_stage, compiled_rope, kernel_ops,
                                                  experts, packed_flex),
                vocab_size=vocab,
                max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
                position_embedding_type="none",
                vp_stage=vp_stage,
            )
            model.toolkit_real_vocab = hf_config.vocab_size
            gemma_embedding_and_head(model, hf_config)
            mark_tensor_parallel(model)
            router_expert_bias_with_padding(model)
            if torch.cuda.is_available():
                model.cuda(torch.cuda.current_device())
                from toolkit_megatron.experts import pack_expert_weights

                pack_expert_weights(model)  # .cuda() gave every expert weight its own storage again
            chunks.append(model)
    return chunks


def gemma_embedding_and_head(model: Any, hf_config: Any) -> None:
    """The two pieces ``GPTModel`` has no option for (Gemma): the embedding output multiplied by the family's
    :meth:`~toolkit_megatron.architectures.DenseArchitecture.embedding_scale` in its own dtype (HF casts the scale
    to the weight's dtype first), and the output layer's logits soft-capped, ``cap * tanh(logits / cap)``, shard by
    shard (elementwise, so vocabulary parallelism changes nothing). Every consumer of the logits (label log-probs,
    evaluation, gathered logits) then sees HF's; the fused head, which makes none, is refused for such a model
    (:func:`toolkit_megatron.strategy._speed_levers`). Both are forwards set on the instances, before
    :class:`~toolkit_megatron.fused_head.OutputHeadSwitch` would wrap the head's."""
    arch = architecture_for(hf_config.model_type)
    scale, cap = arch.embedding_scale(hf_config), arch.final_logit_softcap(hf_config)
    if scale is not None and getattr(model, "pre_process", False):
        embed = model.embedding.forward

        def scaled(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = embed(*args, **kwargs)
            return out * torch.tensor(scale, dtype=torch.float32).to(out.dtype)

        model.embedding.forward = scaled
    if cap is not None and getattr(model, "post_process", False):
        head = model.output_layer.forward

        def capped(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            logits, bias = head(*args, **kwargs)
            return torch.tanh(logits / cap) * cap, bias

        model.output_layer.forward = capped


def mark_tensor_parallel(model: Any) -> None:
    """Tag TP-sharded weights as such: Megatron sets the tag only while initialising weights, which
    we skip (the bridge loads them), and its grad-norm and checkpoint code rely on the tag."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dims = {"weight": 0, "bias": 0}
        elif isinstance(module, RowParallelLinear):
            dims = {"weight": 1}
        else:
            continue
        for name, dim in dims.items():
            param = getattr(module, name, None)
            if isinstance(param, torch.nn.Parameter) and not getattr(param, "tensor_model_parallel", False):
                set_tensor_model_parallel_attributes(param, True, dim, 1)
