"""Routed experts without Transformer Engine: every local expert in one grouped matmul.

Without TE (or the ``grouped_gemm`` package) Megatron-Core's local spec gives ``SequentialMLP``,
which runs one small MLP per local expert: 128 experts cost 128 x 2 launches of tiny matmuls plus
a host sync per layer (measured 0.21x HF on one H200 for the Qwen3-30B-A3B layer shape).
:class:`GroupedExperts` keeps ``SequentialMLP``'s parameters exactly (``local_experts.{i}.linear_fc1``
/ ``linear_fc2``, expert-tensor-parallel shards, the same ``sharded_state_dict``), so the HF <->
mcore bridge, ``dist_checkpointing`` and exports see no difference; only ``forward`` changes: the
local experts' weights are read as one ``[experts, out, in]`` tensor and the permuted tokens go
through ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on torch 2.8/2.9) twice, with
the activation, the router probabilities and the expert biases applied as ``MLP.forward`` does.

The expert weights are allocated as slices of one tensor per layer (:func:`pack_expert_weights`,
run by ``build_model`` after the model is placed on its device), so reading them stacked costs
nothing; where something re-allocated a weight since (Megatron's distributed optimizer moves
parameters into its own buffer) the forward stacks a copy instead, which is only slower. Where
the grouped kernel cannot run (CUDA without a bf16 input or with unaligned sizes, a torch without
``grouped_mm``) each expert's slice is multiplied in a loop, still without ``SequentialMLP``'s
per-expert modules. LoRA on the experts (each expert's linears wrapped in
:class:`~toolkit_megatron.lora.LoRALinear`) runs grouped too: the base through the wrapped linears' packed
weights, each adapter as two more grouped matmuls over the experts' stacked ``A`` and ``B``, with the
expert-tensor-parallel gradient sums of ``LoRALinear``'s replicated factors. Anything ``SequentialMLP`` does that
this module does not (fp8/fp4 padding, delayed weight gradients, TE activations, DoRA on the experts) falls back to
``SequentialMLP.forward`` itself, with a warning that says why.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from toolkit_megatron.lora import LoRALinear

_KERNEL_BROKEN: set[tuple[str, torch.dtype]] = set()
"""(device type, dtype) pairs where the grouped kernel raised: the loop is used there from then on."""


def grouped_mm_function() -> Any:
    """``torch.nn.functional.grouped_mm`` (torch >= 2.10), ``torch._grouped_mm`` (2.8, 2.9) or ``None``."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class _StackedView(torch.autograd.Function):
    """``torch.stack(weights)`` that returns the shared storage itself when the weights are its slices."""

    @staticmethod
    def forward(ctx: Any, base: torch.Tensor | None, *weights: torch.Tensor) -> torch.Tensor:
        if base is not None and _are_slices_of(base, weights):
            return base.detach()  # a new tensor object on the same storage (the base stays autograd-free)
        return torch.stack(weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return (None, *grad.unbind(0))


def _are_slices_of(base: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``weights[i]`` is exactly ``base[i]`` (same storage, offset and layout)."""
    if len(weights) != base.shape[0]:
        return False
    step = base.stride(0) * base.element_size()
    start = base.data_ptr()
    return all(w.data_ptr() == start + i * step and w.shape == base.shape[1:] and w.stride() == base.stride()[1:]
               and w.dtype == base.dtype and w.device == base.device for i, w in enumerate(weights))


def pack_expert_weights(model: torch.nn.Module) -> int:
    """Make every :class:`GroupedExperts`' weights slices of one tensor per kind; returns the modules packed."""
    packed = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.pack()
            packed += 1
    return packed


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` with a grouped-matmul forward over all local experts (same parameters and keys)."""

    def __init__(self, *args: Any, **kwargs: Any):  # SequentialMLP's (num_local_experts, config, submodules, pg_collection)
        super().__init__(*args, **kwargs)
        self._bases: dict[str, torch.Tensor] = {}
        self.pack()

    # ------------------------------------------------------------------ weights
    def _linears(self, linear: str) -> list[torch.nn.Module]:
        return [getattr(expert, linear) for expert in self.local_experts]

    def _weights(self, linear: str, kind: str = "weight") -> list[torch.Tensor | None]:
        """The experts' base weights (or biases) of ``linear``, under a LoRA wrapper too."""
        return [getattr(_unwrapped(module), kind, None) for module in self._linears(linear)]

    @torch.no_grad()
    def pack(self) -> None:
        """Re-allocate the expert weights (and biases) as slices of one ``[experts, ...]`` tensor each."""
        self._bases = {}
        for linear in ("linear_fc1", "linear_fc2"):
            for kind in ("weight", "bias"):
                params = self._weights(linear, kind)
                if any(p is None or not isinstance(p, torch.nn.Parameter) for p in params):
                    continue
                base = torch.stack([p.detach() for p in params])
                for index, param in enumerate(params):
                    param.data = base[index]
                self._bases[f"{linear}.{kind}"] = base

    def _stacked(self, linear: str, kind: str = "weight") -> torch.Tensor | None:
        params = self._weights(linear, kind)
        if any(p is None for p in params):
            return None
        return _StackedView.apply(self._bases.get(f"{linear}.{kind}"), *params)

    # ------------------------------------------------------------------ forward
    def _unsupported(self) -> str | None:
        """Why the grouped forward cannot stand in for ``SequentialMLP.forward`` here (``None``: it can)."""
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        config = self.config
        for option in ("fp8", "fp4", "delay_wgrad_compute", "use_te_activation_func", "moe_latent_size"):
            if getattr(config, option, None):
                return f"{option} is set"
        for linear, plain in (("linear_fc1", ColumnParallelLinear), ("linear_fc2", RowParallelLinear)):
            modules = self._linears(linear)
            if not all(isinstance(_unwrapped(module), plain) for module in modules):
                return "expert linears are wrapped or replaced"
            if (reason := _lora_unsupported(modules)) is not None:
                return reason
        return None

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        reason = "a newer Megatron passes more arguments" if args or kwargs else self._unsupported()
        if reason is not None:
            if not getattr(self, "_warned", False):
                import warnings

                self._warned = True
                warnings.warn(f"toolkit-megatron: {reason}; the experts run as Megatron's SequentialMLP (a loop)", stacklevel=2)
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs)
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if getattr(self.config, "moe_apply_probs_on_input", False):
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        counts = torch.as_tensor(tokens_per_expert).to(device=hidden.device, dtype=torch.int64)
        fc1 = self._project("linear_fc1", hidden, counts)
        bias1 = self._stacked("linear_fc1", "bias")
        if bias1 is not None:
            fc1 = fc1 + _rows(bias1, counts, fc1.shape[0])
        intermediate = self._weighted_activation(fc1, probs, fused=bias1 is None)
        output = self._project("linear_fc2", intermediate, counts)
        bias2 = self._stacked("linear_fc2", "bias")
        if bias2 is not None:  # MLP.forward adds an expert's output bias scaled by the token's probability
            output = output + _rows(bias2, counts, output.shape[0]) * probs.unsqueeze(-1)
        return output, None

    def _project(self, linear: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's ``linear`` (without its bias) on its rows of ``x``: the base weight, plus the LoRA update
        where the linears are wrapped."""
        out = self._matmul(x, self._stacked(linear), counts)
        modules = self._linears(linear)
        if isinstance(modules[0], LoRALinear):
            out = out + _lora_update(modules, x, counts, self._matmul)
        return out

    def _weighted_activation(self, x: torch.Tensor, probs: torch.Tensor, fused: bool) -> torch.Tensor:
        """The activation times each row's router probability. With ``bias_activation_fusion`` (which
        ``--megatron-compile-elementwise`` turns on) SwiGLU takes Megatron's fused weighted kernel, as
        ``MLP.forward`` does; otherwise the unfused ops of ``MLP.forward``."""
        config = self.config
        if (fused and config.bias_activation_fusion and config.gated_linear_unit
                and config.activation_func is torch.nn.functional.silu
                and getattr(config, "activation_func_clamp_value", None) is None
                and not getattr(config, "glu_linear_offset", 0.0)):
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(x, None, probs.unsqueeze(-1), getattr(config, "activation_func_fp8_input_store", False))
        out = self._activation(x)
        return (out * probs.unsqueeze(-1)).to(out.dtype)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """``MLP.forward``'s unfused activation (gated: ``act(gate) * (linear + offset)``, optional clamps)."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(x)
        gate, linear = torch.chunk(x, 2, dim=-1)
        if (clamp := getattr(config, "activation_func_clamp_value", None)) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(gate) * (linear + getattr(config, "glu_linear_offset", 0.0))

    @staticmethod
    def _matmul(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` grouped by expert (``counts`` per expert) times each expert's ``[out, in]`` weight."""
        function = grouped_mm_function()
        key = (x.device.type, x.dtype)
        # the kernels take 16-byte aligned rows (CPU and CUDA), and on CUDA bf16 only
        aligned = x.shape[1] * x.element_size() % 16 == 0 and weights.shape[1] * weights.element_size() % 16 == 0
        usable = function is not None and x.shape[0] > 0 and key not in _KERNEL_BROKEN and aligned
        if usable and x.is_cuda:
            usable = x.dtype == torch.bfloat16
        if usable:
            offsets = counts.cumsum(0).to(torch.int32)
            try:
                return function(x, weights.transpose(1, 2), offs=offsets)
            except (RuntimeError, NotImplementedError) as exc:
                import warnings

                _KERNEL_BROKEN.add(key)
                warnings.warn(f"toolkit-megatron: torch grouped_mm cannot run on {key[0]} {key[1]} ({exc}); "
                              "the experts loop over their weights instead (slower)", stacklevel=2)
        pieces = torch.split(x, counts.tolist())
        return torch.cat([piece @ weight.t() for piece, weight in zip(pieces, weights.unbind(0))])


def _unwrapped(linear: torch.nn.Module) -> torch.nn.Module:
    """The Megatron linear itself, under a :class:`LoRALinear`."""
    return linear.base if isinstance(linear, LoRALinear) else linear


def _lora_unsupported(modules: list[torch.nn.Module]) -> str | None:
    """Why the experts' LoRA wrappers of one linear cannot run grouped (``None``: they can, or there are none)."""
    adapted = [module for module in modules if isinstance(module, LoRALinear)]
    if not adapted:
        return None
    first = adapted[0]
    if len(adapted) < len(modules):
        return "LoRA adapts only some of the experts"
    if first.dora:
        return "DoRA on the experts (its row norms of the merged weight are per expert)"
    if first.tp > 1 and (first.sequence_parallel or not first.expert_comm):  # (Megatron's expert linears never do)
        return "LoRA on expert linears that exchange tokens themselves (no explicit expert communication)"

    def layout(module: LoRALinear) -> tuple:
        return (module.kind, module.order, module.scales, module.expert_comm, type(module.dropout),
                getattr(module.dropout, "p", None), [getattr(module, f"lora_a_{p}").shape for p in module.order])

    if any(layout(module) != layout(first) for module in adapted):
        return "the experts' LoRA adapters differ in their parts, ranks, scales or dropout"
    return None


def _lora_update(modules: list[LoRALinear], x: torch.Tensor, counts: torch.Tensor, matmul: Any) -> torch.Tensor:
    """What each expert's ``LoRALinear.forward`` adds to its base output, for rows of ``x`` grouped by expert:
    ``scale * (x A_e^T) B_e^T`` per part, as two grouped matmuls over the experts' stacked factors, the parts placed
    in the base weight's rows as ``LoRALinear._fused_delta`` places them.

    With explicit expert communication ``LoRALinear`` multiplies by its replicated factor (the column layer's ``A``,
    the row layer's ``B``) through ``_ReplicatedA`` / ``_ReplicatedB``, which sum that factor's gradient over the
    expert-tensor-parallel group and leave the other gradients partial. Every rank of the group holds the same tokens,
    so summing the stacked factor's gradient (``copy_to_tensor_model_parallel_region``) is the same sum."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    first = modules[0]
    x = first.dropout(x)  # one draw for all rows (each expert's own module has the same p)
    replicated = "b" if first.row else "a"

    def stacked(which: str, part: str) -> torch.Tensor:
        factors = torch.stack([getattr(module, f"lora_{which}_{part}") for module in modules])
        if first.expert_comm and which == replicated:
            factors = copy_to_tensor_model_parallel_region(factors, group=first.group)
        return factors

    deltas = []
    for part in first.order[:1] if first.row else first.order:
        a, b = stacked("a", part), stacked("b", part)
        if pad := -a.shape[1] % 8:  # zero rows of A, columns of B: the kernel takes 16-byte aligned rows
            a, b = torch.nn.functional.pad(a, (0, 0, 0, pad)), torch.nn.functional.pad(b, (0, pad))
        deltas.append(matmul(matmul(x, a, counts), b, counts) * first.scales[part])
    return deltas[0] if first.row else first._fused_delta(deltas)


def _rows(per_expert: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """``per_expert[e]`` repeated for each of expert ``e``'s rows."""
    return torch.repeat_interleave(per_expert, counts, dim=0, output_size=total)
