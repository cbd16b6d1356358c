"""A leaner forward for plain LoRA linear layers: cast the adapter, not the activation.

PEFT's LoRA ``forward`` casts each layer input to the adapter dtype. With fp32 adapters on a
bf16 base that makes an fp32 copy of every activation feeding an adapter (q, k and v each make
their own), and autograd keeps those copies for the backward pass, roughly doubling activation
memory; the 4-bit (QLoRA) layer also clones its output. Here the rank-r adapter weights (tiny)
are cast to the activation dtype instead, the scaling is folded into ``B``, and the update is
added inside one ``addmm``. Anything unusual (several or disabled adapters, merged weights,
variants such as DoRA) falls back to PEFT's own forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear


class _FastForward:
    """Mixin over a PEFT LoRA layer class: the single-adapter training case without input casts."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        adapters = self.active_adapters
        if args or kwargs or self.disable_adapters or self.merged or len(adapters) != 1:
            return super().forward(x, *args, **kwargs)
        adapter = adapters[0]
        if adapter not in self.lora_A or adapter in self.lora_variant or self.lora_B[adapter].bias is not None:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        dtype = result.dtype
        weight_a = self.lora_A[adapter].weight.to(dtype)
        weight_b = (self.lora_B[adapter].weight * self.scaling[adapter]).to(dtype)
        hidden = F.linear(self.lora_dropout[adapter](x).to(dtype), weight_a)
        out_features = result.shape[-1]
        fused = torch.addmm(result.reshape(-1, out_features), hidden.reshape(-1, hidden.shape[-1]), weight_b.t())
        return fused.view(result.shape)


class FastLoraLinear(_FastForward, PeftLoraLinear):
    """``peft.tuners.lora.Linear`` with the fast path."""


@functools.cache
def _fast_classes() -> dict[type, type]:
    """PEFT layer class -> its fast subclass (the 4-bit one only when bitsandbytes imports)."""
    classes: dict[type, type] = {PeftLoraLinear: FastLoraLinear}
    try:
        from peft.tuners.lora.bnb import Linear4bit
    except ImportError:
        return classes
    classes[Linear4bit] = type("FastLora4bit", (_FastForward, Linear4bit), {"__doc__": "PEFT's 4-bit LoRA layer with the fast path."})
    return classes


def install_fast_forward(model: torch.nn.Module) -> int:
    """Switch every plain PEFT LoRA linear (full-precision or 4-bit base) to its fast class; returns how many."""
    classes = _fast_classes()
    count = 0
    for module in model.modules():
        fast = classes.get(type(module))
        if fast is not None:
            module.__class__ = fast
            count += 1
    return count
