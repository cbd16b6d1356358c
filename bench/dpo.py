"""DPO training-step throughput: TRL 1.16's DPO loss beside the toolkit ``local`` engine with toolkit-dpo, same script.

    python bench/dpo.py              # 1.24B Llama shape, 4 pairs x seq 2048 per sequence, bf16 (one GPU)
    python bench/dpo.py --tiny       # a CPU smoke run of the same code path

Both sides run policy + frozen-reference forwards, backward, clipping and AdamW on the same model.
TRL runs its own ``DPOTrainer._compute_loss`` (fused LM head, reference model) on a trainer stub.
Prints a table (tokens/s over chosen+rejected, peak GiB) and writes JSON to $OUT/dpo.json when OUT is set.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import types
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import report, run_all, shape_parser  # noqa: E402
from local_sft import SHAPE_1B, SHAPE_TINY, make_model_dir, timed  # noqa: E402


def pair_data(steps: int, pairs: int, seq: int, vocab: int, device: str) -> list[torch.Tensor]:
    """Each item: ``[2 * pairs, seq]`` ids, chosen rows then rejected rows sharing a prompt (first half)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2 * pairs, seq), generator=generator)
        ids[pairs:, : seq // 2] = ids[:pairs, : seq // 2]
        out.append(ids.to(device))
    return out


def trl_dpo(model_dir: Path, data: list, warmup: int, beta: float) -> tuple[float, float]:
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    device = data[0].device
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    for m in (model, reference):
        add_fused_lm_head(m, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    stub = object.__new__(DPOTrainer)
    stub.__dict__.update(model=model, ref_model=reference, accelerator=Accelerator(cpu=device.type == "cpu"),
                         aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
                         loss_types=["sigmoid"], loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
                         _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
                         args=types.SimpleNamespace(gradient_checkpointing_kwargs=None))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")

    def step(ids: torch.Tensor) -> None:
        completion = torch.zeros_like(ids)
        completion[:, ids.shape[1] // 2:] = 1
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}
        stub._compute_loss(model, inputs, return_outputs=False).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = timed(step, data, warmup)
    return result


def toolkit_dpo(model_dir: Path, data: list, warmup: int, beta: float, precision: str) -> tuple[float, float]:
    from toolkit.builtins.strategies import LocalConfig, LocalEngine
    from toolkit.builtins.tuners import FullTuner
    from toolkit.contracts import StepContext
    from toolkit.models import load_hf_directory
    from toolkit.recipe import Recipe
    from toolkit_dpo.losses import DPOConfig, DPOLoss

    recipe = Recipe(model=str(model_dir), precision=precision, lr=1e-6, max_grad_norm=1.0, loss="dpo")
    loss = DPOLoss(DPOConfig(beta=beta))
    engine = LocalEngine(load_hf_directory(str(model_dir), model_dir), FullTuner(), loss, recipe, LocalConfig())
    engine.set_total_steps(len(data))

    def step(ids: torch.Tensor) -> None:
        rows, t = ids.shape
        pairs = rows // 2
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        labels[:, : t // 2 - 1] = -100  # only the completion (second half) is scored
        device = ids.device
        batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(t, device=device).expand(rows, t),
                 "sequence_ids": torch.arange(rows, device=device)[:, None].expand(rows, t).contiguous(),
                 "sequence_meta": {"example_ids": torch.arange(rows, device=device) % pairs,
                                   "roles": (torch.arange(rows, device=device) >= pairs).long()},
                 "num_sequences": rows}
        ctx = StepContext(label_tokens=int((labels != -100).sum()), sequences=rows, examples=pairs,
                          counts={"chosen_label_tokens": int((labels[:pairs] != -100).sum())})
        engine.train_step([batch], loss, ctx)

    result = timed(step, data, warmup)
    return result


def main() -> None:
    parser = shape_parser(batch=None, seq=2048)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SHAPE_TINY if args.tiny else SHAPE_1B
    seq, pairs = (64, 2) if args.tiny else (args.seq, args.pairs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(shape, Path(tmp))
        data = pair_data(args.steps + args.warmup, pairs, seq, shape["vocab_size"], device)
        runs = [("trl 1.16 DPO loss (bf16 params, fused LM head, ref copy)",
                 lambda: trl_dpo(model_dir, data, args.warmup, args.beta)),
                ("toolkit local + toolkit-dpo (bf16 autocast, fp32 master)",
                 lambda: toolkit_dpo(model_dir, data, args.warmup, args.beta, "bf16"))]
        rows = run_all(runs, device, pairs=pairs, seq=seq)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report(f"DPO step, {device_name}, {pairs} pairs x seq {seq}, {'tiny' if args.tiny else '1.24B'} Llama shape", rows, "dpo.json")


if __name__ == "__main__":
    main()
