"""Worker for test_bridge.py, run under torchrun with 2 processes (gloo, CPU, fp32).

For each layout: build the Megatron model, stream the HF weights in (or, ``mcore=1``, load the mcore checkpoint
``save=1`` wrote), compare full logits with the HF model, and (TP2, PP2) export back to HF safetensors for a
bit-exact comparison.

    _bridge_worker.py HF_DIR OUT.json LAYOUTS [MCORE_DIR]     one model
    _bridge_worker.py JOBS.json OUT.json                      several models in one launch (imports and the
                                                              process group are most of a launch's cost):
                                                              [{"name", "hf_dir", "layouts", "mcore_dir"?}, ...]
                                                              -> {name: {layout: entry}}
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import finish_worker


def main() -> None:
    out_path = sys.argv[2]
    dist.init_process_group("gloo")
    if sys.argv[1].endswith(".json"):
        with open(sys.argv[1]) as f:
            jobs = json.load(f)
        results = {job["name"]: compare(job["hf_dir"], job["layouts"].split(","), job.get("mcore_dir"),
                                        os.path.join(os.path.dirname(out_path), job["name"])) for job in jobs}
    else:
        results = compare(sys.argv[1], sys.argv[3].split(","), sys.argv[4] if len(sys.argv) > 4 else None,
                          os.path.dirname(out_path))
    finish_worker(results, out_path)


HF_REFERENCES: dict[str, tuple] = {}
"""hf_dir -> (HF model, (its logits, its logits of row 0's packed samples) on the ids): several jobs read one model."""


def compare(hf_dir: str, layouts: list[str], mcore_dir: str | None, export_root: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.models import attention_kwargs
    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.bridge import SafetensorsReader, export_hf_tensors, load_hf_weights
    from toolkit_megatron.checkpoint import load_mcore, save_mcore, stop_checkpoint_workers
    from toolkit_megatron.hf_io import save_hf_checkpoint
    from toolkit_megatron.model import build_model, initialize_parallel
    from toolkit_megatron.schedule import gather_logits

    if hf_dir not in HF_REFERENCES:
        # the reference runs the attention transformers' own model needs (eager for Gemma 2's soft-capping)
        config = AutoConfig.from_pretrained(hf_dir)
        HF_REFERENCES[hf_dir] = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **attention_kwargs(config)).eval(), None
    hf, logits = HF_REFERENCES[hf_dir]
    torch.manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (2, 16))
    # Two packed samples in row 0 (positions restart, no attention across them), one in row 1.
    positions = torch.cat([torch.arange(10), torch.arange(6)])[None].repeat(2, 1)
    positions[1] = torch.arange(16)
    sequence_ids = torch.tensor([[0] * 10 + [1] * 6, [2] * 16])
    if logits is None:
        with torch.no_grad():
            logits = hf(ids).logits, torch.cat([hf(ids[:1, :10]).logits, hf(ids[:1, 10:]).logits], dim=1)
        HF_REFERENCES[hf_dir] = hf, logits
    reference, packed_reference = logits
    results = {}
    for name in layouts:
        spec = dict(part.split("=") for part in name.split("+"))
        layout = ParallelLayout(tensor=int(spec.get("tp", 1)), pipeline=int(spec.get("pp", 1)), virtual=int(spec.get("vpp", 1)),
                        context=int(spec.get("cp", 1)), sequence_parallel="sp" in spec, expert=int(spec.get("ep", 1)))
        initialize_parallel(layout)
        models = build_model(hf.config, layout)
        if "mcore" in spec:  # a dist checkpoint written by another layout
            load_mcore(models, mcore_dir)
        else:
            load_hf_weights(models, hf.config, SafetensorsReader.from_directory(hf_dir))
        if "save" in spec:  # what the mcore exporter's processes write (toolkit_megatron.exporter._export_worker)
            save_mcore(models, mcore_dir, hf.config, layout, extra={"dtype": "float32"}, tokenizer_source=Path(hf_dir))
            stop_checkpoint_workers()
        entry = {}
        if "lora" in spec:  # LoRA (LORA_TARGETS): logits, adapter gradients and the merged export vs PEFT
            entry.update(lora_check(hf, models, ids, os.path.join(export_root, f"export-{name}") if "export" in spec else None))
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, entry)
            results[name] = {k: v for e in gathered for k, v in e.items()}
            dist.barrier()
            continue
        logits = gather_logits(models, ids)
        packed = gather_logits(models, ids, torch.stack([positions, sequence_ids]))
        if logits is not None:
            entry["logits"] = (logits - reference).abs().max().item()
            entry["packed"] = (packed[:1] - packed_reference).abs().max().item()
        if "export" in spec:
            target = os.path.join(export_root, f"export-{name}")
            tensors = export_hf_tensors(models, hf.config)
            if dist.get_rank() == 0:
                save_hf_checkpoint(tensors, hf.config, target, max_shard_bytes=200_000)
                entry["export_dir"] = target
            else:
                for _ in tensors:
                    pass
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entry)
        results[name] = {k: v for e in gathered for k, v in e.items()}
        dist.barrier()
    return results


