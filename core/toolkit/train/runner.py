"""The run loop: recipe -> model source -> engine -> data -> steps, logging, checkpoints, export."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.contracts import IGNORE_INDEX, PROTOCOLS, member, missing_members
from toolkit.errors import EXIT_STOPPED, ConfigError, LayoutError, ModelError, PluginLoadError, RunStopped, ToolkitError
from toolkit.recipe import Recipe, thing_options


@dataclass
class RunInfo:
    """What callbacks see of a run."""

    recipe: Recipe
    run_dir: Path
    total_steps: int
    start_step: int
    is_main: bool
    data_summary: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class StopFlag:
    """SIGINT/SIGTERM ask the loop to save a checkpoint and stop after the current step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # second signal: stop now
            raise KeyboardInterrupt
        self.requested = True
        print(f"\ntoolkit: received signal {signum}; saving a checkpoint after this step (again to abort)", file=sys.stderr)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def prepare_run_dir(recipe: Recipe, is_main: bool) -> Path:
    run_dir = Path(recipe.output)
    existing = run_dir / "recipe.yaml"
    if existing.is_file() and not recipe.resume and not recipe.overwrite:
        raise ToolkitError(f"output directory {run_dir} already holds a run ({existing}). Pass --resume auto to continue it, "
                           "--overwrite to start over there, or choose another --output.")
    from toolkit.train.distributed import barrier

    barrier()  # every rank has looked before the main one writes: a slower rank would see this run's own recipe.yaml
    if is_main:
        if existing.is_file() and recipe.overwrite and not recipe.resume:
            for name in ("checkpoints", "metrics.jsonl", "export"):
                target = run_dir / name
                shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def write_recipe(recipe: Recipe, run_dir: Path) -> None:
    import yaml

    from toolkit.writes import write_failure_text

    data = recipe.to_yaml_dict()
    header = ""
    model = Path(recipe.model).expanduser()
    if model.is_dir() and str(model.resolve()) != recipe.model:
        # absolute, so `toolkit export` / `toolkit infer` of this run work from any directory
        data["model"] = str(model.resolve())
        header = f"# --model as given: {recipe.model}\n"
    tmp = run_dir / ".recipe.yaml.tmp"
    try:
        tmp.write_text(header + yaml.safe_dump(data, sort_keys=False))
        tmp.replace(run_dir / "recipe.yaml")
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ToolkitError(f"cannot write {run_dir / 'recipe.yaml'} ({write_failure_text(exc, run_dir)}); nothing "
                           "was trained or changed. Free space there or choose another --output") from None


def resolve_components(recipe: Recipe, world_size: int) -> tuple[Any, Any, Any, Recipe]:
    """Strategy, tuner and loss instances; layout checked before any model memory is allocated."""
    from toolkit.plugins import get_plugin_manager

    manager = get_plugin_manager()
    if recipe.strategy == "auto":
        recipe = choose_auto_strategy(recipe, world_size)
    strategy_cls = manager.get("strategy", recipe.strategy)
    tuner_cls = manager.get("tuner", recipe.tuner)
    loss_cls = manager.get("loss", recipe.loss)
    optimizer_cls = manager.get("optimizer", recipe.optimizer)
    for kind, cls in (("strategy", strategy_cls), ("tuner", tuner_cls), ("loss", loss_cls), ("optimizer", optimizer_cls)):
        missing = missing_members(kind, cls)
        if missing:
            raise PluginLoadError(f"{kind} {cls.name!r} (plugin {manager.registry(kind).owner(cls.name)!r}) lacks "
                                  f"{', '.join(missing)}, which contracts.{PROTOCOLS[kind].__name__} requires (docs/hooks.md)")
    strategy, tuner, loss = (cls(thing_options(recipe, cls)) for cls in (strategy_cls, tuner_cls, loss_cls))
    problems = unsupported_axes(recipe, strategy_cls, manager) or strategy.validate(recipe, world_size)
    problems += optimizer_cls(thing_options(recipe, optimizer_cls)).validate(recipe)
    if problems:
        raise LayoutError(f"--strategy {recipe.strategy} cannot run this layout:\n" + "\n".join(f"  - {p}" for p in problems))
    return strategy, tuner, loss, recipe


