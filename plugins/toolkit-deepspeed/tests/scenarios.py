"""Two-rank scenarios run under torchrun by the tests: one process group, every strategy in turn.

Importing DeepSpeed and building the process group is most of the cost, so one launch runs the
``local`` DDP reference and ZeRO-1/2/3 (plus resume, export and offload) and writes a JSON report
that the tests read. Usage: ``torchrun --nproc-per-node 2 scenarios.py REPORT.json WORKDIR``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

STEPS = int(os.environ.get("SCENARIO_STEPS", "5"))
SAVE_AT = min(3, STEPS)
BASE = {"model": os.environ.get("SCENARIO_MODEL", "tiny-qwen2"), "dataset": ["demo"], "max_samples": 48, "seq_len": 96, "micro_batch_size": 1,
        "global_batch_size": 4, "lr": 2e-3, "warmup_steps": 1, "weight_decay": 0.1, "max_grad_norm": 1.0,
        "max_steps": STEPS, "seed": 7, **json.loads(os.environ.get("SCENARIO_RECIPE", "{}"))}


def build(overrides: dict, world_size: int):
    from toolkit.data.pipeline import Batches, load_examples
    from toolkit.models import resolve_model
    from toolkit.recipe import resolve_recipe
    from toolkit.train.distributed import barrier, init_world
    from toolkit.train.runner import resolve_components

    recipe = resolve_recipe({**BASE, **overrides}, source="scenario")
    strategy, tuner, loss, recipe = resolve_components(recipe, world_size)
    if init_world().is_main:  # the first use of a preset writes it to the cache: once, not by both ranks at once
        resolve_model(recipe.model)
    barrier()
    source = resolve_model(recipe.model)
    examples, _ = load_examples(recipe.dataset, source.tokenizer, seq_len=recipe.seq_len, max_samples=recipe.max_samples,
                                example_kinds=loss.example_kinds, options=recipe.options)
    engine = strategy.build(source, tuner, loss, recipe)
    batches = Batches(examples, seed=recipe.seed, seq_len=recipe.seq_len, packing=False, micro_batch_size=recipe.micro_batch_size,
                      global_batch_size=recipe.global_batch_size, dp_rank=engine.dp_rank, dp_world_size=engine.dp_world_size,
                      pad_id=source.tokenizer.pad_token_id)
    engine.set_total_steps(STEPS)
    return recipe, strategy, tuner, loss, source, engine, batches


def train(engine, loss, batches, start: int, stop: int, run_dir: Path | None = None, save_at: tuple[int, ...] = ()) -> list:
    from toolkit.train.checkpoint import save_checkpoint

    history = []
    for step in range(start, stop):
        result = engine.train_step(batches.micro_batches(step), loss, batches.context(step))
        history.append({"loss": result.loss, "grad_norm": result.grad_norm, "lr": engine.current_lr()})
        if step + 1 in save_at:
            save_checkpoint(run_dir, step + 1, engine, {"step": step + 1}, keep_last=3)
    return history


def label_logps(module, batch, device):
    import torch

    from toolkit.train.logps import token_logps

    with torch.no_grad():
        out = token_logps(module, batch, device)
    return (out.logps * out.mask).tolist()


def export_hf(engine, source, directory: Path) -> None:
    from toolkit.contracts import ExportModel
    from toolkit.export import export_model

    model = ExportModel(source=source, tensors=engine.export_tensors, description="scenario")
    if engine.is_main:
        export_model(model, "hf", directory, overwrite=True)
    else:
        for _ in engine.export_tensors():
            pass
    engine.barrier()


def reloaded_logps(directory: Path, batch) -> list:
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.train.logps import CausalLMLogps

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return label_logps(CausalLMLogps(model), batch, torch.device("cpu"))


def scenario_trajectory(name: str, overrides: dict, work: Path, world_size: int, report: dict) -> None:
    recipe, strategy, tuner, loss, source, engine, batches = build(overrides, world_size)
    run_dir = work / name
    report[name] = {"history": train(engine, loss, batches, 0, STEPS, run_dir, save_at=(SAVE_AT, STEPS))}
    probe = batches.micro_batches(0)[0]
    report[name]["evaluate"] = engine.evaluate(batches.micro_batches(0), loss, batches.context(0))
    report[name]["engine_logps"] = label_logps(getattr(engine, "ds", None) or engine.module, probe, engine.device)
    export_hf(engine, source, run_dir / "export")
    engine.close()
    if engine.is_main:
        report[name]["reloaded_logps"] = reloaded_logps(run_dir / "export", probe)
    if recipe.strategy == "deepspeed" and engine.is_main:
        compare_offline_export(strategy, source, tuner, recipe, run_dir, report[name])
        if hasattr(tuner, "adapter_from_checkpoint"):
            compare_adapter_export(tuner, source, recipe, run_dir, report[name])


def compare_offline_export(strategy, source, tuner, recipe, run_dir: Path, entry: dict) -> None:
    """The checkpoint consolidated in one process equals the live export, tensor by tensor."""
    from safetensors.torch import load_file

    live = load_file(str(run_dir / "export" / "model.safetensors"))
    offline = dict(strategy.checkpoint_tensors(run_dir / "checkpoints" / f"step-{STEPS}", source, tuner, recipe))
    entry["offline_missing"] = sorted(set(live) - set(offline))
    entry["offline_max_diff"] = max(float((live[k] - offline[k]).abs().max()) for k in live if k in offline)


def compare_adapter_export(tuner, source, recipe, run_dir: Path, entry: dict) -> None:
    """The adapter read from the checkpoint (the tuner's own reader) merges into the exported model."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint = run_dir / "checkpoints" / f"step-{STEPS}"
    _, tensors = tuner.adapter_from_checkpoint(checkpoint, source, recipe)
    def key(name: str) -> str:  # PEFT's file names drop the adapter name and add a base_model prefix
        return name[name.find("layers."):].replace(".default", "")

    trained = {key(name): value for name, value in get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="deepspeed").items()}
    matched = [(key(name), tensor) for name, tensor in tensors if key(name) in trained]
    entry["adapter_tensors"], entry["adapter_matched"] = len(tensors), len(matched)
    entry["adapter_max_diff"] = max(float((t - trained[n]).abs().max()) for n, t in matched) if matched else None


