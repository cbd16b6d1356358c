"""Non-finite steps: detected on the step they happen, handled by the ``--on-nan`` policy.

Policies: ``stop`` (the default) ends the run with the step, the samples and the last good
checkpoint; ``skip`` drops the step's update (engines that check before their optimizer step
only) and moves on; ``rollback`` reloads the newest checkpoint and replays up to the offending
step, which it then skips. Every engine reduces the loss and the gradient norm over all ranks,
so every rank sees the same verdict and takes the same branch without another collective.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.contracts import member
from toolkit.errors import ConfigError, ToolkitError

POLICIES = ("stop", "skip", "rollback")


class NumericalError(ToolkitError):
    """A step produced a non-finite loss or gradient norm and the policy says to stop."""


def nonfinite_quantities(loss: float, grad_norm: float) -> list[str]:
    """Which of the step's globally reduced quantities are NaN or infinite."""
    return [name for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not math.isfinite(value)]


@dataclass
class NonFiniteStep:
    """One detected step: ``step`` is 1-based (the optimizer step that would have been taken)."""

    step: int
    quantities: list[str]
    loss: float
    grad_norm: float
    samples: list[str]

    def describe(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)}" for name in self.quantities)
        return f"step {self.step}: non-finite {' and '.join(self.quantities)} ({values}); samples: {'; '.join(self.samples)}"


def step_samples(batches: Any, step: int) -> list[str]:
    """Where the examples of a (0-based) step's global batch came from ("file, line N").

    The global batch of a step is a pure function of the data order, so every rank names the
    same samples without gathering them.
    """
    return batches.step_sources(step)


@dataclass
class NonFiniteGuard:
    """Applies the ``--on-nan`` policy; remembers the data positions a rollback decided to skip."""

    policy: str
    max_in_row: int
    run_dir: Path
    is_main: bool
    skipped_steps: set[int] = field(default_factory=set)
    """0-based step positions whose batch is not trained on (kept in the checkpoint's trainer state)."""
    _last_bad: int = -2
    _in_row: int = 0

    @classmethod
    def for_run(cls, recipe: Any, engine: Any, run_dir: Path) -> NonFiniteGuard:
        """The guard for this run; refuses a policy the engine cannot honour, before any step."""
        policy = recipe.on_nan
        if policy not in POLICIES:
            raise ConfigError(f"--on-nan {policy!r}: expected one of {', '.join(POLICIES)}")
        strategy = getattr(recipe, "strategy", "?")
        if policy == "skip" and not member(engine, "engine", "skips_nonfinite_updates"):
            raise ConfigError(f"--on-nan skip needs a strategy that checks the loss and gradient norm before its optimizer "
                              f"step; --strategy {strategy} applies the update first, so a skipped step would leave "
                              "poisoned weights. Use --on-nan rollback (reloads the last checkpoint) or --on-nan stop.")
        if policy == "rollback" and not member(engine, "engine", "supports_rollback"):
            raise ConfigError(f"--on-nan rollback: --strategy {strategy} cannot reload a checkpoint in a running job; "
                              "use --on-nan stop and resume with --resume auto.")
        if policy == "skip":
            engine.skip_nonfinite = True  # the engine reads the step's values before its update
        return cls(policy, recipe.max_nan_steps, run_dir, engine.is_main)

    def restore(self, trainer_state: dict[str, Any]) -> None:
        self.skipped_steps = set(trainer_state.get("skipped_steps", []))

    def state(self) -> dict[str, Any]:
        return {"skipped_steps": sorted(self.skipped_steps)}

    def skips(self, step: int) -> bool:
        return step in self.skipped_steps

    def check(self, step: int, result: Any, batches: Any) -> NonFiniteStep | None:
        """The event for a 0-based ``step`` whose result is not finite, else None."""
        bad = nonfinite_quantities(result.loss, result.grad_norm)
        if not bad:
            return None
        return NonFiniteStep(step + 1, bad, result.loss, result.grad_norm, step_samples(batches, step))

    def handle(self, event: NonFiniteStep, last_checkpoint: Path | None) -> str:
        """Log the event; return ``skip`` or ``rollback``, or raise :class:`NumericalError` to stop."""
        self._in_row = self._in_row + 1 if event.step == self._last_bad + 1 else 1
        self._last_bad = event.step
        action = self.policy
        reason = ""
        if action != "stop" and self.max_in_row and self._in_row >= self.max_in_row:
            action, reason = "stop", f" ({self._in_row} non-finite steps in a row, --max-nan-steps {self.max_in_row})"
        if action == "rollback" and last_checkpoint is None:
            action, reason = "stop", " (no checkpoint to roll back to yet: save earlier ones with --save-every)"
        self._record(event, action, last_checkpoint)
        if action == "stop":
            where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved yet"
            raise NumericalError(f"{event.describe()}. Stopped{reason}; nothing was saved for this step and {where}. "
                                 "Look at those samples, or rerun with --on-nan skip or --on-nan rollback "
                                 "(with --resume auto to continue from the checkpoint).")
        if action == "rollback":
            self.skipped_steps.add(event.step - 1)
        if self.is_main:
            then = f"reloading {last_checkpoint} and skipping this batch" if action == "rollback" else "skipped the update"
            print(f"toolkit: warning: {event.describe()}; {then} (--on-nan {self.policy})", file=sys.stderr)
        return action

    def _record(self, event: NonFiniteStep, action: str, checkpoint: Path | None) -> None:
        """One ``metrics.jsonl`` line per event (null for non-finite values: JSON has no NaN)."""
        if not self.is_main:
            return
        record = {"step": event.step, "event": "nonfinite", "quantities": event.quantities, "action": action,
                  "loss": event.loss if math.isfinite(event.loss) else None,
                  "grad_norm": event.grad_norm if math.isfinite(event.grad_norm) else None,
                  "samples": event.samples, "checkpoint": str(checkpoint) if checkpoint else None}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.run_dir / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")
