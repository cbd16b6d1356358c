"""LoRA on Megatron's tensor-parallel linears, initialised from the registered ``lora`` tuner.

The adapters are created by the tuner the user chose (toolkit-peft's ``lora``, through the
registry, its ``initial_adapters``: on a skeleton of the HF model, no base weights loaded), with
the same seed as every other strategy, then split like the base weights. Which Megatron linear
an HF module's adapter belongs to, and which slice of it, is read from the bridge's mapping table
(:data:`toolkit_megatron.bridge.PER_LAYER`), so a family the bridge learns gets LoRA too. For a
column-parallel layer ``A`` is replicated and ``B`` is split by output rows (query groups for the
fused QKV, gate/up halves for ``linear_fc1``); for a row-parallel layer ``A`` is split by input
columns (its partial product is all-reduced over TP) and ``B`` is replicated. Routed experts
(transformers 5 fuses a layer's experts into one module, PEFT adapts its ``gate_up_proj`` /
``down_proj`` parameters with one ``[experts * r, in]`` / ``[out, r * experts]`` pair) become one
adapter per expert on that expert's ``linear_fc1`` / ``linear_fc2``, split over the expert
tensor-parallel group, whose token exchange does the communication the dense layers do themselves.
The MoE router and Qwen2-MoE's shared expert gate, whose weights are replicated, keep whole adapters
(:mod:`toolkit_megatron.gate_lora`). So Megatron LoRA starts from exactly the adapters the local strategy trains.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from toolkit.errors import ConfigError
from toolkit_megatron.gate_lora import GATE_WEIGHTS, adapt_gate, gates, merged_gates, module_name

_ADAPTER = re.compile(r"^(?P<path>.+?)(?:\.base_layer)*\.lora_(?P<which>A|B|magnitude_vector)(?:\.default)?(?:\.weight)?$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FUSED_EXPERTS = {"gate_up": "gate_up_proj", "row": "down_proj"}
"""transformers 5's fused routed-expert parameters, by the bridge split of the Megatron expert linear they become."""
_COLUMN_PARTS = ("q", "k", "v", "gate", "up", "qkv", "gate_up", "column", "kv_down")


def adapter_spec(tuner: Any) -> Any:
    """The tuner's ``contracts.AdapterSpec`` (what it adapts), the only description of its options this strategy reads;
    a tuner without one, or with options the strategy cannot train, is refused by name."""
    from toolkit.contracts import member

    describe = member(tuner, "tuner", "adapter_spec")
    if describe is None:
        raise ConfigError(f"--tuner {tuner.name} has no adapter_spec() method: the megatron strategy trains adapters only "
                          "from a tuner that describes them (contracts.AdapterSpec, docs/hooks.md); use --tuner lora or "
                          "dora, or --strategy local")
    spec = describe()
    if spec.modules_to_save:
        raise ConfigError(f"--{tuner.name}-modules-to-save {','.join(spec.modules_to_save)}: the megatron strategy trains "
                          "adapters only, not whole modules beside them; leave it empty, or use --strategy local")
    if spec.bias != "none":
        raise ConfigError(f"--{tuner.name}-bias {spec.bias}: the megatron strategy trains adapters only, not the biases "
                          f"beside them; use --{tuner.name}-bias none, or --strategy local")
    return spec


