"""Worker for test_fused_head.py, run under torchrun with 2 processes (gloo, CPU, fp32).

For each case (model, layout, tuner): three SFT steps of the megatron engine with the fused output head
forced on and off, on the same packed micro-batches (prompt tokens and padding not trained). Rank 0
writes the largest differences of the step losses, gradient norms and exported (merged) weights, and
how often the fused head ran. A last case trains a loss without a uniform token gradient with the head
forced on: it must keep the logits path.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig

from conftest import finish_worker

STEPS, ROWS, LENGTH = 3, 8, 24  # ROWS per step over all data-parallel ranks, two rows per micro-batch


def step_batches(vocab: int, step: int) -> list[dict]:
    """Packed rows: two samples, the first five tokens of each a prompt (not trained), the rest padding."""
    generator = torch.Generator().manual_seed(100 + step)
    batches = []
    for first in range(0, ROWS, 2):
        ids = torch.randint(0, vocab, (2, LENGTH), generator=generator)
        labels = torch.full_like(ids, -100)
        positions, sequence_ids = torch.zeros_like(ids), torch.full_like(ids, -1)
        for row, lengths in enumerate(([11, 9], [14, 7 + first % 3])):
            offset = 0
            for number, n in enumerate(lengths):
                labels[row, offset + 5:offset + n - 1] = ids[row, offset + 6:offset + n]
                positions[row, offset:offset + n] = torch.arange(n)
                sequence_ids[row, offset:offset + n] = 2 * row + number
                offset += n
        batches.append({"input_ids": ids, "labels": labels, "position_ids": positions, "sequence_ids": sequence_ids,
                        "sequence_meta": {"example_ids": torch.arange(4), "roles": torch.zeros(4, dtype=torch.long)},
                        "num_sequences": 4})
    return batches


class Counting:
    """Counts the calls of the fused head's entry point (what the loss function reaches it through)."""

    def __init__(self):
        from toolkit_megatron import fused_head

        self.calls, self.original = 0, fused_head.fused_label_logps
        fused_head.fused_label_logps = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def train(directory: Path, layout: dict, tuner_name: str, fused: bool, loss_name: str, counter: Counting) -> dict:
    from toolkit.contracts import IGNORE_INDEX, ModelSource, StepContext
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import Recipe
    from toolkit_megatron.strategy import MegatronConfig, MegatronEngine

    manager = get_plugin_manager()
    recipe = Recipe(model=str(directory), strategy="megatron", precision="fp32", lr=1e-3, seq_len=LENGTH, micro_batch_size=2,
                    adam_eps=1e-4,  # Adam's near-sign update of near-zero gradients would turn fp32 noise into lr-sized steps
                    tuner=tuner_name, tensor_parallel=layout.get("tp", 1), pipeline_parallel=layout.get("pp", 1),
                    context_parallel=layout.get("cp", 1), sequence_parallel=layout.get("sp", False), seed=7)
    source = ModelSource(reference=str(directory), directory=directory, config=AutoConfig.from_pretrained(directory),
                         tokenizer=None, weight_files=sorted(directory.glob("*.safetensors")))
    tuner_options = None
    if tuner_name == "lora":
        tuner_cls = manager.get("tuner", "lora")
        tuner_options = tuner_cls.Config(rank=4, alpha=8.0)
    tuner = manager.create("tuner", tuner_name, tuner_options)
    loss = NonUniformSFT(manager.get("loss", "sft").Config()) if loss_name == "non-uniform" else manager.create("loss", loss_name)
    counter.calls = 0
    engine = MegatronEngine(source, tuner, loss, recipe, MegatronConfig(fused_loss=fused))
    engine.set_total_steps(STEPS)
    dp, dp_rank = engine.dp_world_size, engine.dp_rank
    losses, norms = [], []
    for step in range(STEPS):
        batches = step_batches(source.config.vocab_size, step)
        ctx = StepContext(label_tokens=int(sum((b["labels"] != IGNORE_INDEX).sum() for b in batches)),
                          sequences=4 * len(batches), examples=4 * len(batches))
        result = engine.train_step(batches[dp_rank::dp], loss, ctx)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    weights = {name: tensor.detach().float().clone() for name, tensor in engine.export_tensors()}
    calls = torch.tensor([float(counter.calls)])
    dist.all_reduce(calls)
    head = engine.fused_head is not None
    engine.close()
    return {"losses": losses, "norms": norms, "weights": weights, "calls": int(calls.item()), "head": head}


def _non_uniform_loss():
    from toolkit.builtins.losses import SFTLoss

    class NonUniformSFT(SFTLoss):
        """sft re-declared in its own ``__call__`` without the uniform-gradient promise (what dpo-like losses are)."""

        name = "non-uniform-sft"

        def __call__(self, out, ctx):
            return super().__call__(out, ctx)

    return NonUniformSFT


NonUniformSFT = None


def main() -> None:
    global NonUniformSFT
    root, out_path, cases = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    dist.init_process_group("gloo")
    NonUniformSFT = _non_uniform_loss()
    counter = Counting()
    results = {}
    for case in cases:
        model, layout_name, tuner_name, loss_name = case.split(":")
        layout = {}
        for part in layout_name.split("+"):
            if part == "sp":
                layout["sp"] = True
            elif part[:2] in ("tp", "pp", "cp"):
                layout[part[:2]] = int(part[2:])
        runs = {fused: train(root / model, layout, tuner_name, fused, loss_name, counter) for fused in (False, True)}
        off, on = runs[False], runs[True]
        weight_diff = max((on["weights"][k] - off["weights"][k]).abs().max().item() for k in off["weights"]) if off["weights"] else None
        results[case] = {
            "loss_diff": max(abs(a - b) for a, b in zip(on["losses"], off["losses"])),
            "norm_diff": max(abs(a - b) for a, b in zip(on["norms"], off["norms"])),
            "weight_diff": weight_diff, "weights": len(off["weights"]),
            "worst": max(off["weights"], key=lambda k: (on["weights"][k] - off["weights"][k]).abs().max().item()) if off["weights"] else None,
            "weight_change": max((off["weights"][k] - initial).abs().max().item()
                                 for k, initial in _initial(root / model).items() if k in off["weights"]) if off["weights"] else None,
            "losses": off["losses"], "losses_on": on["losses"], "norms_on": on["norms"], "norms_off": off["norms"], "calls_on": on["calls"], "calls_off": off["calls"], "head_on": on["head"],
        }
    finish_worker(results, out_path)


def _initial(directory: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update({k: v.float() for k, v in load_file(path).items()})
    return tensors


if __name__ == "__main__":
    main()
