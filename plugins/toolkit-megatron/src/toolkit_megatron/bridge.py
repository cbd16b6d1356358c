"""HF <-> Megatron-Core weight bridge: per-rank streaming load, TP/PP gather back to HF names.

Each Megatron parameter is described once, in the tables :data:`TOP_LEVEL` and :data:`PER_LAYER`
(a :class:`Mapping`: the HF tensors it is made of and how tensor parallelism splits it); both
directions read them: :func:`read_local` (HF -> this rank's shard), :func:`gather_full` /
:func:`join_shards` (shards -> Megatron's full tensor) and :func:`hf_from_full` (-> HF tensors).
Loading: each rank opens the checkpoint's safetensors lazily (``safe_open``) and reads only the
rows/columns its shards need. Layouts (Megatron-Core's): ``linear_qkv`` interleaves, per query
group, that group's query heads then its key head then its value head; ``linear_fc1`` holds
``[gate_shard; up_shard]``; embeddings and the output layer are padded to a multiple of TP.
Gathering inverts each step exactly, so HF -> mcore -> HF is bit-exact. The conversions read the split (sizes
and this rank's place on the TP, EP and expert-TP axes) from a :class:`Geometry`; only the entry points read
megatron-core's process groups.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolkit.errors import ModelError
from toolkit.parallel import ParallelLayout
from toolkit_megatron.architectures import DenseArchitecture, architecture_for


@dataclass
class Geometry:
    """Shapes, and where this rank sits on the axes that split weights (tensor, expert, expert-tensor parallel):
    the conversion functions read the split from here, never from megatron-core's global state."""

    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int
    tp: int
    tp_rank: int
    experts: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int | None = None
    """Expert tensor-parallel size; ``None``: ``tp``."""
    etp_rank: int = 0

    @classmethod
    def of(cls, hf_config: Any, padded_vocab: int, layout: ParallelLayout, ranks: dict[str, int] | None = None) -> Geometry:
        """The geometry of ``hf_config`` split by ``layout`` at ``ranks`` (this rank's index on the ``tp``, ``ep`` and
        ``etp`` axes; 0 where absent)."""
        arch = architecture_for(hf_config.model_type)
        ranks = ranks or {}
        return cls(hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                   arch.head_dim(hf_config), hf_config.intermediate_size, hf_config.vocab_size, padded_vocab,
                   layout.tensor, ranks.get("tp", 0), arch.num_experts(hf_config) if getattr(arch, "moe", False) else 0,
                   layout.expert, ranks.get("ep", 0), layout.expert_tensor or layout.tensor, ranks.get("etp", 0))

    @classmethod
    def here(cls, hf_config: Any, padded_vocab: int) -> Geometry:
        """This process's geometry: the sizes and ranks of megatron-core's initialised groups, read once by the
        bridge's entry points (which load, gather and export this rank's shards)."""
        from megatron.core import parallel_state as ps

        layout = ParallelLayout(tensor=ps.get_tensor_model_parallel_world_size(), expert=ps.get_expert_model_parallel_world_size(),
                                expert_tensor=ps.get_expert_tensor_parallel_world_size())
        return cls.of(hf_config, padded_vocab, layout, {"tp": ps.get_tensor_model_parallel_rank(),
                                                        "ep": ps.get_expert_model_parallel_rank(),
                                                        "etp": ps.get_expert_tensor_parallel_rank()})

    def rows(self, total: int) -> tuple[int, int]:
        size = total // self.tp
        return self.tp_rank * size, (self.tp_rank + 1) * size


