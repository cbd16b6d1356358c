"""Measure what autograd keeps for the backward pass, to check the planner's activation model.

Used by tests/test_plan_measure.py and bench/plan_check.py. torch is imported inside functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def saved_activation_bytes(model: Any, forward: Callable[[], Any], vocab: int) -> int:
    """Bytes of distinct storages saved for backward while ``forward()`` runs (it returns the loss).

    Parameters, their bf16 autocast copies (the planner counts them as weight copies) and
    vocabulary-sized loss tensors (counted as logits) are left out.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    copies: set[int] = set()

    class WeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor)
                    and args[0].untyped_storage().data_ptr() in params):
                copies.add(out.untyped_storage().data_ptr())
            return out

    seen: dict[int, int] = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in params and pointer not in copies and tensor.dim() and tensor.shape[-1] != vocab:
            seen.setdefault(pointer, tensor.untyped_storage().nbytes())
        return tensor

    with WeightCasts(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    del loss
    return sum(seen.values())


def cpu_peak_bytes(step: Callable[[], Any], baseline: int) -> int:
    """Peak bytes held by the CPU allocator while ``step()`` runs: ``baseline`` (what was allocated
    before, e.g. weights and optimizer states) plus the highest running sum of the allocations and
    frees the profiler records. Lets the memory model be checked on machines without CUDA."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocations: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    current = peak = 0
    for _, size in sorted(allocations):
        current += size
        peak = max(peak, current)
    return baseline + peak


def local_engine(config: dict, directory: Any, *, tuner: str = "full", seq_len: int, micro_batch_size: int = 1,
                 recompute: bool = False, precision: str = "bf16", bf16_mode: str = "master",
                 lora_rank: int = 16, chunk_tokens: int = 2048, recompute_logits: bool = False,
                 micro_batches: int = 1, fused_loss: bool = False, kernels: str = "none",
                 extra: dict | None = None) -> tuple[Any, Any, Callable[[], Any]]:
    """The ``local`` engine on a randomly initialised HF model of ``config`` (saved to ``directory``)
    with the registered tuner and the ``sft`` loss, as ``toolkit train`` builds it. ``fused_loss`` and
    ``kernels`` are explicit (not the engine's ``auto``) so a run measures what its Workload says.
    ``extra``: more recipe values, e.g. ``{"expert_parallel": 2, "moe": {"enabled": True}}`` for toolkit-moe's
    expert parallelism (under ``torch.distributed``; the model directory must then exist beforehand).

    Returns ``(engine, loss_fn, step)``: ``loss_fn()`` runs one forward and returns the loss of one
    micro-batch of random tokens, ``step()`` runs one optimizer step of ``micro_batches`` such
    micro-batches through ``engine.train_step``."""
    from pathlib import Path

    import torch
    import transformers

    from toolkit.contracts import ModelSource, StepContext, member
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import resolve_recipe

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**config), dtype=torch.bfloat16)
        model.save_pretrained(directory)
        del model
    values = {"model": str(directory), "tuner": tuner, "loss": "sft", "precision": precision, "seq_len": seq_len,
              "micro_batch_size": micro_batch_size, "lr": 1e-5, "max_grad_norm": 1.0, "gradient_checkpointing": recompute,
              "local": {"bf16_mode": bf16_mode, "logps_chunk_tokens": chunk_tokens,
                        "recompute_logits": recompute_logits, "fused_loss": fused_loss, "kernels": kernels}}
    if tuner != "full":
        values[tuner] = {"rank": lora_rank, "alpha": 2.0 * lora_rank}
    recipe = resolve_recipe({**values, **(extra or {})}, source="plan-measure")
    manager = get_plugin_manager()
    source = ModelSource(reference=str(directory), directory=directory,
                         config=transformers.AutoConfig.from_pretrained(directory), tokenizer=None,
                         weight_files=sorted(directory.glob("*.safetensors")))
    tuner_cls, loss_cls, strategy_cls = (manager.get(kind, name) for kind, name in
                                         (("tuner", tuner), ("loss", "sft"), ("strategy", "local")))
    tuner_obj = tuner_cls(tuner_cls.Config(**recipe.section(tuner)))
    loss = loss_cls()
    engine = strategy_cls(strategy_cls.Config(**recipe.section("local"))).build(source, tuner_obj, loss, recipe)
    engine.set_total_steps(1000)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config["vocab_size"], (micro_batch_size, seq_len + 1), generator=generator)
    rows = micro_batch_size
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(seq_len).expand(rows, -1).contiguous(),
             "sequence_ids": torch.arange(rows)[:, None].expand(-1, seq_len).contiguous(),
             "sequence_meta": {"example_ids": torch.arange(rows), "roles": torch.zeros(rows, dtype=torch.long)},
             "num_sequences": rows}
    device = member(engine, "engine", "device")
    batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    ctx = StepContext(label_tokens=rows * seq_len * micro_batches, sequences=rows * micro_batches,
                      examples=rows * micro_batches)

    forward_loss = _measured(engine, "forward_loss")

    def loss_fn() -> Any:
        return forward_loss(batch, loss, ctx).loss

    def step() -> float:
        return engine.train_step([batch] * micro_batches, loss, ctx).loss

    return engine, loss_fn, step


def engine_allocated_bytes(engine: Any) -> int:
    """Bytes of the engine's parameters, fp32 master weights (and their gradients) and optimizer states."""
    return _measured(engine, "training_state_bytes")()


def _measured(engine: Any, name: str) -> Any:
    """The engine's ``name`` member (``contracts.Engine``, optional), or an error saying this engine cannot be measured."""
    from toolkit.contracts import member
    from toolkit.errors import ToolkitError

    found = member(engine, "engine", name)
    if found is None:
        raise ToolkitError(f"{type(engine).__name__} has no {name}(): the planner's measurement harness cannot measure it")
    return found
