"""HF <-> Megatron-Core weight bridge: per-rank streaming load, TP/PP gather back to HF names.

Loading: each rank opens the checkpoint's safetensors lazily (``safe_open``) and reads only the
rows/columns its shards need. Layouts (Megatron-Core's): ``linear_qkv`` interleaves, per query
group, that group's query heads then its key head then its value head; ``linear_fc1`` holds
``[gate_shard; up_shard]``; embeddings and the output layer are padded to a multiple of TP.
Gathering inverts each step exactly, so HF -> mcore -> HF is bit-exact.
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
from toolkit_megatron.architectures import DenseArchitecture, architecture_for


@dataclass
class Geometry:
    """Shapes and this rank's tensor-parallel slice."""

    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int
    tp: int
    tp_rank: int
    experts: int = 0

    @classmethod
    def of(cls, hf_config: Any, padded_vocab: int, tp: int, tp_rank: int) -> Geometry:
        arch = architecture_for(hf_config.model_type)
        return cls(hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                   arch.head_dim(hf_config), hf_config.intermediate_size, hf_config.vocab_size, padded_vocab, tp, tp_rank,
                   arch.num_experts(hf_config) if getattr(arch, "moe", False) else 0)

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


def _qkv(reader: SafetensorsReader, names: dict[str, str], geo: Geometry, suffix: str) -> torch.Tensor:
    per_group = geo.heads // geo.groups
    groups = geo.groups // geo.tp
    g0 = geo.tp_rank * groups
    q = reader.slice(names["q"] + suffix)[g0 * per_group * geo.head_dim:(g0 + groups) * per_group * geo.head_dim]
    k = reader.slice(names["k"] + suffix)[g0 * geo.head_dim:(g0 + groups) * geo.head_dim]
    v = reader.slice(names["v"] + suffix)[g0 * geo.head_dim:(g0 + groups) * geo.head_dim]
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * geo.head_dim, *tail)
    k = k.reshape(groups, geo.head_dim, *tail)
    v = v.reshape(groups, geo.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def local_tensor(reader: SafetensorsReader, arch: type[DenseArchitecture], mcore_name: str, layer: int | None, geo: Geometry) -> torch.Tensor | None:
    """This rank's shard of one Megatron parameter, read from the HF checkpoint (``None``: not from HF)."""
    names = {k: v.format(i=layer) for k, v in arch.layer.items()} if layer is not None else {}
    leaf = mcore_name.split(".layers.", 1)[-1].split(".", 1)[-1] if layer is not None else mcore_name
    if mcore_name == "embedding.word_embeddings.weight":
        return _vocab_rows(reader, arch.embedding, geo)
    if mcore_name == "output_layer.weight":
        name = arch.lm_head if arch.lm_head in reader else arch.embedding
        return _vocab_rows(reader, name, geo)
    if mcore_name == "decoder.final_layernorm.weight":
        return reader.full(arch.final_norm)
    if leaf == "self_attention.linear_qkv.weight":
        return _qkv(reader, names, geo, ".weight")
    if leaf == "self_attention.linear_qkv.bias":
        return _qkv(reader, names, geo, ".bias")
    if leaf == "self_attention.linear_proj.weight":
        start, stop = geo.rows(geo.heads * geo.head_dim)
        return reader.slice(names["o"])[:, start:stop]
    if leaf == "mlp.linear_fc1.weight":
        start, stop = geo.rows(geo.ffn)
        return torch.cat([reader.slice(names["gate"])[start:stop], reader.slice(names["up"])[start:stop]])
    if leaf == "mlp.linear_fc2.weight":
        start, stop = geo.rows(geo.ffn)
        return reader.slice(names["down"])[:, start:stop]
    if leaf == "mlp.router.weight":
        return reader.full(arch.router.format(i=layer))
    if leaf.startswith("mlp.shared_experts."):
        shared = {k: v.format(i=layer) for k, v in arch.shared.items()}
        if leaf.endswith("gate_weight"):
            return reader.full(shared["gate_weight"])
        start, stop = geo.rows(reader.slice(shared["down"]).get_shape()[1])
        if leaf.endswith("linear_fc1.weight"):
            return torch.cat([reader.slice(shared["gate"])[start:stop], reader.slice(shared["up"])[start:stop]])
        return reader.slice(shared["down"])[:, start:stop]
    expert = _EXPERT.match(leaf)
    if expert is not None:
        from megatron.core import parallel_state as ps

        local = int(expert.group(1))
        index = ps.get_expert_model_parallel_rank() * (geo.experts // ps.get_expert_model_parallel_world_size()) + local
        names = {k: v.format(i=layer, e=index) for k, v in arch.expert.items()}
        etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        ffn = reader.slice(names["down"]).get_shape()[1]
        start, stop = etp_rank * ffn // etp, (etp_rank + 1) * ffn // etp
        if expert.group(2) == "linear_fc1":
            return torch.cat([reader.slice(names["gate"])[start:stop], reader.slice(names["up"])[start:stop]])
        return reader.slice(names["down"])[:, start:stop]
    simple = {"input_layernorm.weight": "input_norm", "pre_mlp_layernorm.weight": "post_norm",
              "self_attention.q_layernorm.weight": "q_norm", "self_attention.k_layernorm.weight": "k_norm"}
    if leaf in simple:
        return reader.full(names[simple[leaf]])
    return None


_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def _layer_of(model: Any, name: str) -> int | None:
    if not name.startswith("decoder.layers."):
        return None
    local = int(name.split(".")[2])
    return model.decoder.layers[local].layer_number - 1


def load_hf_weights(models: list[Any], hf_config: Any, reader: SafetensorsReader) -> None:
    """Fill every parameter of this rank's model chunks from an HF checkpoint, reading only its slices."""
    from megatron.core import parallel_state

    arch = architecture_for(hf_config.model_type)
    geo = Geometry.of(hf_config, _padded_vocab(models), parallel_state.get_tensor_model_parallel_world_size(),
                      parallel_state.get_tensor_model_parallel_rank())
    with torch.no_grad():
        for model in models:
            for name, param in _named_params(model):
                value = local_tensor(reader, arch, name, _layer_of(model, name), geo)
                if value is None:
                    raise ModelError(f"the Megatron bridge does not know where parameter {name!r} comes from in HF weights")
                if tuple(value.shape) != tuple(param.shape):
                    raise ModelError(f"shape mismatch for {name}: HF slice {tuple(value.shape)} vs Megatron {tuple(param.shape)}")
                param.copy_(value.to(param.dtype))


def _named_params(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters by Megatron name, unwrapped from DDP/Float16Module, including frozen ones."""
    inner = unwrap(model)
    merged = getattr(inner, "toolkit_merged", {})
    for name, param in inner.named_parameters():
        if ".lora_" in name:
            continue
        yield name.replace(".base.", "."), merged.get(name, param)


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


def hf_pieces(arch: type[DenseArchitecture], mcore_name: str, layer: int | None, full: torch.Tensor, geo: Geometry,
              tied: bool) -> list[tuple[str, torch.Tensor]]:
    """HF tensors made from one TP-gathered Megatron parameter (inverse of :func:`local_tensor`)."""
    names = {k: v.format(i=layer) for k, v in arch.layer.items()} if layer is not None else {}
    leaf = mcore_name.split(".layers.", 1)[-1].split(".", 1)[-1] if layer is not None else mcore_name
    if mcore_name == "embedding.word_embeddings.weight":
        return [(arch.embedding, full[: geo.vocab])]
    if mcore_name == "output_layer.weight":
        return [] if tied else [(arch.lm_head, full[: geo.vocab])]
    if mcore_name == "decoder.final_layernorm.weight":
        return [(arch.final_norm, full)]
    if leaf.startswith("self_attention.linear_qkv."):
        suffix = "." + leaf.rsplit(".", 1)[1]
        per_group = geo.heads // geo.groups
        tail = full.shape[1:]
        grouped = full.reshape(geo.groups, per_group + 2, geo.head_dim, *tail)
        q = grouped[:, :per_group].reshape(-1, *tail)
        k = grouped[:, per_group].reshape(-1, *tail)
        v = grouped[:, per_group + 1].reshape(-1, *tail)
        return [(names["q"] + suffix, q), (names["k"] + suffix, k), (names["v"] + suffix, v)]
    if leaf == "mlp.router.weight":
        return [(arch.router.format(i=layer), full)]
    if leaf.startswith("mlp.shared_experts."):
        shared = {k: v.format(i=layer) for k, v in arch.shared.items()}
        if leaf.endswith("gate_weight"):
            return [(shared["gate_weight"], full)]
        if leaf.endswith("linear_fc1.weight"):
            return [(shared["gate"], full[0]), (shared["up"], full[1])]
        return [(shared["down"], full)]
    expert = _EXPERT.match(leaf)
    if expert is not None:
        from megatron.core import parallel_state as ps

        index = ps.get_expert_model_parallel_rank() * (geo.experts // ps.get_expert_model_parallel_world_size()) + int(expert.group(1))
        names = {k: v.format(i=layer, e=index) for k, v in arch.expert.items()}
        if expert.group(2) == "linear_fc1":
            return [(names["gate"], full[0]), (names["up"], full[1])]
        return [(names["down"], full)]
    if leaf == "self_attention.linear_proj.weight":
        return [(names["o"], full)]
    if leaf == "mlp.linear_fc1.weight":
        return [(names["gate"], full[0]), (names["up"], full[1])]
    if leaf == "mlp.linear_fc2.weight":
        return [(names["down"], full)]
    simple = {"input_layernorm.weight": "input_norm", "pre_mlp_layernorm.weight": "post_norm",
              "self_attention.q_layernorm.weight": "q_norm", "self_attention.k_layernorm.weight": "k_norm"}
    return [(names[simple[leaf]], full)]


def _gather_tp(name: str, local: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """Concatenate the tensor-parallel shards of one parameter into Megatron's full tensor.

    Experts are split over the expert-tensor-parallel group, everything else over TP.
    """
    from megatron.core import parallel_state as ps

    if _is_expert(name):
        size, group = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group()
    else:
        size, group = geo.tp, ps.get_tensor_model_parallel_group()
    column = name.endswith(("linear_proj.weight", "linear_fc2.weight"))
    split = name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight",
                           "output_layer.weight")) or column
    if size == 1 or not split:
        shards = [local]
    else:
        shards = [torch.empty_like(local) for _ in range(size)]
        torch.distributed.all_gather(shards, local.contiguous(), group=group)
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.stack([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=1 if column else 0)


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
    geo = Geometry.of(hf_config, _padded_vocab(models), ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
    rank = torch.distributed.get_rank()
    replica = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    expert_replica = ps.get_expert_data_parallel_rank() == 0

    def gathers(name: str) -> bool:  # this rank takes part in the (expert-)TP gather of ``name``
        return expert_replica if _is_expert(name) else replica

    def owns(name: str) -> bool:  # ... and sends the result to rank 0
        tp_rank = ps.get_expert_tensor_parallel_rank() if _is_expert(name) else geo.tp_rank
        return gathers(name) and tp_rank == 0

    plan = []  # (mcore name, layer) in this stage's order
    for model in models:
        inner = unwrap(model)
        for name, _ in _named_params(model):
            plan.append((name, _layer_of(inner, name)))
    local_entries = [hf_name for name, layer in plan if owns(name)
                     for hf_name, _ in hf_pieces(arch, name, layer, torch.zeros(_fake_shape(name, geo)), geo, tied)]
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, (rank, local_entries))
    order = [(r, hf) for r, entries in everyone for hf in entries]
    params = dict((n, p) for model in models for n, p in _named_params(model))
    with torch.no_grad():
        for name, layer in plan:
            if gathers(name):
                full = _gather_tp(name, params[name].detach(), geo)
                if owns(name):
                    for hf_name, tensor in hf_pieces(arch, name, layer, full, geo, tied):
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


def _fake_shape(name: str, geo: Geometry) -> tuple[int, ...]:
    """A tensor shape good enough for :func:`hf_pieces` to list names (values unused)."""
    if name.endswith("linear_qkv.weight"):
        return (geo.groups * (geo.heads // geo.groups + 2) * geo.head_dim, 1)
    if name.endswith("linear_qkv.bias"):
        return (geo.groups * (geo.heads // geo.groups + 2) * geo.head_dim,)
    if name.endswith("linear_fc1.weight"):
        return (2, 1, 1)
    return (1,)
