"""Worker for test_bridge.py, run under torchrun with 2 processes (gloo, CPU, fp32).

For each layout: build the Megatron model, stream the HF weights in, compare full logits with
the HF model, and (TP2, PP2) export back to HF safetensors for a bit-exact comparison.

    _bridge_worker.py HF_DIR OUT.json LAYOUTS [MCORE_DIR]     one model
    _bridge_worker.py JOBS.json OUT.json                      several models in one launch (imports and the
                                                              process group are most of a launch's cost):
                                                              [{"name", "hf_dir", "layouts", "mcore_dir"?}, ...]
                                                              -> {name: {layout: entry}}
"""

import json
import os
import sys

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


def compare(hf_dir: str, layouts: list[str], mcore_dir: str | None, export_root: str) -> dict:
    from transformers import AutoModelForCausalLM

    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.bridge import SafetensorsReader, export_hf_tensors, load_hf_weights
    from toolkit_megatron.checkpoint import load_mcore
    from toolkit_megatron.hf_io import save_hf_checkpoint
    from toolkit_megatron.model import build_model, initialize_parallel
    from toolkit_megatron.schedule import gather_logits

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (2, 16))
    # Two packed samples in row 0 (positions restart, no attention across them), one in row 1.
    positions = torch.cat([torch.arange(10), torch.arange(6)])[None].repeat(2, 1)
    positions[1] = torch.arange(16)
    sequence_ids = torch.tensor([[0] * 10 + [1] * 6, [2] * 16])
    with torch.no_grad():
        reference = hf(ids).logits
        packed_reference = torch.cat([hf(ids[:1, :10]).logits, hf(ids[:1, 10:]).logits], dim=1)
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
        entry = {}
        if "lora" in spec:  # LoRA on the MLA projections: logits, adapter gradients and the merged export vs PEFT
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


MLA_TARGETS = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def lora_check(hf, models, ids, export_dir) -> dict:
    """PEFT's LoRA (random B, so the update is not zero) on the MLA projections of ``hf`` and the same adapters split
    onto the Megatron model: the max |difference| of the logits, of every adapter gradient of ``sum(logits * W)``
    (this rank's shard), and the largest gradient (that they are not all zero). ``export_dir``: the merged export."""
    import copy

    import peft
    from megatron.core import parallel_state as ps

    from toolkit_megatron.hf_io import save_hf_checkpoint
    from toolkit_megatron.lora import _MLA_TO_PARTS, _NAME, LoRALinear, apply_lora, export_merged
    from toolkit_megatron.schedule import gather_logits, run_schedule

    torch.manual_seed(1)
    reference = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=MLA_TARGETS,
                                                                       init_lora_weights=False))
    adapters = {}
    for key, param in reference.named_parameters():
        match = _NAME.search(key)
        if match:
            adapters.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = param.detach().clone()
    apply_lora(models, adapters, 8 / 4, 0.0, hf.config, models[0].vocab_size)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    weights = torch.randn(*ids.shape, models[0].vocab_size) * (torch.arange(models[0].vocab_size) < hf.config.vocab_size)
    logits = reference(ids).logits
    (logits * weights[..., :hf.config.vocab_size]).sum().backward()
    ours = gather_logits(models, ids)  # leaves the chunks in eval mode: megatron-core refuses MoE + TP without SP in training
    shard = weights.shape[-1] // tp

    def loss_func(micro, out):
        return (out * weights[..., rank * shard:(rank + 1) * shard]).sum(), torch.tensor(1), {}

    run_schedule(models, [{"input_ids": ids}], loss_func, forward_only=False)
    worst, largest = 0.0, 0.0
    theirs = dict(reference.named_parameters())
    parts = {module: (proj, part) for proj, (module, part) in _MLA_TO_PARTS.items()}
    for model in models:
        for path, module in model.named_modules():
            if not isinstance(module, LoRALinear):
                continue
            layer = model.decoder.layers[int(path.split(".")[2])].layer_number - 1
            proj, part = parts[path.rsplit(".", 1)[-1]]
            for which, ours_param in (("A", getattr(module, f"lora_a_{part}")), ("B", getattr(module, f"lora_b_{part}"))):
                grad = ours_param.grad.clone()
                if getattr(ours_param, "sequence_parallel", False) and tp > 1:  # as finalize_model_grads sums them
                    dist.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
                expected = theirs[f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{which}.default.weight"].grad
                if part == "o" and which == "A":
                    expected = expected.chunk(tp, dim=1)[rank]
                if part == "column" and which == "B":
                    expected = expected.chunk(tp, dim=0)[rank]
                worst = max(worst, (grad - expected).abs().max().item())
                largest = max(largest, expected.abs().max().item())
    both = torch.tensor([worst, largest])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)  # every rank's shards
    entry = {"lora_grads": both[0].item(), "lora_grad_max": both[1].item()}
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