def unsupported_axes(recipe: Recipe, strategy_cls: type, manager: Any) -> list[str]:
    """The parallel axes the recipe uses that the strategy does not declare, each naming a strategy that does."""
    from toolkit.parallel import AXES, ParallelLayout
    from toolkit.plugins import FIRST_PARTY, install_hint

    providers = {}
    for axis in AXES:
        able = [name for name, cls in manager.registry("strategy").items() if axis in manager.parallel_axes(cls)]
        if able:
            providers[axis] = able[0]
        elif ("strategy", "megatron") in FIRST_PARTY:
            providers[axis] = f"megatron ({install_hint(FIRST_PARTY[('strategy', 'megatron')])})"
    return ParallelLayout.from_recipe(recipe).unsupported(strategy_cls.name, manager.parallel_axes(strategy_cls), providers)


def choose_auto_strategy(recipe: Recipe, world_size: int) -> Recipe:
    try:
        from toolkit.plan import choose_strategy
    except ImportError:
        return dataclasses.replace(recipe, strategy="local")
    overrides = choose_strategy(recipe, world_size)
    print(f"toolkit: --strategy auto chose {overrides}", file=sys.stderr)
    return dataclasses.replace(recipe, **overrides)


def check_model_limits(recipe: Recipe, source: Any) -> None:
    limit = getattr(source.config, "max_position_embeddings", None)
    if limit and recipe.seq_len > limit:
        raise ModelError(f"--seq-len {recipe.seq_len} exceeds the model's maximum of {limit} positions "
                         f"(max_position_embeddings in {source.directory / 'config.json'}); lower --seq-len")


# What a run may change when it resumes: where and how often it logs, saves and stops, how it reacts to trouble,
# its layout (checkpoints load at any layout) and its length. Everything else shapes the training itself.
RESUME_MAY_CHANGE = {"output", "resume", "resume_changed", "overwrite", "log_every", "report_to", "run_name",
                     "eval_every", "save_every", "keep_last",
                     "stop_after", "checkpoint_verify", "dist_timeout", "export", "on_nan", "max_nan_steps", "max_steps",
                     "epochs", "strategy", "tensor_parallel", "pipeline_parallel", "virtual_pipeline", "context_parallel",
                     "expert_parallel", "expert_tensor_parallel", "sequence_parallel", "zero", "micro_batch_size",
                     "global_batch_size", "gradient_checkpointing", "trust_remote_code", "precompute_reference"}


def check_resume_changes(recipe: Recipe, is_main: bool) -> None:
    """A resume must continue the same training: refuse (before anything loads) one whose model, data, seed,
    optimizer or objective differ from the run's recipe.yaml, naming each difference, unless --resume-changed."""
    import yaml

    path = Path(recipe.output) / "recipe.yaml"
    if not recipe.resume or not path.is_file():
        return
    try:
        saved = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return  # written by an older or broken run: the checkpoint checks still apply
    _respell_sections(saved, recipe)
    current = recipe.to_yaml_dict()
    sections = {recipe.tuner, recipe.optimizer, recipe.loss, recipe.dataset_format}
    keys = [k for k in dict.fromkeys([*saved, *current]) if k not in RESUME_MAY_CHANGE
            and (k in {f.name for f in dataclasses.fields(Recipe)} or k in sections)]
    # a field the saved recipe lacks was added by a newer toolkit: at its default it trains as before
    defaults = {k: v for k, v in Recipe().to_yaml_dict().items() if k not in saved}
    changes = [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys
               if saved.get(k, defaults.get(k)) != current.get(k)]
    if not changes:
        return
    if not recipe.resume_changed:
        raise ConfigError(f"--resume continues the run in {recipe.output}, but this command trains differently from its "
                          f"{path}: {'; '.join(changes)}. Pass --resume-changed to go on with the new settings (recipe.yaml "
                          "is then rewritten), or give the run's settings, or choose another --output")
    if is_main:
        print(f"toolkit: resuming with changed settings (--resume-changed): {'; '.join(changes)}", file=sys.stderr)


def _respell_sections(saved: dict, recipe: Recipe) -> None:
    """The saved recipe's tuner, optimizer, loss and format sections as this toolkit spells them: an option's alias
    (toolkit-rl's ``max_completion_length``, now ``max_new_tokens``) under its name, options added since at their
    defaults. A section that no longer builds is left as saved (and reported as changed). A value of a deprecated
    section field (``moe: {z_loss_coef: ...}``) counts as the Recipe field that replaced it."""
    from toolkit.config import build_dataclass, to_dict
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import replaced_values

    manager = get_plugin_manager()
    for target, value in replaced_values(saved, manager).items():
        saved.setdefault(target, value)
    for kind, name in (("tuner", recipe.tuner), ("optimizer", recipe.optimizer), ("loss", recipe.loss),
                       ("dataset_format", recipe.dataset_format)):
        if isinstance(saved.get(name), dict) and name in manager.registry(kind):
            problems: list[str] = []
            config = build_dataclass(manager.get(kind, name).Config, saved[name], name, problems)
            if not problems:
                saved[name] = to_dict(config)