def hf_adapters(source: Any, tuner: Any, recipe: Any) -> dict:
    """``{(layer, hf_path): {"A", "B", "M"?, "scale", "names"}}`` as the tuner initialises them.

    ``hf_path`` is the adapted HF module (``model.layers.1.self_attn.q_proj``), or for routed experts
    the fused parameter (``model.layers.1.mlp.experts.gate_up_proj``) with PEFT's ``[experts * r, in]``
    ``A`` and ``[out, r * experts]`` ``B``. ``scale`` is the spec's factor for that adapter's rank (PEFT
    gives the fused gate/up experts twice the rank and twice the alpha); ``names`` the tuner's names of
    the tensors. Asked of the tuner's ``initial_adapters(source, recipe)`` (``contracts.OPTIONAL["tuner"]``),
    which builds them without the base weights: no rank holds a copy of the HF model for this."""
    from toolkit.contracts import member

    spec = adapter_spec(tuner)
    initial_adapters = member(tuner, "tuner", "initial_adapters")
    if initial_adapters is None:
        raise ConfigError(f"--tuner {tuner.name} has no initial_adapters(source, recipe) method, which the megatron "
                          "strategy builds its adapters from (docs/hooks.md)")
    found: dict[str, dict] = {}
    for name, tensor in initial_adapters(source, recipe).items():
        match = _ADAPTER.match(name)
        layer = _LAYER.search(match["path"]) if match else None
        if layer is None:  # nothing else may train: the strategy would leave it out silently
            raise ConfigError(f"--tuner {tuner.name} trains {name!r}, which is no adapter in a decoder layer: the megatron "
                              "strategy cannot map it; adapt the decoder layers' linears only, or use --strategy local")
        # nested PEFT wrappers (two fused expert parameters of one module) keep their own adapters
        key = name[:name.index(".lora_")]
        which = "M" if match["which"] == "magnitude_vector" else match["which"]
        entry = found.setdefault(key, {"path": match["path"], "layer": int(layer.group(1)), "names": {}})
        entry[which], entry["names"][which] = tensor.detach().float().clone(), name
    adapters: dict = {}
    for entry in found.values():
        path, layer = entry.pop("path"), entry.pop("layer")
        rank = entry["A"].shape[0]
        if path.rsplit(".", 1)[-1] == "experts":
            path, experts = _fused_expert_parameter(path, entry, source.config, tuner)
            rank //= experts
        if (layer, path) in adapters:
            raise ConfigError(f"--tuner {tuner.name}: two adapters on {path} of layer {layer}")
        entry["scale"] = spec.scale(rank)
        adapters[(layer, path)] = entry
    return adapters


def _fused_expert_parameter(path: str, entry: dict, hf_config: Any, tuner: Any) -> tuple[str, int]:
    """Which fused expert parameter a routed-experts adapter is on (PEFT nests the wrappers of one module; their
    shapes tell them apart), and the number of experts."""
    from toolkit_megatron.architectures import architecture_for

    arch = architecture_for(hf_config.model_type)
    if not getattr(arch, "moe", False):
        raise ConfigError(f"--tuner {tuner.name}: adapter on {path}, but {hf_config.model_type} has no routed experts")
    shape = (entry["A"].shape[1], entry["B"].shape[0])
    hidden, ffn = hf_config.hidden_size, arch.expert_ffn(hf_config)
    shapes = {(hidden, 2 * ffn): "gate_up_proj", (ffn, hidden): "down_proj"}
    if shape not in shapes:
        raise ConfigError(f"--tuner {tuner.name}: an adapter on {path} maps {shape[0]} to {shape[1]} features, which is "
                          f"neither the experts' gate/up ({hidden} -> {2 * ffn}) nor their down projection ({ffn} -> {hidden})")
    if "M" in entry:
        raise ConfigError(f"--tuner {tuner.name}: DoRA on routed experts is not supported by the megatron strategy")
    return f"{path}.{shapes[shape]}", arch.num_experts(hf_config)


