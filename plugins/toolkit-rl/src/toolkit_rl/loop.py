"""The ``toolkit grpo`` run: the core's engine trains, this loop samples rollouts between its optimizer steps.

Only the engine's public contract is used (``train_step``, ``export_tensors``, checkpoints,
``all_reduce_sum``), so every strategy and tuner trains under RL as it does under SFT. A rollout
batch is sampled, scored and split into ``steps_per_rollout`` optimizer steps, replayed
``iterations`` times; checkpoints fall on rollout-batch boundaries, where the whole state is the
engine's plus the number of prompt draws (the prompt order and the rollout seeds follow from it).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from toolkit.contracts import Example, member
from toolkit.errors import ConfigError, DataError, ToolkitError
from toolkit_rl.phase import RolloutBatch, dp_sum
from toolkit_rl.rollout import RolloutError

MAX_DRAWS = 4
"""Dynamic sampling draws at most this many prompt batches to fill one rollout batch."""


def run_grpo(recipe: Any) -> Path:
    """Train ``recipe`` (loss ``grpo``) from rewards; returns the run directory."""
    from toolkit.models import resolve_model
    from toolkit.plugins import get_plugin_manager
    from toolkit.train.distributed import init_world, shutdown
    from toolkit.train.runner import check_model_limits, prepare_run_dir, resolve_components
    from toolkit_rl.prompts import load_prompts
    from toolkit_rl.rewards import OverlongReward, RewardModelReward, build_rewards

    world = init_world(recipe.dist_timeout)
    strategy, tuner, loss, recipe = resolve_components(recipe, world.world_size)
    config = loss.config
    rewards = build_rewards(config.rewards, recipe, get_plugin_manager())
    for weighted in rewards:
        if isinstance(weighted.reward, OverlongReward):
            weighted.reward.max_new_tokens = config.max_new_tokens
        if isinstance(weighted.reward, RewardModelReward):
            weighted.reward.raw_prompts = config.raw_prompts
    check_schedule(recipe, config)
    if config.vllm_server:  # an unreachable server is named before any model loads
        from toolkit_rl.vllm_server import check_server

        check_server(config.vllm_server)
    source = resolve_model(recipe.model, recipe.trust_remote_code)
    check_model_limits(recipe, source)
    problems = tuner.validate(recipe, source)
    if problems:
        raise ConfigError(problems, source=f"--tuner {recipe.tuner}")
    prompts = load_prompts(recipe, config, source.tokenizer)
    run_dir = prepare_run_dir(recipe, world.is_main)
    engine = strategy.build(source, tuner, loss, recipe)
    run = None
    try:
        run = GRPORun(recipe, run_dir, engine, loss, tuner, source, prompts, rewards)
        run.train()
    finally:
        if run is not None:
            run.rollouts.close()
        engine.close()
    if world.distributed:
        shutdown(exit_code=0)
    return run_dir


def check_schedule(recipe: Any, config: Any) -> None:
    problems = []
    completions = config.prompts_per_rollout * config.num_generations
    if completions % config.steps_per_rollout:
        problems.append(f"--grpo-prompts-per-rollout {config.prompts_per_rollout} x --num-generations "
                        f"{config.num_generations} = {completions} completions do not split into "
                        f"--grpo-steps-per-rollout {config.steps_per_rollout} equal optimizer steps")
    every = config.steps_per_rollout * config.iterations
    if recipe.save_every and recipe.save_every % every:
        problems.append(f"--save-every {recipe.save_every} must be a multiple of the {every} optimizer steps of one rollout "
                        "batch (steps_per_rollout x iterations): checkpoints fall between rollout batches")
    if recipe.packing:
        problems.append("--packing does not apply to toolkit grpo (completions are scored one per row)")
    if recipe.eval_dataset or recipe.eval_split or recipe.eval_samples or recipe.save_best or recipe.early_stopping_patience:
        problems.append("toolkit grpo does not evaluate during training: leave out --eval-dataset/--eval-split/"
                        "--eval-samples/--save-best/--early-stopping-patience and score the export with toolkit eval")
    if problems:
        raise ConfigError(problems, source="toolkit grpo")


class GRPORun:
    """State of one run: the engine, the rollout backend, the prompt stream and the logs."""

    def __init__(self, recipe, run_dir, engine, loss, tuner, source, prompts, rewards):
        from toolkit_rl.rollout import Reference, make_rollouts

        self.recipe, self.run_dir, self.engine, self.loss, self.tuner, self.source = recipe, run_dir, engine, loss, tuner, source
        self.config, self.prompts, self.rewards = loss.config, prompts, rewards
        device = member(engine, "engine", "device") or _default_device()
        self.rollouts = make_rollouts(source, recipe, self.config, device)
        self.reference = Reference(source, recipe, device) if self.config.beta else None
        self.pad_id = source.tokenizer.pad_token_id if source.tokenizer.pad_token_id is not None else 0
        self.per_draw = self.config.prompts_per_rollout * engine.dp_world_size
        self.draws_per_epoch = len(prompts) // self.per_draw
        if self.draws_per_epoch == 0:
            raise DataError(f"{len(prompts)} prompts are fewer than one rollout batch over all ranks "
                            f"({self.config.prompts_per_rollout} x {engine.dp_world_size} ranks); add prompts or "
                            "lower --grpo-prompts-per-rollout")
        self.steps_per_batch = self.config.steps_per_rollout * self.config.iterations
        batches = recipe.max_steps and math.ceil(recipe.max_steps / self.steps_per_batch)
        batches = batches or max(1, math.ceil(recipe.epochs * self.draws_per_epoch))
        self.total_steps = recipe.max_steps or batches * self.steps_per_batch
        self.draws = self.batch_draws = 0

    # ------------------------------------------------------------------ prompts and rollouts
    def draw_prompts(self) -> list:
        """This rank's prompts of the next draw (the epoch's order is a function of seed and epoch)."""
        from toolkit_rl.prompts import prompt_order

        epoch, offset = divmod(self.draws, self.draws_per_epoch)
        order = prompt_order(len(self.prompts), self.recipe.seed, epoch)
        start = offset * self.per_draw + self.engine.dp_rank * self.config.prompts_per_rollout
        self.draws += 1
        return [self.prompts[i] for i in order[start:start + self.config.prompts_per_rollout]]

    def rollout_seed(self, draw: int) -> int:
        return (self.recipe.seed * 1_000_003 + draw * 7919 + self.engine.dp_rank) % (2 ** 63)

    def sample_groups(self, step: int) -> tuple[list, Any, dict[str, float]]:
        """Draws prompts, samples and scores them until the batch is full (dynamic sampling) or MAX_DRAWS.

        Every rank returns exactly ``prompts_per_rollout`` groups (so every rank runs the same optimizer
        steps with the same number of micro-batches): a batch that MAX_DRAWS draws did not fill is topped
        up with the latest dropped groups, whose advantages are zero.
        """
        import torch

        from toolkit_rl.phase import combine, reward_table

        c, group = self.config, self.config.num_generations
        dynamic = c.resolved()[4]
        kept: list = []
        dropped: list = []
        seconds, drawn = 0.0, 0
        for _ in range(MAX_DRAWS if dynamic else 1):
            draw = self.draws
            prompts = self.draw_prompts()
            completions, took = self.backend_call(step, "sampling", self.timed_generate, prompts, draw)
            seconds += took
            rows = [p for p in prompts for _ in range(group)]
            texts = self.source.tokenizer.batch_decode(completions.ids, skip_special_tokens=True)
            table = reward_table(self.rewards, rows, texts, completions.ids, [p.record for p in rows])
            total = combine(table, [w.weight for w in self.rewards])
            for g, prompt in enumerate(prompts):
                part = slice(g * group, (g + 1) * group)
                flat = total[part]
                entry = (prompt, completions.ids[part], texts[part], completions.truncated[part],
                         completions.entropy[part], table[part], flat)
                equal = bool(torch.isclose(flat, flat[:1]).all() | torch.isnan(flat).all())
                (dropped if dynamic and equal else kept).append(entry)
            drawn += len(prompts)
            full = len(kept) >= c.prompts_per_rollout
            if not dynamic or self.engine.all_reduce_sum([0.0 if full else 1.0])[0] == 0:
                break
        stats = {"rollout_time": seconds, "groups_dropped": len(dropped) / max(drawn, 1)}
        missing = max(0, c.prompts_per_rollout - len(kept))
        if dynamic:  # MAX_DRAWS draws held too few groups with unequal rewards: only the KL term moves for the rest
            # one line for the run (every rank's count), printed by the main rank
            held, wanted = dp_sum(self.engine, [float(min(len(kept), c.prompts_per_rollout)), float(c.prompts_per_rollout)])
            if held < wanted and self.engine.is_main:
                print(f"toolkit: step {step + 1}: {MAX_DRAWS} draws held {int(held)} of {int(wanted)} groups with unequal "
                      f"rewards (dynamic sampling); {int(wanted - held)} groups of equal rewards (advantage 0) fill the batch",
                      file=sys.stderr)
        if missing:
            kept += dropped[-missing:]
        return kept[: c.prompts_per_rollout], stats

    def timed_generate(self, prompts: list, draw: int) -> tuple[Any, float]:
        from toolkit_rl.phase import timed_generate

        return timed_generate(self.rollouts, prompts, self.rollout_seed(draw))

    def backend_call(self, step: int, what: str, call: Any, *args: Any) -> Any:
        """``call(*args)`` on the rollout backend; when it fails on any rank, every rank saves the run and raises one line."""
        error = None
        try:
            result = call(*args)
        except Exception as exc:  # noqa: BLE001 - whatever the engine raised, the run saves and names it
            error, result = exc, None
        failed = error is not None
        if _distributed():  # every rank learns of a failure on one, so all of them take part in the save
            failed = self.engine.all_reduce_sum([1.0 if failed else 0.0])[0] > 0
        if failed:
            raise self.backend_died(step, what, error) from error
        return result

    def backend_died(self, step: int, what: str, exc: Exception | None) -> RolloutError:
        from toolkit.train.checkpoint import save_checkpoint

        path = None
        if step > self.start_step:  # the state of the batch boundary: the prompts of the failed batch are drawn again
            path = save_checkpoint(self.run_dir, step, self.engine, self.trainer_state(step, None, self.batch_draws),
                                   self.recipe.keep_last)
        where = f"checkpoint {path}; continue with --resume auto" if path else "no step was trained since the last checkpoint"
        cause = f"{type(exc).__name__}: {exc}" if exc is not None else "it failed on another rank"
        return RolloutError(f"rollout backend {self.config.rollout_backend!r} failed {what} before step {step + 1}: "
                            f"{cause} ({where})")

    def rollout_batch(self, step: int) -> RolloutBatch:
        import torch

        from toolkit_rl import phase

        c, group = self.config, self.config.num_generations
        self.batch_draws = self.draws
        self.sync_weights(step)
        groups, stats = self.sample_groups(step)
        table = torch.cat([g[5] for g in groups])
        total = torch.cat([g[6] for g in groups])
        scale = c.resolved()[3]
        batch_std = phase.global_mean_std(self.engine, total)[1] if scale == "batch" else None
        advantages, _ = phase.nan_group_advantages(total, group, scale, batch_std)
        examples, samples = [], []
        for g, (prompt, ids, texts, truncated, _, _, _) in enumerate(groups):
            for k in range(group):
                train = not (c.mask_truncated_completions and truncated[k])
                adv = float(advantages[g * group + k])
                examples.append(Example([phase.completion_sequence(prompt.ids, ids[k], adv, train)], kind="rollout",
                                        source=prompt.source))
                if len(samples) < c.log_completions:
                    samples.append({"prompt": prompt.text, "completion": texts[k], "reward": float(total[g * group + k]),
                                    "rewards": {w.label: float(table[g * group + k, j]) for j, w in enumerate(self.rewards)},
                                    "advantage": adv, "source": prompt.source})
        steps = phase.split_steps(examples, c.steps_per_rollout, self.recipe.micro_batch_size, self.pad_id)
        start = time.perf_counter()
        self.backend_call(step, "scoring log-probs", phase.score_log_probs, steps, self.rollouts, self.reference)
        stats["rollout_time"] += time.perf_counter() - start
        metrics = {**phase.reward_metrics(self.engine, self.rewards, table, total), **stats, **self.length_metrics(groups)}
        return RolloutBatch(steps, phase.contexts_of(steps, self.engine), metrics, samples)

    def length_metrics(self, groups: list) -> dict[str, float]:
        lengths = [len(ids) for g in groups for ids in g[1]]
        truncated = [t for g in groups for t in g[3]]
        entropy = [e * len(ids) for g in groups for e, ids in zip(g[4], g[1]) if e is not None]
        n, tokens, clipped, ent = dp_sum(self.engine, [len(lengths), sum(lengths), sum(truncated), sum(entropy)])
        metrics = {"completion_length": tokens / max(n, 1), "truncated_fraction": clipped / max(n, 1)}
        if entropy:  # every backend reports it (hf from generate's logits, vllm from the HF copy)
            metrics["entropy"] = ent / max(tokens, 1)
        return metrics

    def sync_weights(self, step: int) -> None:
        """The engine's current weights into the rollout backend (every rank takes part in the gather)."""
        from toolkit_rl.rollout import broadcast_tensors

        tensors = self.engine.export_tensors()
        # engines yield on the main rank only; tensor/pipeline ranks sample too (the same rollouts as their DP rank)
        if _distributed():
            tensors = broadcast_tensors(tensors, self.engine)
        self.backend_call(step, "loading the policy's weights", self.rollouts.load_weights, tensors)

    # ------------------------------------------------------------------ training
    def trainer_state(self, done: int, loss: float | None, draws: int | None = None) -> dict[str, Any]:
        return {"step": done, "total_steps": self.total_steps, "loss": loss, "tuner": self.tuner.name,
                "strategy": self.recipe.strategy, "world_size": self.engine.dp_world_size, "model": self.recipe.model,
                "rl": {"draws": self.draws if draws is None else draws, "steps_per_batch": self.steps_per_batch}}

    def resume(self) -> int:
        from toolkit.train.checkpoint import agree_on_resume, read_state, restore_rng

        checkpoint = agree_on_resume(self.run_dir, self.recipe.resume, self.engine, self.recipe.checkpoint_verify) \
            if self.recipe.resume else None
        if checkpoint is None:
            return 0
        state = read_state(checkpoint)
        if "rl" not in state:
            raise ToolkitError(f"checkpoint {checkpoint} was not written by toolkit grpo (no rollout state); resume "
                               "it with the command that wrote it")
        self.engine.load_checkpoint(checkpoint)
        restore_rng(checkpoint, self.engine.dp_rank)
        self.draws = state["rl"]["draws"]
        if self.engine.is_main:
            print(f"toolkit: resumed from {checkpoint} at step {state['step']}", file=sys.stderr)
        return state["step"]

    def train(self) -> None:
        from toolkit.train.runner import RunInfo, StopFlag, export_after_training, make_callbacks, write_recipe

        self.engine.set_total_steps(self.total_steps)
        self.start_step = step = self.resume()
        if self.engine.is_main:
            write_recipe(self.recipe, self.run_dir)
        info = RunInfo(self.recipe, self.run_dir, self.total_steps, step, self.engine.is_main,
                       f"{len(self.prompts)} prompts, {self.config.num_generations} completions each")
        callbacks = make_callbacks(self.recipe, self.engine.is_main)
        for cb in callbacks:
            cb.on_train_start(info)
        log = RolloutLog(self.run_dir, step, self.engine.is_main)
        with StopFlag() as stop:
            while step < self.total_steps:
                batch = self.rollout_batch(step)
                log.write(step + 1, batch.samples)
                step, result = self.train_batch(step, batch, callbacks)
                if self.recipe.stop_after and step - self.start_step >= self.recipe.stop_after and step < self.total_steps:
                    stop.requested = True
                stopping = self.engine.all_reduce_sum([1.0 if stop.requested else 0.0])[0] > 0
                self.maybe_save(step, result, stopping)
                if stopping:
                    break
        for cb in callbacks:
            cb.on_train_end(info)
        if self.recipe.export and not stop.requested:
            export_after_training(self.recipe, self.run_dir, self.engine, self.source, self.tuner)

    def train_batch(self, step: int, batch: RolloutBatch, callbacks: list) -> tuple[int, Any]:
        result = None
        for _ in range(self.config.iterations):
            for micro_batches, ctx in zip(batch.steps, batch.contexts):
                if step >= self.total_steps:
                    return step, result
                lr = self.engine.current_lr()
                start = time.perf_counter()
                result = self.engine.train_step(micro_batches, self.loss, ctx)
                seconds = time.perf_counter() - start
                if not math.isfinite(result.loss):
                    raise ToolkitError(f"step {step + 1}: the loss is not finite ({result.loss}); lower --lr or check "
                                       "the rewards (rollouts.jsonl shows the last batch)")
                step += 1
                tokens = dp_sum(self.engine, [float(sum(int((mb["sequence_ids"] >= 0).sum()) for mb in micro_batches))])[0]
                metrics = {"step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                           "tokens_per_s": tokens / max(seconds, 1e-9), "train_time": seconds, **result.metrics,
                           **batch.metrics}
                for cb in callbacks:
                    cb.on_step_end(step, metrics)
                if step % self.recipe.log_every == 0 or step == self.total_steps:
                    for cb in callbacks:
                        cb.on_log(step, metrics)
        return step, result

    def maybe_save(self, step: int, result: Any, stopping: bool) -> None:
        from toolkit.train.checkpoint import save_checkpoint

        every = self.recipe.save_every
        if (every and step % every == 0) or step == self.total_steps or stopping:
            loss = result.loss if result is not None and math.isfinite(result.loss) else None
            path = save_checkpoint(self.run_dir, step, self.engine, self.trainer_state(step, loss), self.recipe.keep_last)
            if self.engine.is_main and stopping:
                print(f"toolkit: stopped at step {step}; checkpoint {path}. Continue with --resume auto.", file=sys.stderr)


class RolloutLog:
    """``rollouts.jsonl``: sampled rollouts per batch; a resumed run drops the lines past its checkpoint."""

    def __init__(self, run_dir: Path, start_step: int, is_main: bool):
        self.path, self.is_main = run_dir / "rollouts.jsonl", is_main
        if not is_main:
            return
        if start_step == 0 or not self.path.is_file():
            self.path.write_text("")
        else:
            lines = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= start_step]
            self.path.write_text("".join(line + "\n" for line in lines))

    def write(self, step: int, samples: list[dict]) -> None:
        if self.is_main and samples:
            with self.path.open("a") as handle:
                handle.write("".join(json.dumps({"step": step, **s}) + "\n" for s in samples))


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _default_device() -> Any:
    from toolkit.train.distributed import init_world

    return init_world().device