def run_training(recipe: Recipe, raise_if_stopped: bool = False) -> Path:
    """Train as the recipe says; returns the run directory. Works the same under torchrun.

    A run stopped before its last step (a signal, ``--stop-after``) prints where it stopped; with
    ``raise_if_stopped`` (the CLI) a single process raises :class:`RunStopped` (exit status 75). Ranks under
    torchrun exit 0, since torchrun reports any other status as its own failure; rank 0 writes ``stopped`` to
    ``$TOOLKIT_STATUS_FILE`` when set, which ``toolkit launch`` turns into 75."""
    from toolkit.models import resolve_model
    from toolkit.train.distributed import end_if_peer_lost, init_world, shutdown, start_watchdog
    from toolkit.train.numerics import NumericalError

    world = init_world(recipe.dist_timeout)
    start_watchdog(recipe.dist_timeout)
    strategy, tuner, loss, recipe = resolve_components(recipe, world.world_size)
    check_resume_changes(recipe, world.is_main)
    from toolkit.tracking import select_callbacks

    select_callbacks(recipe)  # a --report-to tracker that is not installed: said before the model loads
    source = resolve_model(recipe.model, recipe.trust_remote_code)
    check_model_limits(recipe, source)
    problems = tuner.validate(recipe, source)
    if problems:
        raise ConfigError(problems, source=f"--tuner {recipe.tuner}")
    run_dir = prepare_run_dir(recipe, world.is_main)
    recipe = keep_global_batch_size(recipe, run_dir, world.is_main)
    from toolkit.data.pipeline import DataStats, load_examples

    examples, stats = ([], DataStats()) if recipe.streaming else load_examples(
        recipe.dataset, source.tokenizer, dataset_format=recipe.dataset_format, columns=recipe.columns,
        train_on=member(loss, "loss", "train_on"), seq_len=recipe.seq_len, max_samples=recipe.max_samples,
        example_kinds=loss.example_kinds, options=recipe.options, packing=recipe.packing,
        isolate_documents=recipe.isolate_documents, ratios=recipe.dataset_ratios, seed=recipe.seed)
    from toolkit.train.evaluation import load_eval_examples, split_held_out

    examples, eval_examples = split_held_out(examples, recipe)  # checked before the model is built
    eval_examples += load_eval_examples(recipe, source.tokenizer, loss)
    engine = strategy.build(source, tuner, loss, recipe)
    check_engine(engine, recipe.strategy)
    try:
        if recipe.precompute_reference and loss.needs_reference:
            from toolkit.train.reference import precompute_reference_logps

            precompute_reference_logps(engine, examples + eval_examples, recipe, source, run_dir)
        stopped = _train_loop(recipe, run_dir, engine, loss, tuner, source, (examples, eval_examples), stats)
    except NumericalError as exc:
        if not world.distributed:
            raise
        # Every rank reached the same verdict on the same step: end them together, not by abort.
        engine.close()
        if world.is_main:
            print(f"Error: {exc}", file=sys.stderr)
        shutdown(exit_code=1)
    except Exception as exc:
        end_if_peer_lost(exc)  # returns only when the error is not a dead or hung peer
        raise
    finally:
        engine.close()
    if stopped is not None:
        if raise_if_stopped and not world.distributed:
            raise RunStopped(stopped)
        if world.is_main:
            print(f"toolkit: {stopped}", file=sys.stderr)
            if os.environ.get("TOOLKIT_STATUS_FILE"):
                Path(os.environ["TOOLKIT_STATUS_FILE"]).write_text("stopped\n")
    if world.distributed:
        shutdown(exit_code=0)
    return run_dir


