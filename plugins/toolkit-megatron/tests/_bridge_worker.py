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
        logits = gather_logits(models, ids)
        packed = gather_logits(models, ids, torch.stack([positions, sequence_ids]))
        entry = {}
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


if __name__ == "__main__":
    main()
