"""An RMSNorm that Megatron's layer spec can build, sequence-parallel capable without TE or Apex.

Megatron's torch norm wrapper refuses sequence parallelism because the norm weight sees only a
slice of the sequence on each tensor-parallel rank; the fix is the ``sequence_parallel``
attribute on the weight, which makes ``finalize_model_grads`` sum its gradient over the
tensor-parallel group. The arithmetic follows Hugging Face's ``LlamaRMSNorm`` exactly (fp32
variance, cast back, then scale), so bf16 results match the HF model too: the
torch reference ops of toolkit.train.kernels, or one of its fused kernels.
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
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Summed over the TP group by finalize_model_grads under sequence parallelism.
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.rms_norm = kernel_ops.rms_norm if kernel_ops is not None else reference.rms_norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(hidden, self.weight, self.eps)
