"""An RMSNorm that Megatron's layer spec can build, sequence-parallel capable without TE or Apex, and the
bias-dropout-add with such a norm on its branch (GLM-4's and Gemma 2/3's post-attention / post-MLP norms).

Megatron's torch norm wrapper refuses sequence parallelism because the norm weight sees only a
slice of the sequence on each tensor-parallel rank; the fix is the ``sequence_parallel``
attribute on the weight, which makes ``finalize_model_grads`` sum its gradient over the
tensor-parallel group. The arithmetic follows Hugging Face's ``LlamaRMSNorm`` exactly (fp32
variance, cast back, then scale), so bf16 results match the HF model too: the
torch reference ops of toolkit.train.kernels, or one of its fused kernels. Under megatron-core's
``layernorm_zero_centered_gamma`` (Gemma) the norm is Gemma's instead: the weight is stored as HF stores it
and the fp32 normalised input is scaled by ``1 + weight`` before the cast back.
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.train.kernels import reference


class RMSNorm(torch.nn.Module):
    """``kernel_ops``: a backend of :mod:`toolkit.train.kernels` (its ``rms_norm``, e.g. the Triton
    kernel); ``None``: the torch reference ops."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, kernel_ops: Any = None, **unused: Any):
        super().__init__()
        self.eps = eps
        zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        init = torch.zeros if zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        # Summed over the TP group by finalize_model_grads under sequence parallelism.
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        if zero_centered:  # the fused kernels scale by the weight itself
            self.rms_norm = zero_centered_rms_norm
        else:
            self.rms_norm = kernel_ops.rms_norm if kernel_ops is not None else reference.rms_norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(hidden, self.weight, self.eps)


def zero_centered_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (``Gemma2RMSNorm``, ``Gemma3RMSNorm``): fp32 throughout, scaled by ``1 + weight``, then cast."""
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * (1.0 + weight.float())).type_as(hidden)


class NormedBiasDropoutAdd(RMSNorm):
    """Megatron's ``self_attn_bda`` / ``mlp_bda`` with an RMSNorm on the branch: ``residual + dropout(norm(x + bias))``.

    GLM-4 normalises each sublayer's output before the residual add (``post_self_attn_layernorm``,
    ``post_mlp_layernorm``); Megatron-Core's ``TransformerLayer`` has no slot for it, but calls its bda as
    ``bda(training, fused)(output_with_bias, residual, dropout)``, so the norm lives here, after any LoRA delta
    of the projection before it."""

    def forward(self, training: bool, fused: bool = False) -> Any:  # noqa: ARG002 (Megatron's bda signature)
        def bias_dropout_add(output_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor,
                             prob: float) -> torch.Tensor:
            output, bias = output_with_bias
            if bias is not None:
                output = output + bias
            normed = self.rms_norm(output, self.weight, self.eps)
            return residual + torch.nn.functional.dropout(normed, p=prob, training=training)

        return bias_dropout_add