def _train_loop(recipe: Recipe, run_dir: Path, engine: Any, loss: Any, tuner: Any, source: Any,
                data: tuple[list, list], stats: Any) -> str | None:
    """Train ``data`` (training and held-out examples) to the last step (returns None), to an early stop (also
    None), or until a stop is asked for (returns what to tell the user)."""
    from toolkit.data.pipeline import Batches
    from toolkit.train.checkpoint import agree_on_resume, list_checkpoints, read_state, restore_rng, save_checkpoint
    from toolkit.train.distributed import init_world, note_collective, start_watchdog
    from toolkit.train.evaluation import Evaluation
    from toolkit.train.numerics import NonFiniteGuard

    examples, eval_examples = data
    pad_id = source.tokenizer.pad_token_id if source.tokenizer.pad_token_id is not None else 0
    # PT rows that keep documents apart hold several sequences: they are collated as packed rows
    pt = member(loss, "loss", "train_on") == "all"
    packed_rows = recipe.packing or bool((stats.documents or (recipe.streaming and pt)) and recipe.isolate_documents)
    shared = dict(seed=recipe.seed, seq_len=recipe.seq_len, packing=packed_rows, micro_batch_size=recipe.micro_batch_size,
                  global_batch_size=recipe.global_batch_size, dp_rank=engine.dp_rank, dp_world_size=engine.dp_world_size,
                  pad_id=pad_id, group_by_length=recipe.group_by_length, pad_multiple=pad_multiple(init_world().device))
    if recipe.streaming:
        from toolkit.data.pipeline import stream_encoder
        from toolkit.data.streaming import StreamBatches

        encode = stream_encoder(source.tokenizer, dataset_format=recipe.dataset_format, columns=recipe.columns,
                                train_on=member(loss, "loss", "train_on"), seq_len=recipe.seq_len,
                                example_kinds=loss.example_kinds, options=recipe.options, packing=recipe.packing,
                                isolate_documents=recipe.isolate_documents, stats=stats)
        batches: Any = StreamBatches(recipe.dataset, encode, max_steps=recipe.max_steps, ratios=recipe.dataset_ratios,
                                     **shared)
        stats.stream_window = batches.window
        stats.stream_mix = ",".join(f"{r:g}" for r in recipe.dataset_ratios)
    else:
        batches = Batches(examples, **shared)
    stats.rows, stats.row_fill = batches.epoch_fill(0)
    total_steps = recipe.max_steps or batches.steps_for(recipe.epochs)
    engine.set_total_steps(total_steps)
    start_step = 0
    checkpoint = agree_on_resume(run_dir, recipe.resume, engine, recipe.checkpoint_verify) if recipe.resume else None
    saved = read_state(checkpoint) if checkpoint is not None else {}
    if checkpoint is not None:
        engine.load_checkpoint(checkpoint)
        start_step = saved["step"]
        batches.restore(saved)
        restore_rng(checkpoint, engine.dp_rank)
        if engine.is_main:
            print(f"toolkit: resumed from {checkpoint} at step {start_step}", file=sys.stderr)
    if engine.is_main:
        write_recipe(recipe, run_dir)
    info = RunInfo(recipe, run_dir, total_steps, start_step, engine.is_main, stats.summary())
    callbacks = make_callbacks(recipe, engine.is_main)
    notify(callbacks, "on_train_start", info)
    evaluation = Evaluation.for_run(recipe, engine, loss, eval_examples, pad_id, run_dir, total_steps)
    guard = NonFiniteGuard.for_run(recipe, engine, run_dir)
    watchdog = start_watchdog(recipe.dist_timeout)
    if checkpoint is not None:
        guard.restore(saved)
        evaluation.restore(saved)
    log = _StepLog(recipe, engine, callbacks, total_steps, batches.steps_per_epoch, start_step)
    log.trained_total = log.trained_before = int(saved.get("trained_tokens", 0))
    step, result, stopped = start_step, None, None
    with StopFlag() as stop:
        while step < total_steps:
            done = step + 1
            if watchdog is not None:
                watchdog.arm(f"step {done}")
            if not guard.skips(step):
                micro_batches = batches.micro_batches(step)
                lr = engine.current_lr()
                note_collective("the engine's gradient reduction (train_step)")
                result = engine.train_step(micro_batches, loss, batches.context(step))
                event = guard.check(step, result, batches)
                if event is not None:
                    checkpoints = list_checkpoints(run_dir, recipe.checkpoint_verify)
                    if guard.handle(event, checkpoints[-1] if checkpoints else None) == "rollback":
                        step = _rollback(engine, checkpoints[-1])
                        continue
                elif done > log.logged:  # steps replayed after a rollback were logged already
                    log.record(step, micro_batches, result, lr, evaluation.run(done))
            if recipe.stop_after and done - start_step >= recipe.stop_after and done < total_steps:
                stop.requested = True
            stopping = engine.all_reduce_sum([1.0 if stop.requested else 0.0])[0] > 0
            if watchdog is not None:  # saving may take long; a peer lost there still fails its barrier
                watchdog.disarm()
            early_stop = evaluation.stop_message(done)
            if ((recipe.save_every and done % recipe.save_every == 0) or done == total_steps or stopping
                    or early_stop or evaluation.wants_checkpoint(done)):
                state = {**_trainer_state(recipe, engine, batches, done, result, total_steps, tuner, guard),
                         "trained_tokens": log.trained_total, **evaluation.state()}
                path = save_checkpoint(run_dir, done, engine, state, recipe.keep_last, keep=evaluation.best_step())
                evaluation.saved(done, path)
            if early_stop:
                if engine.is_main:
                    print(f"toolkit: {early_stop}", file=sys.stderr)
                break
            if stopping and done < total_steps:  # a stop asked for during the last step still finishes the run
                stopped = (f"stopped at step {done} of {total_steps}; checkpoint {path} is whole. Run the same command "
                           f"with --resume auto to continue (exit status {EXIT_STOPPED}: stopped, resumable).")
                break
            step = done
    notify(callbacks, "on_train_end", info)
    evaluation.report()
    if recipe.export and stopped is None:
        export_after_training(recipe, run_dir, engine, source, tuner)
    return stopped