class SafetensorsReader:
    """Lazy access to a (sharded) safetensors checkpoint: slices are read on demand."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    @classmethod
    def from_directory(cls, directory: Path) -> SafetensorsReader:
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelError(f"{directory} holds no *.safetensors weights; the Megatron bridge reads safetensors only")
        return cls(files)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def slice(self, name: str) -> Any:
        if name not in self._where:
            raise ModelError(f"weight {name!r} is missing from the checkpoint")
        return self._where[name].get_slice(name)

    def full(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)


def _vocab_rows(reader: SafetensorsReader, name: str, geo: Geometry) -> torch.Tensor:
    start, stop = geo.rows(geo.padded_vocab)
    part = reader.slice(name)[start:min(stop, geo.vocab)] if start < geo.vocab else None
    hidden = reader.slice(name).get_shape()[1]
    out = torch.zeros(stop - start, hidden, dtype=part.dtype if part is not None else torch.float32)
    if part is not None:
        out[: part.shape[0]] = part
    return out


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter and the HF tensors it is made of, described once for both directions.

    ``parts``: keys of the architecture's name table ``table`` (``top``: its ``embedding``/``lm_head``/
    ``final_norm`` attributes; ``layer``, ``shared``, ``expert``: its dicts; ``router``: its template);
    ``suffix`` is appended to each name (the fused QKV's ``.weight``/``.bias``). ``split`` says how the HF
    tensors become Megatron's and how tensor parallelism cuts it, each with its inverse:

    - ``none``: the one HF tensor, replicated;
    - ``vocab``: rows split over TP, padded to Megatron's vocabulary (the padding dropped on the way back);
    - ``qkv``: per query group, the group's query heads, then its key head, then its value head; groups split;
    - ``gate_up``: ``[gate rows; up rows]`` of this rank's slice of both (back: the two halves, stacked);
    - ``row``: input columns split (a row-parallel linear);
    - ``column``: output rows split evenly (a column-parallel linear of one HF tensor, e.g. MLA's projections).

    Experts split over the expert-tensor-parallel group, everything else over TP.
    """

    parts: tuple[str, ...]
    split: str = "none"
    table: str = "layer"
    suffix: str = ""


TOP_LEVEL: dict[str, Mapping] = {
    "embedding.word_embeddings.weight": Mapping(("embedding",), "vocab", "top"),
    "output_layer.weight": Mapping(("lm_head",), "vocab", "top"),  # tied or absent: the embedding
    "decoder.final_layernorm.weight": Mapping(("final_norm",), "none", "top"),
}
PER_LAYER: dict[str, Mapping] = {
    "self_attention.linear_qkv.weight": Mapping(("q", "k", "v"), "qkv", suffix=".weight"),
    "self_attention.linear_qkv.bias": Mapping(("q", "k", "v"), "qkv", suffix=".bias"),
    "self_attention.linear_proj.weight": Mapping(("o",), "row"),
    "self_attention.q_layernorm.weight": Mapping(("q_norm",)),
    "self_attention.k_layernorm.weight": Mapping(("k_norm",)),
    "input_layernorm.weight": Mapping(("input_norm",)),
    "pre_mlp_layernorm.weight": Mapping(("post_norm",)),
    "self_attn_bda.weight": Mapping(("post_attn_out_norm",)),  # GLM-4's norms on the sublayer outputs
    "mlp_bda.weight": Mapping(("post_mlp_out_norm",)),
    "mlp.linear_fc1.weight": Mapping(("gate", "up"), "gate_up"),
    "mlp.linear_fc2.weight": Mapping(("down",), "row"),
    "self_attention.linear_q_proj.weight": Mapping(("q_proj",), "column"),
    "self_attention.linear_q_down_proj.weight": Mapping(("q_a",), "column"),
    "self_attention.linear_q_up_proj.weight": Mapping(("q_b",), "column"),
    "self_attention.linear_kv_down_proj.weight": Mapping(("kv_a",), "column"),
    "self_attention.linear_kv_up_proj.weight": Mapping(("kv_b",), "column"),
    "self_attention.kv_layernorm.weight": Mapping(("kv_norm",)),
    "mlp.router.weight": Mapping(("router",), "none", "router"),
    "mlp.router.expert_bias": Mapping(("router_bias",), "none", "router"),
    "mlp.shared_experts.gate_weight": Mapping(("gate_weight",), "none", "shared"),
    "mlp.shared_experts.linear_fc1.weight": Mapping(("gate", "up"), "gate_up", "shared"),
    "mlp.shared_experts.linear_fc2.weight": Mapping(("down",), "row", "shared"),
    "mlp.experts.local_experts.{e}.linear_fc1.weight": Mapping(("gate", "up"), "gate_up", "expert"),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": Mapping(("down",), "row", "expert"),
}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")