def scenario_resume(name: str, overrides: dict, work: Path, world_size: int, report: dict) -> None:
    """A fresh engine loads the step-3 checkpoint of ``name`` and trains the remaining steps."""
    *_, loss, _, engine, batches = build(overrides, world_size)
    engine.load_checkpoint(work / name / "checkpoints" / f"step-{SAVE_AT}")
    report[f"{name}-resumed"] = {"history": train(engine, loss, batches, SAVE_AT, STEPS)}
    engine.close()


def scenario_short(name: str, overrides: dict, work: Path, world_size: int, report: dict, steps: int = 3) -> None:
    *_, loss, _, engine, batches = build(overrides, world_size)
    report[name] = {"history": train(engine, loss, batches, 0, steps)}
    engine.close()


def main() -> None:
    import toy_plugins

    from toolkit.plugins import build_plugin_manager, set_plugin_manager
    from toolkit.train.distributed import init_world, shutdown

    set_plugin_manager(build_plugin_manager(extra_plugins=[("toy", toy_plugins)]))
    report_path, work = Path(sys.argv[1]), Path(sys.argv[2])
    world = init_world()
    report: dict = {"world_size": world.world_size}
    only = set(filter(None, os.environ.get("SCENARIOS", "core").split(",")))
    size = world.world_size
    zero = {"strategy": "deepspeed"}
    lora = {"tuner": "toy-lora", "loss": "toy-ref"}
    plan = [
        ("local", lambda: scenario_trajectory("local", {"strategy": "local"}, work, size, report)),
        ("zero1", lambda: scenario_trajectory("zero1", {**zero, "zero": 1}, work, size, report)),
        ("zero2", lambda: scenario_trajectory("zero2", {**zero, "zero": 2}, work, size, report)),
        ("zero3", lambda: scenario_trajectory("zero3", {**zero, "zero": 3}, work, size, report)),
        ("zero3-resume", lambda: scenario_resume("zero3", {**zero, "zero": 3}, work, size, report)),
        ("zero2-resume", lambda: scenario_resume("zero2", {**zero, "zero": 2}, work, size, report)),
        ("local-lora", lambda: scenario_trajectory("local-lora", {"strategy": "local", **lora}, work, size, report)),
        ("zero3-lora", lambda: scenario_trajectory("zero3-lora", {**zero, "zero": 3, **lora}, work, size, report)),
        ("zero3-lora-resume", lambda: scenario_resume("zero3-lora", {**zero, "zero": 3, **lora}, work, size, report)),
        ("zero1-lora", lambda: scenario_trajectory("zero1-lora", {**zero, "zero": 1, **lora}, work, size, report)),
        ("zero1-lora-resume", lambda: scenario_resume("zero1-lora", {**zero, "zero": 1, **lora}, work, size, report)),
        ("local-ref", lambda: scenario_short("local-ref", {"strategy": "local", "loss": "toy-ref"}, work, size, report)),
        ("zero3-ref", lambda: scenario_short("zero3-ref", {**zero, "zero": 3, "loss": "toy-ref"}, work, size, report)),
        ("zero2-ref", lambda: scenario_short("zero2-ref", {**zero, "zero": 2, "loss": "toy-ref"}, work, size, report)),
        ("zero3-checkpointing", lambda: scenario_short("zero3-checkpointing", {**zero, "zero": 3, "gradient_checkpointing": True},
                                                       work, size, report)),
        ("local-moe", lambda: scenario_short("local-moe", {"strategy": "local", "model": "tiny-qwen2-moe"}, work, size, report)),
        ("zero3-moe", lambda: scenario_short("zero3-moe", {**zero, "zero": 3, "model": "tiny-qwen2-moe"}, work, size, report)),
        ("zero3-freeze-moe", lambda: scenario_trajectory("zero3-freeze-moe", {
            **zero, "zero": 3, "model": "tiny-qwen2-moe", "tuner": "freeze", "freeze": {"trainable_layers": 1}}, work, size, report)),
        ("zero1-bf16", lambda: scenario_short("zero1-bf16", {**zero, "zero": 1, "precision": "bf16"}, work, size, report)),
        ("zero2-bf16", lambda: scenario_short("zero2-bf16", {**zero, "zero": 2, "precision": "bf16"}, work, size, report)),
        ("zero3-offload-bf16", lambda: scenario_short("zero3-offload-bf16", {
            **zero, "zero": 3, "precision": "bf16", "deepspeed": {"offload_optimizer": "cpu", "offload_param": "cpu"}}, work, size, report, 2)),
    ]
    core = len(plan)
    # Real first-party plugins, when installed, through their registered names only.
    installed = {name for name in ("toolkit_peft", "toolkit_dpo", "toolkit_moe") if importlib.util.find_spec(name)}
    dpo = {"loss": "dpo", "dataset": ["parity-prefs"]}
    pairs = (("peft-lora-dpo", {"tuner": "lora", **dpo}, 3, {"toolkit_peft", "toolkit_dpo"}),
                  ("peft-dora", {"tuner": "dora"}, 3, {"toolkit_peft"}),
                  ("peft-qlora", {"tuner": "qlora"}, 2, {"toolkit_peft"}),
                  ("moe-patched", {"model": "tiny-qwen2-moe", "router_z_loss_coef": 0.001, "moe": {"enabled": True}}, 3, {"toolkit_moe"}))
    for tag, values, stage, needs in pairs:
        if not needs <= installed:
            continue
        run = scenario_trajectory if tag == "peft-lora-dpo" else scenario_short
        plan.append((f"local-{tag}", lambda t=tag, v=values, r=run: r(f"local-{t}", {"strategy": "local", **v}, work, size, report)))
        plan.append((f"zero{stage}-{tag}", lambda t=tag, v=values, z=stage, r=run: r(
            f"zero{z}-{t}", {**zero, "zero": z, **v}, work, size, report)))
    for index, (name, run) in enumerate(plan):
        group = "core" if index < core else "plugins"
        if only and name not in only and group not in only:
            continue
        try:
            run()
        except Exception:
            report.setdefault("errors", {})[name] = traceback.format_exc()
            if world.is_main:
                traceback.print_exc()
            break
    if world.is_main:
        report_path.write_text(json.dumps(report))
    shutdown(exit_code=0)


if __name__ == "__main__":
    main()