def pad_multiple(device: Any) -> int:
    """Rows are padded to a multiple of this: on a GPU, few distinct shapes for compiled kernels and
    tensor-core-friendly sizes; elsewhere no padding beyond the longest row."""
    return 64 if device.type == "cuda" else 1


class _StepLog:
    """Metrics of each trained step to the callbacks; tokens/s over the steps since the last log line, and the
    tokens with a label trained so far (``trained_tokens``, over all ranks, kept in checkpoints)."""

    def __init__(self, recipe: Recipe, engine: Any, callbacks: list, total_steps: int, steps_per_epoch: int,
                 start_step: int):
        self.recipe, self.engine, self.callbacks = recipe, engine, callbacks
        self.total_steps, self.steps_per_epoch, self.logged = total_steps, steps_per_epoch, start_step
        self.window_tokens, self.window_trained, self.window_start = 0, 0, time.perf_counter()
        self.trained_before = self.trained_total = 0  # before this log window; up to the last recorded step
        from toolkit.train.distributed import init_world

        # every rank of a model-parallel group (tensor, pipeline, context) is given its data-parallel rank's
        # micro-batches: a sum over the world counts each token that many times
        self.replicas = max(1, init_world().world_size // max(1, engine.dp_world_size))
        self.peak_memory = None
        import torch

        if torch.cuda.is_available():
            self.peak_memory = torch.cuda.max_memory_allocated

    def record(self, step: int, micro_batches: list, result: Any, lr: float, evaluated: dict[str, float]) -> None:
        """Log one trained step; a step with ``evaluated`` (eval/ metrics) is always logged, in the same line."""
        done, engine = step + 1, self.engine
        real = sum(int((mb["sequence_ids"] >= 0).sum()) for mb in micro_batches)
        capacity = sum(mb["sequence_ids"].numel() for mb in micro_batches)
        trained = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
        self.window_tokens += real
        self.window_trained += trained
        elapsed = time.perf_counter() - self.window_start
        tokens, trained_tokens, real, capacity = (value / self.replicas for value in engine.all_reduce_sum(
            [self.window_tokens, self.window_trained, real, capacity]))
        self.trained_total = self.trained_before + round(trained_tokens)
        metrics = {"step": done, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                   "tokens_per_s": tokens / max(elapsed, 1e-9), "trained_tokens_per_s": trained_tokens / max(elapsed, 1e-9),
                   "row_fill": real / max(capacity, 1), "trained_tokens": self.trained_total,
                   "epoch": step / self.steps_per_epoch, **result.metrics}
        if self.peak_memory is not None:  # on a GPU: the allocator's high-water mark so far (no synchronisation)
            metrics["peak_gib"] = self.peak_memory() / 2**30
        notify(self.callbacks, "on_step_end", done, metrics)
        if done % self.recipe.log_every == 0 or done == self.total_steps or evaluated:
            metrics.update(evaluated)
            notify(self.callbacks, "on_log", done, metrics)
            self.window_tokens, self.window_trained, self.window_start = 0, 0, time.perf_counter()
            self.trained_before = self.trained_total
        self.logged = done


def _trainer_state(recipe: Recipe, engine: Any, batches: Any, done: int, result: Any, total_steps: int, tuner: Any,
                   guard: Any) -> dict[str, Any]:
    loss = result.loss if result is not None and math.isfinite(result.loss) else None
    return {"step": done, "total_steps": total_steps, "epoch": max(done - 1, 0) // batches.steps_per_epoch,
            "loss": loss, "tuner": tuner.name, "strategy": recipe.strategy, "world_size": engine.dp_world_size,
            "global_batch_size": batches.global_batch_size, "model": recipe.model, **guard.state(), **batches.state()}


def _rollback(engine: Any, checkpoint: Path) -> int:
    """Reload weights, optimizer, schedule and RNG from ``checkpoint``; returns the step to continue from."""
    from toolkit.train.checkpoint import read_state, restore_rng

    engine.load_checkpoint(checkpoint)
    restore_rng(checkpoint, engine.dp_rank)
    return read_state(checkpoint)["step"]


def keep_global_batch_size(recipe: Recipe, run_dir: Path, is_main: bool) -> Recipe:
    """A resumed run keeps its checkpoint's global batch size, whatever its number of ranks.

    Step N trains on rows ``[N * global_batch, (N + 1) * global_batch)`` of the epoch's order, so the
    same global batch size continues the data exactly where the checkpoint stopped; more or fewer
    ranks only change how each step's rows are split into micro-batches (gradient accumulation).
    """
    from toolkit.train.checkpoint import find_resume_checkpoint, read_state

    # only the batch size is read here: sizes are checked, silently; agree_on_resume verifies and reports later
    checkpoint = find_resume_checkpoint(run_dir, recipe.resume, verify="size", report=lambda line: None) if recipe.resume else None
    saved = read_state(checkpoint).get("global_batch_size") if checkpoint is not None else None
    if not saved or recipe.global_batch_size == saved:
        return recipe
    if recipe.global_batch_size:
        raise ConfigError(f"--global-batch-size {recipe.global_batch_size} differs from the {saved} of the checkpoint "
                          f"{checkpoint}; a resumed run keeps its global batch size (it fixes which rows each step "
                          f"trains on): pass --global-batch-size {saved} or leave the flag out")
    if is_main:
        print(f"toolkit: resuming with the checkpoint's global batch size {saved}", file=sys.stderr)
    return dataclasses.replace(recipe, global_batch_size=saved)


def notify(callbacks: list[Any], event: str, *args: Any) -> None:
    """Call ``event`` on every callback that has it (each of contracts.Callback's methods is optional)."""
    for callback in callbacks:
        member(callback, "callback", event)(*args)


def make_callbacks(recipe: Recipe, is_main: bool) -> list[Any]:
    """The main process's callbacks: metrics.jsonl, progress and the trackers ``--report-to`` names
    (:func:`toolkit.tracking.select_callbacks`), each with its options from the recipe."""
    from toolkit.tracking import select_callbacks

    if not is_main:
        return []
    callbacks = [cls(thing_options(recipe, cls)) for cls in select_callbacks(recipe)]
    return [callback for callback in callbacks if member(callback, "callback", "available")()]


def export_after_training(recipe: Recipe, run_dir: Path, engine: Any, source: Any, tuner: Any) -> None:
    from toolkit.contracts import ExportModel
    from toolkit.export import export_model

    model = ExportModel(source=source, tensors=engine.export_tensors, adapter=adapter_export(tuner, engine),
                        description=f"run {run_dir}")
    if engine.is_main:
        output = run_dir / ("export" if recipe.export == "hf" else f"export-{recipe.export}")
        export_model(model, recipe.export, output, overwrite=True)
    else:
        for _ in engine.export_tensors():  # collective gathers need every rank
            pass
    engine.barrier()


def adapter_export(tuner: Any, engine: Any) -> Any:
    """``ExportModel.adapter``: the engine's own when it has one (a sharded model), else the tuner's over ``engine.model``."""
    own = member(engine, "engine", "adapter_export")
    if own is not None:
        return own()
    exporter, model = member(tuner, "tuner", "adapter_export"), member(engine, "engine", "model")
    return exporter(model) if exporter is not None and model is not None else None


def check_engine(engine: Any, strategy: str) -> None:
    """The engine a strategy built has every required member of ``contracts.Engine``."""
    missing = missing_members("engine", engine)
    if missing:
        raise PluginLoadError(f"strategy {strategy!r} built an engine ({type(engine).__qualname__}) without "
                              f"{', '.join(missing)}, which contracts.Engine requires (docs/hooks.md); the strategy's "
                              "plugin must add them")