LORA_TARGETS = {  # MLA's projections; routed experts (fused by transformers 5: PEFT adapts their parameters), shared experts
    "deepseek_v3": ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "deepseek_v2": ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mixtral": ["q_proj", "v_proj", "w1", "w2", "w3"],
    "qwen2_moe": ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],  # PEFT adapts its shared expert only
}


def lora_check(hf, models, ids, export_dir) -> dict:
    """PEFT's LoRA (random B, so the update is not zero) on ``hf`` and the same adapters split onto the Megatron
    model by ``hf_adapters`` / ``apply_lora``: the max |difference| of the logits, of every adapter gradient of
    ``sum(logits * W)`` gathered back into PEFT's layout (``adapter_state``), and the largest gradient (that they
    are not all zero); the gathered adapters loaded into a fresh PEFT model give PEFT's logits. ``export_dir``:
    the merged export."""
    import copy
    import types

    import peft
    from megatron.core import parallel_state as ps

    from toolkit_megatron.hf_io import save_hf_checkpoint
    from toolkit_megatron.lora import adapter_state, apply_lora, export_merged, hf_adapters
    from toolkit_megatron.schedule import gather_logits, run_schedule

    torch.manual_seed(1)
    targets = LORA_TARGETS[hf.config.model_type]
    reference = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                                       init_lora_weights=False))
    inner = reference.base_model.model
    initial = {name: param.detach().clone() for name, param in inner.named_parameters() if "lora_" in name}
    from toolkit.contracts import AdapterSpec

    spec = AdapterSpec(target_modules=tuple(targets), rank=4, alpha=8.0)
    tuner = types.SimpleNamespace(name="lora", adapter_spec=lambda: spec, initial_adapters=lambda source, recipe: initial)
    apply_lora(models, hf_adapters(types.SimpleNamespace(config=hf.config), tuner, None), 0.0, hf.config, models[0].vocab_size)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    weights = torch.randn(*ids.shape, models[0].vocab_size) * (torch.arange(models[0].vocab_size) < hf.config.vocab_size)
    logits = reference(ids).logits
    (logits * weights[..., :hf.config.vocab_size]).sum().backward()
    ours = gather_logits(models, ids)  # leaves the chunks in eval mode: megatron-core refuses MoE + TP without SP in training
    shard = weights.shape[-1] // tp

    def loss_func(micro, out):
        return (out * weights[..., rank * shard:(rank + 1) * shard]).sum(), torch.tensor(1), {}

    run_schedule(models, [{"input_ids": ids}], loss_func, forward_only=False)

    def grad(param):  # as finalize_model_grads sums the sequence-parallel ones over TP
        value = param.grad.clone()
        if getattr(param, "sequence_parallel", False) and tp > 1:
            dist.all_reduce(value, group=ps.get_tensor_model_parallel_group())
        return value

    grads, trained = adapter_state(models, grad), adapter_state(models)
    entry = {}
    if dist.get_rank() == 0:
        theirs = {name: param.grad for name, param in inner.named_parameters() if "lora_" in name}
        assert set(grads) == set(theirs), (sorted(set(grads) ^ set(theirs))[:4])
        entry["lora_grads"] = max((grads[n] - g).abs().max().item() for n, g in theirs.items())
        entry["lora_grad_max"] = max(g.abs().max().item() for g in theirs.values())
        fresh = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        missing = fresh.base_model.model.load_state_dict(trained, strict=False)
        assert not missing.unexpected_keys, missing.unexpected_keys[:4]
        with torch.no_grad():
            entry["lora_gathered"] = (fresh(ids).logits - logits).abs().max().item()
    if ours is not None:
        entry["lora_logits"] = (ours - logits.detach()).abs().max().item()
    if export_dir is not None:
        tensors = export_merged(models, hf.config)
        if dist.get_rank() == 0:
            save_hf_checkpoint(tensors, hf.config, export_dir, max_shard_bytes=200_000)
            with torch.no_grad():
                merged = reference.merge_and_unload()(ids).logits
            entry["lora_merged"] = export_dir
            torch.save({"ids": ids, "logits": merged}, os.path.join(export_dir, "peft_merged_logits.pt"))
        else:
            for _ in tensors:
                pass
    return entry


if __name__ == "__main__":
    main()
