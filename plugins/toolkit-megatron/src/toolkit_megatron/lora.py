"""LoRA on Megatron's tensor-parallel linears, initialised from the registered ``lora`` tuner.

The adapters are created by the tuner the user chose (toolkit-peft's ``lora``, through the
registry, its ``initial_adapters``: on a skeleton of the HF model, no base weights loaded), with
the same seed as every other strategy, then split like the
base weights: for a column-parallel layer ``A`` is replicated and ``B`` is split by output rows
(query groups for the fused QKV, gate/up halves for ``linear_fc1``); for a row-parallel layer
``A`` is split by input columns (its partial product is all-reduced over TP) and ``B`` is
replicated. So Megatron LoRA starts from exactly the adapters the local strategy trains.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from toolkit.errors import ConfigError

_HF_TO_PARTS = {"q_proj": ("linear_qkv", "q"), "k_proj": ("linear_qkv", "k"), "v_proj": ("linear_qkv", "v"),
                "gate_proj": ("linear_fc1", "gate"), "up_proj": ("linear_fc1", "up"),
                "o_proj": ("linear_proj", "o"), "down_proj": ("linear_fc2", "down"),
                # one HF linear for several parts (Phi-3): one adapter whose B rows are reordered as Megatron's
                "qkv_proj": ("linear_qkv", "qkv"), "gate_up_proj": ("linear_fc1", "gate_up")}
# multi-head latent attention (DeepSeek-V2/V3): one adapter per projection. ``column``: a column-parallel linear of
# one HF tensor (rows split evenly, as the bridge splits the base); ``kv_down``: linear_kv_down_proj, whose base
# (toolkit_megatron.mla.KVDownProjection) hands MLA the whole [latent + rotary key] output, so its B stays whole.
_MLA_TO_PARTS = {"q_proj": ("linear_q_proj", "column"), "q_a_proj": ("linear_q_down_proj", "column"),
                 "q_b_proj": ("linear_q_up_proj", "column"), "kv_a_proj_with_mqa": ("linear_kv_down_proj", "kv_down"),
                 "kv_b_proj": ("linear_kv_up_proj", "column"), "o_proj": ("linear_proj", "o")}
_ROW_KINDS = ("linear_proj", "linear_fc2")
_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(A|B|magnitude_vector)(?:\.default)?(?:\.weight)?$")


def hf_adapters(source: Any, tuner: Any, recipe: Any) -> tuple[dict, float]:
    """``{(layer, hf_proj): {"A": tensor, "B": tensor}}`` as the tuner initialises them, and the scale.

    Asked of the tuner's ``initial_adapters(source, recipe)`` (``contracts.OPTIONAL["tuner"]``), which builds
    them without the base weights: no rank holds a copy of the HF model for this."""
    from toolkit.contracts import member

    config = getattr(tuner, "config", None)
    if config is None or not hasattr(config, "rank"):
        raise ConfigError(f"--tuner {tuner.name}: the megatron strategy needs a LoRA tuner with rank/alpha options")
    initial_adapters = member(tuner, "tuner", "initial_adapters")
    if initial_adapters is None:
        raise ConfigError(f"--tuner {tuner.name} has no initial_adapters(source, recipe) method, which the megatron "
                          "strategy builds its adapters from (docs/hooks.md)")
    adapters: dict = {}
    for name, tensor in initial_adapters(source, recipe).items():
        match = _NAME.search(name)
        if match is None:
            if "lora" in name:
                raise ConfigError(f"--tuner {tuner.name}: adapter {name!r} is on a module the megatron strategy cannot map")
            continue
        layer, proj, which = int(match.group(1)), match.group(2), match.group(3)
        if proj not in _HF_TO_PARTS and proj not in _MLA_TO_PARTS:
            raise ConfigError(f"--tuner {tuner.name}: LoRA on {proj} is not supported by the megatron strategy")
        adapters.setdefault((layer, proj), {})["M" if which == "magnitude_vector" else which] = tensor.detach().float().clone()
    scale = config.alpha / (config.rank ** 0.5 if getattr(config, "rslora", False) else config.rank)
    return adapters, scale


class _ReplicatedA(torch.autograd.Function):
    """``x @ A.T`` for a column-parallel layer's replicated ``A``.

    Each TP rank only sees the gradient of its own output rows, so the gradient reaching ``A``
    is summed over the TP group (every rank then holds ``A``'s full gradient). The input's
    gradient stays partial under sequence parallelism, where the gather's backward sums it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sequence_parallel = sequence_parallel
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        from megatron.core import parallel_state as ps

        x, weight = ctx.saved_tensors
        full = grad.contiguous().clone()
        if ps.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(full, group=ps.get_tensor_model_parallel_group())
        grad_weight = full.reshape(-1, full.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        grad_x = (grad if ctx.sequence_parallel else full) @ weight
        return grad_x, grad_weight.to(weight.dtype), None


def _megatron_rows(part: str, rows: torch.Tensor, geo: Any, tp: int) -> torch.Tensor:
    """The output rows of a fused HF linear's adapter (``B``, DoRA's magnitude) in Megatron's order, so that each
    TP rank's contiguous slice is its shard: ``qkv`` ([all q; all k; all v]) interleaved per query group,
    ``gate_up`` ([gate; up]) as each rank's ``[gate shard; up shard]`` in rank order. Other parts: unchanged."""
    if part == "qkv":
        per_group, tail = geo.heads // geo.groups, rows.shape[1:]
        q, k, v = rows.split([geo.heads * geo.head_dim, geo.groups * geo.head_dim, geo.groups * geo.head_dim])
        return torch.cat([q.reshape(geo.groups, per_group * geo.head_dim, *tail), k.reshape(geo.groups, geo.head_dim, *tail),
                          v.reshape(geo.groups, geo.head_dim, *tail)], dim=1).reshape(-1, *tail)
    if part == "gate_up":
        gate, up = rows.chunk(2)
        return torch.cat([half for pair in zip(gate.chunk(tp), up.chunk(tp), strict=True) for half in pair])
    return rows


class LoRALinear(torch.nn.Module):
    """A Megatron Column/RowParallelLinear plus LoRA adapters for the HF projections fused into it."""

    def __init__(self, base: Any, kind: str, parts: dict[str, dict], geometry: Any, scale: float, dropout: float):
        super().__init__()
        from megatron.core import parallel_state as ps

        self.base = base
        self.kind = kind  # linear_qkv | linear_fc1 | linear_proj | linear_fc2
        self.scale = scale
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.sequence_parallel = getattr(base, "sequence_parallel", base.config.sequence_parallel)
        self.geo = geometry
        self.order = [p for p in ("q", "k", "v", "gate", "up", "o", "down", "qkv", "gate_up", "column", "kv_down") if p in parts]
        self.dora = any("M" in parts[p] for p in self.order)
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        dtype = base.weight.dtype
        for part in self.order:
            a, b = parts[part]["A"], _megatron_rows(part, parts[part]["B"], geometry, tp)
            if kind in _ROW_KINDS:
                cols = a.shape[1] // tp
                a = a[:, rank * cols:(rank + 1) * cols]
            elif part != "kv_down":  # kv_down: A and B whole on every rank (see _kv_down_delta)
                rows = b.shape[0] // tp
                b = b[rank * rows:(rank + 1) * rows]
            self.register_parameter(f"lora_a_{part}", torch.nn.Parameter(a.to(dtype).contiguous()))
            self.register_parameter(f"lora_b_{part}", torch.nn.Parameter(b.to(dtype).contiguous()))
            if self.dora:  # DoRA magnitude per output row: split like B's rows
                magnitude = _megatron_rows(part, parts[part]["M"], geometry, tp)
                if kind not in ("linear_proj", "linear_fc2"):
                    magnitude = magnitude[rank * (magnitude.shape[0] // tp):(rank + 1) * (magnitude.shape[0] // tp)]
                self.register_parameter(f"lora_m_{part}", torch.nn.Parameter(magnitude.to(dtype).contiguous()))
                m = getattr(self, f"lora_m_{part}")
                if kind in ("linear_proj", "linear_fc2"):
                    m.sequence_parallel = self.sequence_parallel
                else:
                    m.tensor_model_parallel, m.partition_dim = True, 0
            if kind in _ROW_KINDS:
                getattr(self, f"lora_a_{part}").tensor_model_parallel = True
                getattr(self, f"lora_a_{part}").partition_dim = 1
                # B's update is scattered to the sequence chunk after the product, so its gradient is
                # already complete on every rank; the DoRA magnitude scales the chunk and is summed.
            elif part == "kv_down":
                # sequence parallel: each rank's gradient covers its own tokens, summed over TP like a norm's
                for which in "ab":
                    getattr(self, f"lora_{which}_{part}").sequence_parallel = self.sequence_parallel
            else:
                getattr(self, f"lora_b_{part}").tensor_model_parallel = True
                getattr(self, f"lora_b_{part}").partition_dim = 0

        self._register_load_state_dict_pre_hook(self._base_keys)

    @staticmethod
    def _base_keys(state: dict, prefix: str, *args: Any) -> None:
        """Checkpoints name the base weights as Megatron does (``linear_qkv.weight``), not ``.base.``."""
        for key in list(state):
            rest = key[len(prefix):] if key.startswith(prefix) else None
            if rest is not None and not rest.startswith(("base.", "lora_")):
                state[prefix + "base." + rest] = state.pop(key)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from megatron.core.tensor_parallel import mappings

        out, bias = self.base(x, *args, **kwargs)
        if self.order == ["kv_down"]:
            return out + self._kv_down_delta(x) * self.scale, bias
        row = self.kind in _ROW_KINDS
        if not row and self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x)
        x = self.dropout(x)
        if row:
            pieces = [torch.nn.functional.linear(x, getattr(self, f"lora_a_{p}")) for p in self.order]
        else:
            pieces = [_ReplicatedA.apply(x, getattr(self, f"lora_a_{p}"), self.sequence_parallel) for p in self.order]
        if row:
            a = mappings.reduce_from_tensor_model_parallel_region(pieces[0])
            delta = torch.nn.functional.linear(a, getattr(self, f"lora_b_{self.order[0]}"))
            if self.sequence_parallel:
                delta = mappings.scatter_to_sequence_parallel_region(delta)
        else:
            delta = self._fused_delta([torch.nn.functional.linear(a, getattr(self, f"lora_b_{p}"))
                                       for a, p in zip(pieces, self.order, strict=True)])
        if self.dora:
            return self._dora_ratio() * (out + delta * self.scale), bias
        return out + delta * self.scale, bias

    def _kv_down_delta(self, x: torch.Tensor) -> torch.Tensor:
        """MLA's key/value down-projection update, whole like the base's output (sequence-parallel: this rank's
        tokens, as ``x``). Without sequence parallelism every rank computes it for every token, and the rotary
        key's columns get the gradient of this rank's heads only: it is summed over TP, as KVDownProjection does."""
        from megatron.core import parallel_state as ps

        from toolkit_megatron.mla import SumRotaryGrad

        delta = torch.nn.functional.linear(torch.nn.functional.linear(self.dropout(x), self.lora_a_kv_down), self.lora_b_kv_down)
        if not self.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
            delta = SumRotaryGrad.apply(delta, self.base.config.kv_lora_rank, ps.get_tensor_model_parallel_group())
        return delta

    def _delta_weight(self) -> torch.Tensor:
        """``scale * B A`` in this rank's fused, sharded layout ``[out_local, in_local]``."""
        if self.order == ["kv_down"]:  # whole B: this rank's rows of the base weight
            from megatron.core import parallel_state as ps

            rows, rank = self.base.weight.shape[0], ps.get_tensor_model_parallel_rank()
            return (self.lora_b_kv_down[rank * rows:(rank + 1) * rows] @ self.lora_a_kv_down) * self.scale
        if self.kind in _ROW_KINDS:
            p = self.order[0]
            return (getattr(self, f"lora_b_{p}") @ getattr(self, f"lora_a_{p}")) * self.scale
        pieces = [(getattr(self, f"lora_b_{p}") @ getattr(self, f"lora_a_{p}")).t() for p in self.order]
        return self._fused_delta(pieces).t() * self.scale

    def _dora_ratio(self) -> torch.Tensor:
        """DoRA's ``magnitude / ||W + scale B A||`` per output row (the norm is detached, as in PEFT)."""
        from megatron.core import parallel_state as ps

        with torch.no_grad():
            squares = (self.base.weight.float() + self._delta_weight().float()).pow(2).sum(dim=1)
            if self.kind in _ROW_KINDS and ps.get_tensor_model_parallel_world_size() > 1:
                torch.distributed.all_reduce(squares, group=ps.get_tensor_model_parallel_group())
            norm = squares.sqrt().to(self.base.weight.dtype)
        if self.kind in _ROW_KINDS:
            magnitude = getattr(self, f"lora_m_{self.order[0]}")
        else:
            magnitude = self._fused_delta([getattr(self, f"lora_m_{p}")[None] for p in self.order], fill=None)[0]
        return magnitude / norm

    def _fused_delta(self, deltas: list[torch.Tensor], fill: float | None = 0.0) -> torch.Tensor:
        """Place each projection's update where Megatron's fused weight keeps its rows.

        A projection without an adapter contributes ``fill`` (``None``: the base weight's row norm,
        so DoRA leaves those rows unscaled).
        """
        if self.order in (["qkv"], ["gate_up"], ["column"]):  # one HF linear's adapter: its rows are Megatron's already
            return deltas[0]
        by_part = dict(zip(self.order, deltas, strict=True))
        lead = deltas[0].shape[:-1]

        def missing(width: int, start: int) -> torch.Tensor:
            if fill is not None:
                return deltas[0].new_full((*lead, width), fill)
            rows = self.base.weight.detach()[start:start + width].float()
            return rows.pow(2).sum(dim=1).sqrt().to(deltas[0].dtype).expand(*lead, width)

        if self.kind == "linear_fc1":
            half = self.base.weight.shape[0] // 2
            return torch.cat([by_part["gate"] if "gate" in by_part else missing(half, 0),
                              by_part["up"] if "up" in by_part else missing(half, half)], dim=-1)
        geo = self.geo
        groups = geo.groups // geo.tp
        per_group = geo.heads // geo.groups
        widths = {"q": per_group * geo.head_dim, "k": geo.head_dim, "v": geo.head_dim}
        if fill is None and len(by_part) < 3:
            raise NotImplementedError("DoRA on only some of q/k/v projections is not supported by the megatron strategy")
        blocks = []
        for part in ("q", "k", "v"):
            value = by_part.get(part)
            if value is None:
                value = deltas[0].new_full((*lead, groups * widths[part]), fill)
            blocks.append(value.reshape(*lead, groups, widths[part]))
        return torch.cat(blocks, dim=-1).reshape(*lead, -1)

    def merged_weight(self) -> torch.Tensor:
        """``W + scale * B A`` (times DoRA's row ratio) in this rank's sharded, fused layout, for export."""
        with torch.no_grad():
            merged = self.base.weight.float() + self._delta_weight().float()
            if self.dora:
                merged = merged * self._dora_ratio().float()[:, None]
        return merged.to(self.base.weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        lora = {n: p for n, p in self._parameters.items() if p is not None}
        axes = {n: (1 if n.startswith("lora_a") else 0) for n, p in lora.items() if getattr(p, "tensor_model_parallel", False)}
        state.update(make_sharded_tensors_for_checkpoint(lora, prefix, axes, sharded_offsets))
        return state


def apply_lora(models: list[Any], adapters: dict, scale: float, dropout: float, hf_config: Any, padded_vocab: int) -> None:
    """Freeze the base model and wrap every targeted parallel linear with :class:`LoRALinear`."""
    from megatron.core import parallel_state as ps

    from toolkit_megatron.bridge import Geometry

    geo = Geometry.of(hf_config, padded_vocab, ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
    for model in models:
        for param in model.parameters():
            param.requires_grad_(False)
        for layer in model.decoder.layers:
            index = layer.layer_number - 1
            latent = hasattr(layer.self_attention, "linear_kv_down_proj")  # MLA
            grouped: dict[str, dict] = {}
            for (at, proj), tensors in adapters.items():
                if at == index:
                    table = _MLA_TO_PARTS if latent and proj in _MLA_TO_PARTS else _HF_TO_PARTS
                    if proj not in table:
                        raise ConfigError(f"LoRA on {proj} is not supported by the megatron strategy for "
                                          f"{hf_config.model_type}")
                    module, part = table[proj]
                    if "M" in tensors and part in ("column", "kv_down"):
                        raise ConfigError(f"DoRA on the latent attention's {proj} is not supported by the megatron "
                                          "strategy; use --tuner lora, or --strategy local")
                    grouped.setdefault(module, {})[part] = tensors
            for module_name, parts in grouped.items():
                owner = layer.self_attention if hasattr(layer.self_attention, module_name) else layer.mlp
                setattr(owner, module_name, LoRALinear(getattr(owner, module_name), module_name, parts, geo, scale, dropout))


def export_merged(chunks: list[Any], hf_config: Any) -> Any:
    """HF tensors of ``chunks`` with every LoRA adapter merged into its base weight (rank 0 yields)."""
    from toolkit_megatron.bridge import export_hf_tensors

    for chunk in chunks:
        chunk.toolkit_merged = {f"{path}.base.weight": module.merged_weight()
                                for path, module in chunk.named_modules() if isinstance(module, LoRALinear)}
    try:
        yield from export_hf_tensors(chunks, hf_config)
    finally:
        for chunk in chunks:
            chunk.toolkit_merged = {}