class _ReplicatedA(torch.autograd.Function):
    """``x @ A.T`` for a column-parallel layer's replicated ``A``.

    Each rank of the splitting group only sees the gradient of its own output rows, so the gradient
    reaching ``A`` is summed over the group (every rank then holds ``A``'s full gradient). The input's
    gradient stays partial (``partial``) under sequence parallelism, where the gather's backward sums
    it, and for experts, whose token exchange sums it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, partial: bool, group: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.partial, ctx.group = partial, group
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        x, weight = ctx.saved_tensors
        full = grad.contiguous().clone()
        if torch.distributed.get_world_size(ctx.group) > 1:
            torch.distributed.all_reduce(full, group=ctx.group)
        grad_weight = full.reshape(-1, full.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        grad_x = (grad if ctx.partial else full) @ weight
        return grad_x, grad_weight.to(weight.dtype), None, None


class _ReplicatedB(torch.autograd.Function):
    """``h @ B.T`` for a row-parallel expert's replicated ``B`` applied to this rank's partial ``h``: the expert
    output stays partial (the token exchange sums it over the group), so ``B``'s gradient is summed here."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.group = group
        return torch.nn.functional.linear(h, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        h, weight = ctx.saved_tensors
        grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        if torch.distributed.get_world_size(ctx.group) > 1:
            torch.distributed.all_reduce(grad_weight, group=ctx.group)
        return grad @ weight, grad_weight.to(weight.dtype), None


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


def _hf_rows(part: str, rows: torch.Tensor, geo: Any, tp: int) -> torch.Tensor:
    """The inverse of :func:`_megatron_rows` (Megatron's gathered rows back in the HF linear's order)."""
    if part == "qkv":
        per_group, tail = geo.heads // geo.groups, rows.shape[1:]
        grouped = rows.reshape(geo.groups, per_group + 2, geo.head_dim, *tail)
        return torch.cat([grouped[:, :per_group].reshape(-1, *tail), grouped[:, per_group].reshape(-1, *tail),
                          grouped[:, per_group + 1].reshape(-1, *tail)])
    if part == "gate_up":
        pairs = [shard.chunk(2) for shard in rows.chunk(tp)]
        return torch.cat([torch.cat([pair[0] for pair in pairs]), torch.cat([pair[1] for pair in pairs])])
    return rows


class LoRALinear(torch.nn.Module):
    """A Megatron Column/RowParallelLinear plus LoRA adapters for the HF projections fused into it.

    ``kind`` is the bridge's split of the base weight (``qkv``, ``gate_up``, ``column``, ``row``) or ``kv_down``
    (MLA's whole key/value down-projection); ``parts`` maps each adapted part to its HF tensors and scale."""

    def __init__(self, base: Any, kind: str, parts: dict[str, dict], geometry: Any, dropout: float):
        super().__init__()
        from megatron.core import parallel_state as ps

        self.base = base
        self.kind = kind
        self.row = kind == "row"
        self.scales = {part: float(parts[part]["scale"]) for part in parts}
        # where each part's tensors came from (the tuner's names; routed experts: this expert's index of all)
        self.sources = {part: (parts[part].get("names", {}), parts[part].get("expert")) for part in parts}
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        # experts: the linear leaves every exchange to the token dispatcher (the group splits, nothing else)
        self.expert = bool(getattr(base, "is_expert", False))
        self.expert_comm = bool(getattr(base, "explicit_expert_comm", False))
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", base.config.sequence_parallel)) and not self.expert_comm
        self.group = getattr(base, "tp_group", None) or ps.get_tensor_model_parallel_group()
        self.tp, self.rank = torch.distributed.get_world_size(self.group), torch.distributed.get_rank(self.group)
        self.geo = geometry
        self.order = [p for p in _COLUMN_PARTS + ("row",) if p in parts]
        self.dora = any("M" in parts[p] for p in self.order)
        tp, rank = self.tp, self.rank
        # the base's device too: the adapters come from the tuner on the host (per-expert slices of PEFT's fused
        # adapters stayed there, and Megatron's optimizer refuses a CPU parameter on a GPU run)
        dtype, device = base.weight.dtype, base.weight.device
        for part in self.order:
            a, b = parts[part]["A"], _megatron_rows(part, parts[part]["B"], geometry, tp)
            if self.row:
                cols = a.shape[1] // tp
                a = a[:, rank * cols:(rank + 1) * cols]
            elif part != "kv_down":  # kv_down: A and B whole on every rank (see _kv_down_delta)
                rows = b.shape[0] // tp
                b = b[rank * rows:(rank + 1) * rows]
            self.register_parameter(f"lora_a_{part}", torch.nn.Parameter(a.to(device, dtype).contiguous()))
            self.register_parameter(f"lora_b_{part}", torch.nn.Parameter(b.to(device, dtype).contiguous()))
            if self.dora:  # DoRA magnitude per output row: split like B's rows
                magnitude = _megatron_rows(part, parts[part]["M"], geometry, tp)
                if not self.row:
                    magnitude = magnitude[rank * (magnitude.shape[0] // tp):(rank + 1) * (magnitude.shape[0] // tp)]
                self.register_parameter(f"lora_m_{part}", torch.nn.Parameter(magnitude.to(device, dtype).contiguous()))
                m = getattr(self, f"lora_m_{part}")
                if self.row:
                    m.sequence_parallel = self.sequence_parallel
                else:
                    m.tensor_model_parallel, m.partition_dim = True, 0
            if self.row:
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
        for name, param in self._parameters.items():
            if self.expert and tp == 1 and not getattr(param, "tensor_model_parallel", False):
                # whole on this rank like the expert weight itself (counted once per rank in the gradient norm)
                param.tensor_model_parallel, param.partition_dim = True, 1 if name.startswith("lora_a") and self.row else 0
            if hasattr(base.weight, "allreduce"):  # expert weights: reduced over the expert data-parallel group
                param.allreduce = base.weight.allreduce

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
        if self.kind == "kv_down":
            return out + self._kv_down_delta(x) * self.scales["kv_down"], bias
        if not self.row and self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, group=self.group)
        x = self.dropout(x)
        if self.row:
            part = self.order[0]
            a = torch.nn.functional.linear(x, getattr(self, f"lora_a_{part}"))
            b = getattr(self, f"lora_b_{part}")
            if self.expert_comm:  # the partial update is summed with the expert's partial output by the dispatcher
                delta = _ReplicatedB.apply(a, b, self.group) * self.scales[part]
            else:
                delta = torch.nn.functional.linear(mappings.reduce_from_tensor_model_parallel_region(a, group=self.group), b)
                delta = delta * self.scales[part]
                if self.sequence_parallel:
                    delta = mappings.scatter_to_sequence_parallel_region(delta, group=self.group)
        else:
            partial = self.sequence_parallel or self.expert_comm
            pieces = [_ReplicatedA.apply(x, getattr(self, f"lora_a_{p}"), partial, self.group) for p in self.order]
            delta = self._fused_delta([torch.nn.functional.linear(a, getattr(self, f"lora_b_{p}")) * self.scales[p]
                                       for a, p in zip(pieces, self.order, strict=True)])
        if self.dora:
            return self._dora_ratio() * (out + delta), bias
        return out + delta, bias

    def _kv_down_delta(self, x: torch.Tensor) -> torch.Tensor:
        """MLA's key/value down-projection update, whole like the base's output (sequence-parallel: this rank's
        tokens, as ``x``). Without sequence parallelism every rank computes it for every token, and the rotary
        key's columns get the gradient of this rank's heads only: it is summed over TP, as KVDownProjection does."""
        from toolkit_megatron.mla import SumRotaryGrad

        delta = torch.nn.functional.linear(torch.nn.functional.linear(self.dropout(x), self.lora_a_kv_down), self.lora_b_kv_down)
        if not self.sequence_parallel and self.tp > 1:
            delta = SumRotaryGrad.apply(delta, self.base.config.kv_lora_rank, self.group)
        return delta

    def _delta_weight(self) -> torch.Tensor:
        """``scale * B A`` in this rank's fused, sharded layout ``[out_local, in_local]``."""
        if self.kind == "kv_down":  # whole B: this rank's rows of the base weight
            rows = self.base.weight.shape[0]
            return (self.lora_b_kv_down[self.rank * rows:(self.rank + 1) * rows] @ self.lora_a_kv_down) * self.scales["kv_down"]
        if self.row:
            p = self.order[0]
            return (getattr(self, f"lora_b_{p}") @ getattr(self, f"lora_a_{p}")) * self.scales[p]
        pieces = [(getattr(self, f"lora_b_{p}") @ getattr(self, f"lora_a_{p}")).t() * self.scales[p] for p in self.order]
        return self._fused_delta(pieces).t()

    def _dora_ratio(self) -> torch.Tensor:
        """DoRA's ``magnitude / ||W + scale B A||`` per output row (the norm is detached, as in PEFT)."""
        with torch.no_grad():
            squares = (self.base.weight.float() + self._delta_weight().float()).pow(2).sum(dim=1)
            if self.row and self.tp > 1:
                torch.distributed.all_reduce(squares, group=self.group)
            norm = squares.sqrt().to(self.base.weight.dtype)
        if self.row:
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

        if self.kind == "gate_up":
            half = self.base.weight.shape[0] // 2
            return torch.cat([by_part["gate"] if "gate" in by_part else missing(half, 0),
                              by_part["up"] if "up" in by_part else missing(half, half)], dim=-1)
        geo = self.geo
        groups = geo.groups // self.tp
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

    def full_part(self, part: str, value: Any) -> dict[str, torch.Tensor]:
        """``value`` of this part's ``A``, ``B`` (and DoRA's ``M``) gathered over the splitting group, in the HF
        linear's layout (every rank of the group must call it)."""
        out = {}
        for which in ("a", "b", "m"):
            param = getattr(self, f"lora_{which}_{part}", None)
            if param is None:
                continue
            tensor = value(param).detach().contiguous()
            split = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
            if split is not None and self.tp > 1:
                shards = [torch.empty_like(tensor) for _ in range(self.tp)]
                torch.distributed.all_gather(shards, tensor, group=self.group)
                tensor = torch.cat(shards, dim=split)
            if which != "a":
                tensor = _hf_rows(part, tensor, self.geo, self.tp)
            out[which.upper()] = tensor
        return out

    def merged_weight(self) -> torch.Tensor:
        """``W + scale * B A`` (times DoRA's row ratio) in this rank's sharded, fused layout, for export."""
        with torch.no_grad():
            merged = self.base.weight.float() + self._delta_weight().float()
            if self.dora:
                merged = merged * self._dora_ratio().float()[:, None]
        return merged.to(self.base.weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The base's entries plus the adapters', split over the group like the parameters; a fused ``gate_up``
        adapter's rows (``B``, DoRA's magnitude) as Megatron saves the gated ``linear_fc1.weight``, by halves
        (:func:`toolkit_megatron.checkpoint.gate_up_rows`)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        from toolkit_megatron.checkpoint import gate_up_rows

        state = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        lora = {n: p for n, p in self._parameters.items() if p is not None}
        axes = {n: (1 if n.startswith("lora_a") and self.row else 0) for n, p in lora.items()
                if getattr(p, "tensor_model_parallel", False)}
        state.update(make_sharded_tensors_for_checkpoint(lora, prefix, axes, sharded_offsets, tp_group=self.group,
                                                         dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True)))
        for name in ("lora_b_gate_up", "lora_m_gate_up"):
            if name in lora:
                state[prefix + name] = gate_up_rows(state[prefix + name], sharded_offsets, metadata, expert=self.expert)
        return state


def _targets(arch: Any, layer: int) -> dict[str, list[tuple[str, str, str]]]:
    """HF module path -> ``(Megatron module path in the layer, part, split)`` candidates, read from the bridge's
    table: every linear weight the bridge splits over TP (the one a layer really has is picked by the caller), and
    the gates LoRA adapts whole (``(module path, parameter name, "gate")``)."""
    from toolkit_megatron.bridge import PER_LAYER, fused, hf_names

    found: dict[str, list[tuple[str, str, str]]] = {}
    for key, mapping in PER_LAYER.items():
        if key in GATE_WEIGHTS:  # replicated: the module and its parameter (see gate_lora)
            try:
                name = module_name(hf_names(arch, mapping, layer)[0].removesuffix(".weight"), arch.families)
            except (AttributeError, KeyError):
                continue
            found.setdefault(name, []).append((*key.rsplit(".", 1), "gate"))
            continue
        if mapping.split not in ("qkv", "gate_up", "column", "row") or not key.endswith(".weight"):
            continue
        module = key.removesuffix(".weight")
        if mapping.table == "expert":  # one fused module per layer, whose parameters name the Megatron linear
            found[f"experts.{_FUSED_EXPERTS[mapping.split]}"] = [(module, mapping.split, mapping.split)]
            continue
        try:
            names = [name.removesuffix(".weight") for name in hf_names(arch, mapping, layer)]
        except (AttributeError, KeyError):  # a part this family does not have
            continue
        if fused(names):
            found.setdefault(names[0], []).append((module, mapping.split, mapping.split))
            continue
        for part, name in zip(mapping.parts, names, strict=True):
            found.setdefault(name, []).append((module, part if mapping.split in ("qkv", "gate_up") else mapping.split,
                                               mapping.split))
    return found


def _submodule(root: Any, path: str) -> Any:
    for name in path.split("."):
        root = getattr(root, name, None)
        if root is None:
            return None
    return root


def _per_expert(tensors: dict, geo: Any) -> list[tuple[int, dict]]:
    """(local expert index, its adapter) out of PEFT's fused adapter of all experts (``A`` rows expert-major,
    ``B`` columns rank-major: PEFT's ``ParamWrapper``), for the experts this expert-parallel rank holds."""
    experts = geo.experts
    local = experts // geo.ep
    first = geo.ep_rank * local
    a, b = tensors["A"], tensors["B"]
    a = a.reshape(experts, -1, a.shape[-1])
    b = b.reshape(b.shape[0], -1, experts)
    return [(index, {"A": a[first + index], "B": b[:, :, first + index], "scale": tensors["scale"], "names": tensors["names"],
                     "expert": (first + index, experts)}) for index in range(local)]


def _layer_adapters(layer: Any, adapters: dict, arch: Any, hf_config: Any, geo: Any) -> dict[str, tuple[str, dict]]:
    """Megatron module path in ``layer`` -> (kind, {part: tensors}) for the adapters of that layer."""
    from toolkit_megatron.mla import KVDownProjection

    index = layer.layer_number - 1
    targets = _targets(arch, index)
    grouped: dict[str, tuple[str, dict]] = {}
    for (at, path), tensors in adapters.items():
        if at != index:
            continue
        leaf = ".".join(path.rsplit(".", 2)[-2:])
        options = targets.get(path, []) + (targets.get(leaf, []) if leaf.startswith("experts.") else [])
        options = [t for t in options if _submodule(layer, t[0].format(e=0)) is not None]
        if not options:
            raise ConfigError(f"LoRA on {path} is not supported by the megatron strategy for {hf_config.model_type}: the "
                              "bridge maps no Megatron linear of this layer to it (drop it from --lora-target-modules)")
        module, part, split = options[0]
        if split == "gate":  # whole on every rank: nothing to split (see gate_lora)
            grouped[f"{module}.{part}"] = (split, {path: tensors})
            continue
        if isinstance(_submodule(layer, module), KVDownProjection):
            part = split = "kv_down"
        if "M" in tensors and split in ("column", "kv_down"):
            raise ConfigError(f"DoRA on the latent attention's {path} is not supported by the megatron strategy; use "
                              "--tuner lora, or --strategy local")
        if "{e}" in module:
            for local, expert in _per_expert(tensors, geo):
                grouped.setdefault(module.format(e=local), (split, {}))[1][part] = expert
        else:
            grouped.setdefault(module, (split, {}))[1][part] = tensors
    return grouped


def apply_lora(models: list[Any], adapters: dict, dropout: float, hf_config: Any, padded_vocab: int) -> None:
    """Freeze the base model and wrap every targeted parallel linear with :class:`LoRALinear`."""
    from toolkit_megatron.architectures import architecture_for
    from toolkit_megatron.bridge import Geometry

    arch = architecture_for(hf_config.model_type)
    geo = Geometry.here(hf_config, padded_vocab)
    for model in models:
        for param in model.parameters():
            param.requires_grad_(False)
        for layer in model.decoder.layers:
            for path, (kind, parts) in _layer_adapters(layer, adapters, arch, hf_config, geo).items():
                owner_path, name = path.rsplit(".", 1)
                owner = _submodule(layer, owner_path)
                if kind == "gate":
                    (hf_path, tensors), = parts.items()
                    if dropout:
                        raise ConfigError(f"LoRA on the gate {hf_path} with dropout {dropout}: a gate's adapter is "
                                          "merged into its weight (PEFT's router adapter takes no dropout either); use "
                                          "--lora-dropout 0, or drop it from --lora-target-modules")
                    adapt_gate(owner, name, tensors, hf_path)
                    continue
                setattr(owner, name, LoRALinear(getattr(owner, name), kind, parts, geo, dropout))


def export_merged(chunks: list[Any], hf_config: Any) -> Any:
    """HF tensors of ``chunks`` with every LoRA adapter merged into its base weight (rank 0 yields)."""
    from toolkit_megatron.bridge import export_hf_tensors

    for chunk in chunks:
        chunk.toolkit_merged = {f"{path}.base.weight": module.merged_weight()
                                for path, module in chunk.named_modules() if isinstance(module, LoRALinear)}
        chunk.toolkit_merged.update(merged_gates(chunk))
    try:
        yield from export_hf_tensors(chunks, hf_config)
    finally:
        for chunk in chunks:
            chunk.toolkit_merged = {}


def adapter_state(chunks: list[Any], value: Any = None) -> dict[str, torch.Tensor]:
    """The adapters of ``chunks`` under the tuner's names and in its layout (the inverse of the split; routed
    experts fused again), on global rank 0 (``{}`` elsewhere; every rank must call it). ``value(param)``: what to
    read of each adapter parameter (default: the parameter itself; a test reads ``.grad``)."""
    from megatron.core import parallel_state as ps

    value = value or (lambda param: param)
    dense_owner = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    expert_owner = ps.get_expert_data_parallel_rank() == 0
    pieces = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LoRALinear):
                for part in module.order:
                    names, expert = module.sources[part]
                    for which, tensor in module.full_part(part, value).items():
                        if (expert_owner if expert else dense_owner) and module.rank == 0 and which in names:
                            pieces.append((names[which], which, expert, tensor.detach().float().cpu()))
        if dense_owner and ps.get_tensor_model_parallel_rank() == 0:
            for _, module in gates(chunk):
                for which, tensor in module.adapter.full_part(value).items():
                    pieces.append((module.adapter.sources[which], which, None, tensor.float().cpu()))
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, pieces)  # adapters are small
    if torch.distributed.get_rank() != 0:
        return {}
    state: dict[str, torch.Tensor] = {}
    for name, which, expert, tensor in (piece for rank_pieces in everyone for piece in rank_pieces):
        if expert is None:
            state[name] = tensor
            continue
        index, experts = expert  # PEFT's fused layout: A rows expert-major, B columns rank-major
        if which == "A":
            fused = state.setdefault(name, tensor.new_zeros(experts * tensor.shape[0], tensor.shape[1]))
            fused[index * tensor.shape[0]:(index + 1) * tensor.shape[0]] = tensor
        else:
            fused = state.setdefault(name, tensor.new_zeros(tensor.shape[0], tensor.shape[1] * experts))
            fused.view(tensor.shape[0], tensor.shape[1], experts)[:, :, index] = tensor
    return state