def mapping_of(mcore_name: str, layer: int | None) -> tuple[Mapping, str, int | None] | None:
    """The mapping of a Megatron parameter name, its leaf (the name within its layer) and, for an expert, its
    local index (``None``: the bridge does not know the parameter)."""
    if layer is None:
        found = TOP_LEVEL.get(mcore_name)
        return (found, mcore_name, None) if found is not None else None
    leaf = mcore_name.split(".layers.", 1)[-1].split(".", 1)[-1]
    expert = _EXPERT.match(leaf)
    key = _EXPERT.sub("mlp.experts.local_experts.{e}.", leaf) if expert else leaf
    found = PER_LAYER.get(key)
    return (found, leaf, int(expert.group(1)) if expert else None) if found is not None else None


def hf_names(arch: type[DenseArchitecture], mapping: Mapping, layer: int | None, expert: int | None = None,
             geo: Geometry | None = None) -> list[str]:
    """The HF tensor names of ``mapping`` at ``layer`` (``expert``: the local expert index on the rank ``geo``
    places on the expert-parallel axis)."""
    if mapping.table == "top":
        return [getattr(arch, part) for part in mapping.parts]
    if mapping.table == "router":
        return [getattr(arch, part).format(i=layer) for part in mapping.parts]
    index = None
    if expert is not None:
        index = geo.ep_rank * (geo.experts // geo.ep) + expert
    names = getattr(arch, mapping.table)
    return [names[part].format(i=layer, e=index) + mapping.suffix for part in mapping.parts]


def _split_group(mapping: Mapping, geo: Geometry) -> tuple[int, int]:
    """(size, rank) of the group that splits ``mapping``'s parameter."""
    if mapping.table == "expert":
        return geo.etp or geo.tp, geo.etp_rank
    return geo.tp, geo.tp_rank


def _part(total: int, size: int, rank: int) -> tuple[int, int]:
    return rank * total // size, (rank + 1) * total // size


def fused(names: list[str]) -> bool:
    """Several parts stored in one HF tensor, stacked in order (Phi-3's ``qkv_proj``, ``gate_up_proj``)."""
    return len(names) > 1 and len(set(names)) == 1


def read_local(reader: SafetensorsReader, mapping: Mapping, names: list[str], geo: Geometry) -> torch.Tensor:
    """This rank's shard of the Megatron parameter, read from the HF checkpoint (HF -> Megatron)."""
    size, rank = _split_group(mapping, geo)
    if mapping.split == "none":
        return reader.full(names[0])
    if mapping.split == "vocab":
        return _vocab_rows(reader, names[0], geo)
    if mapping.split == "qkv":
        q_name, k_name, v_name = names
        per_group = geo.heads // geo.groups
        groups = geo.groups // size
        g0 = rank * groups
        # fused (Phi-3's qkv_proj): one tensor of all query rows, then all key rows, then all value rows
        k_at, v_at = (geo.heads * geo.head_dim, (geo.heads + geo.groups) * geo.head_dim) if fused(names) else (0, 0)
        q = reader.slice(q_name)[g0 * per_group * geo.head_dim:(g0 + groups) * per_group * geo.head_dim]
        k = reader.slice(k_name)[k_at + g0 * geo.head_dim:k_at + (g0 + groups) * geo.head_dim]
        v = reader.slice(v_name)[v_at + g0 * geo.head_dim:v_at + (g0 + groups) * geo.head_dim]
        tail = q.shape[1:]
        q = q.reshape(groups, per_group * geo.head_dim, *tail)
        k = k.reshape(groups, geo.head_dim, *tail)
        v = v.reshape(groups, geo.head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)
    if mapping.split == "gate_up":
        gate, up = names
        rows = reader.slice(gate).get_shape()[0] // (2 if fused(names) else 1)  # fused gate_up_proj: [gate; up]
        up_at = rows if fused(names) else 0
        start, stop = _part(rows, size, rank)
        return torch.cat([reader.slice(gate)[start:stop], reader.slice(up)[up_at + start:up_at + stop]])
    if mapping.split == "row":
        start, stop = _part(reader.slice(names[0]).get_shape()[1], size, rank)
        return reader.slice(names[0])[:, start:stop]
    if mapping.split == "column":
        start, stop = _part(reader.slice(names[0]).get_shape()[0], size, rank)
        return reader.slice(names[0])[start:stop]
    raise ValueError(f"unknown split {mapping.split!r}")


def hf_from_full(mapping: Mapping, names: list[str], full: torch.Tensor, geo: Geometry) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one TP-gathered Megatron parameter (Megatron -> HF: the inverse of :func:`read_local`)."""
    if mapping.split == "vocab":
        return [(names[0], full[: geo.vocab])]
    if mapping.split == "qkv":
        per_group = geo.heads // geo.groups
        tail = full.shape[1:]
        grouped = full.reshape(geo.groups, per_group + 2, geo.head_dim, *tail)
        q = grouped[:, :per_group].reshape(-1, *tail)
        k = grouped[:, per_group].reshape(-1, *tail)
        v = grouped[:, per_group + 1].reshape(-1, *tail)
        parts = (q, k, v)
    elif mapping.split == "gate_up":
        parts = (full[0], full[1])
    else:
        return [(names[0], full)]
    if fused(names):
        return [(names[0], torch.cat(parts))]
    return list(zip(names, parts, strict=True))


def gather_full(mapping: Mapping, local: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Concatenate the shards of one parameter over the group that split it into Megatron's full tensor
    (for ``gate_up``: the gate and up halves stacked, as :func:`hf_from_full` takes them)."""
    from megatron.core import parallel_state as ps

    size, _ = _split_group(mapping, geo)
    if size == 1 or mapping.split == "none":
        return join_shards(mapping, [local])
    group = ps.get_expert_tensor_parallel_group() if mapping.table == "expert" else ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(size)]
    torch.distributed.all_gather(shards, local.contiguous(), group=group)
    return join_shards(mapping, shards)


def join_shards(mapping: Mapping, shards: list[torch.Tensor]) -> torch.Tensor:
    """Megatron's full tensor from the shards of every rank of the splitting group, in rank order."""
    if mapping.split == "none":
        return shards[0]
    if mapping.split == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.stack([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=1 if mapping.split == "row" else 0)


def _lookup(arch: type[DenseArchitecture], name: str, layer: int | None, geo: Geometry) -> tuple[Mapping, list[str]]:
    found = mapping_of(name, layer)
    if found is None:
        raise ModelError(f"the Megatron bridge does not know where parameter {name!r} comes from in HF weights")
    mapping, _, expert = found
    return mapping, hf_names(arch, mapping, layer, expert, geo)


def _layer_of(model: Any, name: str) -> int | None:
    if not name.startswith("decoder.layers."):
        return None
    local = int(name.split(".")[2])
    return model.decoder.layers[local].layer_number - 1


def load_hf_weights(models: list[Any], hf_config: Any, reader: SafetensorsReader) -> None:
    """Fill every parameter of this rank's model chunks from an HF checkpoint, reading only its slices."""
    arch = architecture_for(hf_config.model_type)
    geo = Geometry.here(hf_config, _padded_vocab(models))
    with torch.no_grad():
        for model in models:
            for name, param in _named_params(model):
                mapping, names = _lookup(arch, name, _layer_of(model, name), geo)
                if name == "output_layer.weight" and names[0] not in reader:
                    names = [arch.embedding]  # tied: the head is the embedding
                value = read_local(reader, mapping, names, geo)
                if tuple(value.shape) != tuple(param.shape):
                    raise ModelError(f"shape mismatch for {name}: HF slice {tuple(value.shape)} vs Megatron {tuple(param.shape)}")
                param.copy_(value.to(param.dtype))


def _named_params(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters by Megatron name, unwrapped from DDP/Float16Module, including frozen ones, and the routers'
    expert biases (buffers that HF checkpoints hold, DeepSeek-V3's ``e_score_correction_bias``)."""
    inner = unwrap(model)
    merged = getattr(inner, "toolkit_merged", {})
    for name, param in inner.named_parameters():
        if ".lora_" in name:
            continue
        yield name.replace(".base.", "."), merged.get(name, param)
    for name, buffer in inner.named_buffers():
        if name.endswith(".router.expert_bias"):
            yield name, buffer


def unwrap(model: Any) -> Any:
    """The GPTModel under Megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _padded_vocab(models: list[Any]) -> int:
    for model in models:
        inner = unwrap(model)
        return inner.vocab_size
    raise ModelError("no model chunks")


# ----------------------------------------------------------------------------- gather


def _is_expert(name: str) -> bool:
    return ".experts.local_experts." in name


def export_hf_tensors(models: list[Any], hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors of the whole model, yielded on global rank 0 (every rank must iterate).

    Each pipeline stage's first replica (data- and context-parallel rank 0) gathers its
    tensor-parallel shards and sends the converted tensors to rank 0 one at a time, so no rank
    ever holds more than one full tensor beyond its own shards.
    """
    from megatron.core import parallel_state as ps

    arch = architecture_for(hf_config.model_type)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    geo = Geometry.here(hf_config, _padded_vocab(models))
    rank = torch.distributed.get_rank()
    replica = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    expert_replica = ps.get_expert_data_parallel_rank() == 0

    def gathers(name: str) -> bool:  # this rank takes part in the (expert-)TP gather of ``name``
        return expert_replica if _is_expert(name) else replica

    def owns(name: str) -> bool:  # ... and sends the result to rank 0
        tp_rank = geo.etp_rank if _is_expert(name) else geo.tp_rank
        return gathers(name) and tp_rank == 0

    plan = []  # (mcore name, mapping, HF names) in this stage's order; a tied head is left out
    for model in models:
        inner = unwrap(model)
        for name, _ in _named_params(model):
            mapping, names = _lookup(arch, name, _layer_of(inner, name), geo)
            plan.append((name, mapping, [] if tied and name == "output_layer.weight" else names))
    local_entries = [hf_name for name, _, names in plan if owns(name) for hf_name in dict.fromkeys(names)]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (rank, local_entries))
    order = [(r, hf) for r, entries in everyone for hf in entries]
    params = dict((n, p) for model in models for n, p in _named_params(model))
    with torch.no_grad():
        for name, mapping, names in plan:
            if gathers(name):
                full = gather_full(mapping, params[name].detach(), geo)
                if owns(name) and names:
                    for hf_name, tensor in hf_from_full(mapping, names, full, geo):
                        tensor = tensor.contiguous()
                        if rank == 0:
                            yield hf_name, tensor.cpu()
                        else:
                            meta = torch.tensor(list(tensor.shape) + [-1] * (4 - tensor.dim()), dtype=torch.long, device=tensor.device)
                            torch.distributed.send(meta, dst=0)
                            torch.distributed.send(tensor, dst=0)
        if rank == 0:
            first = next(iter(params.values()))
            dtype, device = first.dtype, first.device
            for source, hf_name in order:
                if source == 0:
                    continue
                meta = torch.empty(4, dtype=torch.long, device=device)
                torch.distributed.recv(meta, src=source)
                tensor = torch.empty([int(d) for d in meta.tolist() if d >= 0], dtype=dtype, device=device)
                torch.distributed.recv(tensor, src=source)
                yield hf_name, tensor.cpu()
