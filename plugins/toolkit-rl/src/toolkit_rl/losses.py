"""The GRPO family as one registered loss over :class:`~toolkit.contracts.TokenLogps`: GRPO, Dr. GRPO, DAPO, BNPO, GSPO.

The policy-gradient objective of GRPOTrainer (TRL) and ``swift rlhf --rlhf_type grpo``: a clipped
importance ratio against the rollout policy's per-token log-probs (``token_meta['old_logps']``),
times the group-normalised advantage of each completion (``sequence_meta['advantage']``), plus an
optional k3 KL estimate to a frozen reference (``token_meta['ref_logps']``). ``loss_type`` picks how
per-token losses aggregate, and with it the defaults users know each variant by. Each call returns
its micro-batch's contribution to the step loss, normalised by the step's global counts, so the
same code runs on every strategy and gradient accumulation equals one big batch.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from toolkit.config import option
from toolkit.contracts import LossOutput, StepContext, TokenLogps
from toolkit.inference import SamplingOptions

VARIANT_DEFAULTS = {
    # loss_type: (epsilon, epsilon_high, importance level, scale_rewards, dynamic_sampling)
    "grpo": (0.2, None, "token", "group", False),
    "bnpo": (0.2, None, "token", "group", False),
    "dr_grpo": (0.2, None, "token", "none", False),
    "dapo": (0.2, 0.28, "token", "group", True),
    "gspo": (3e-4, 4e-4, "sequence", "group", False),
}


@dataclasses.dataclass(kw_only=True)
class GRPOConfig(SamplingOptions):
    """GRPO's options. The rollouts' sampling options are the core's :class:`~toolkit.inference.SamplingOptions`
    (``--max-new-tokens``, ``--temperature``, ``--top-p``, ``--top-k``, as ``toolkit infer`` spells them) with
    GRPO's defaults; TRL's ``max_completion_length`` stays an alias (flag and recipe key)."""

    max_new_tokens: int = option(32, flag="--max-new-tokens", aliases=("--max-completion-length",),
                                 help="Most new tokens per completion (TRL: max_completion_length).")
    temperature: float = option(1.0, flag="--temperature", help="Sampling temperature of the rollouts (positive: GRPO "
                                                                "compares sampled completions).")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "gspo"] = option(
        "grpo", flag="--loss-type",
        help="grpo: per-completion token mean; dr_grpo: token sum over max length, no std scaling; dapo: token mean "
             "over the step, clip-higher, dynamic sampling; bnpo: token mean per micro-batch; gspo: sequence-level ratio.")
    beta: float = option(0.0, help="Weight of the KL term to the frozen reference (0: no reference model is loaded).")
    epsilon: float | None = option(None, help="Lower clip range of the ratio (default 0.2; gspo 3e-4).")
    epsilon_high: float | None = option(None, help="Upper clip range (default: epsilon; dapo 0.28; gspo 4e-4).")
    importance_sampling_level: Literal["auto", "token", "sequence"] = option(
        "auto", help="Ratio per token or per sequence (the length-normalised sequence ratio of GSPO); auto: the variant's.")
    scale_rewards: Literal["auto", "group", "batch", "none"] = option(
        "auto", help="Divide advantages by the reward std of the group, of the batch, or not (dr_grpo: none).")
    dynamic_sampling: bool | None = option(None, help="Drop groups whose rewards are all equal and sample more prompts "
                                                      "(DAPO); default on for dapo only.")
    mask_truncated_completions: bool = option(False, help="Leave completions that hit --max-new-tokens out of the loss.")
    num_generations: int = option(4, flag="--num-generations", help="Completions sampled per prompt (the group size G).")
    rewards: list[str] = option([], flag="--reward",
                                help="Reward NAME[:WEIGHT], module:function[:WEIGHT], file.py:function or a reward-model "
                                     "directory; the completion's reward is the weighted sum.")
    rollout_backend: Literal["hf", "vllm"] = option("hf", flag="--rollout-backend",
                                                    help="What samples the completions: hf (transformers generate) or vllm.")
    vllm_server: str = option("", flag="--vllm-server",
                              help="URL of a running `vllm serve` (started with VLLM_SERVER_DEV_MODE=1) that samples the "
                                   "rollouts (--rollout-backend vllm); empty: vLLM runs in the training process.")
    prompts_per_rollout: int = option(4, help="Prompts per rollout batch (per data-parallel rank); x num_generations completions.")
    steps_per_rollout: int = option(1, help="Optimizer steps each rollout batch is split into (TRL steps_per_generation).")
    iterations: int = option(1, help="Passes over each rollout batch (TRL num_iterations); >1 reuses old log-probs.")
    log_completions: int = option(4, help="Rollouts per step written to rollouts.jsonl in the run directory (0: none).")
    raw_prompts: bool = option(False, help="Use string prompts as they are instead of as one user turn of the chat template.")

    def resolved(self) -> tuple[float, float, str, str, bool]:
        """(epsilon, epsilon_high, importance level, scale_rewards, dynamic_sampling) with the variant's defaults."""
        eps, high, level, scale, dynamic = VARIANT_DEFAULTS[self.loss_type]
        eps = eps if self.epsilon is None else self.epsilon
        high = (high if high is not None else eps) if self.epsilon_high is None else self.epsilon_high
        level = level if self.importance_sampling_level == "auto" else self.importance_sampling_level
        scale = scale if self.scale_rewards == "auto" else self.scale_rewards
        return eps, high, level, scale, dynamic if self.dynamic_sampling is None else self.dynamic_sampling

    def check(self) -> list[str]:
        problems = super().check()
        for name in ("num_generations", "prompts_per_rollout", "steps_per_rollout", "iterations"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            problems.append("num_generations must be at least 2: advantages compare completions of one prompt")
        if self.beta < 0:
            problems.append(f"beta must be 0 or more, got {self.beta}")
        for name in ("epsilon", "epsilon_high"):
            value = getattr(self, name)
            if value is not None and not 0 <= value:
                problems.append(f"{name} must be 0 or more, got {value}")
        if self.temperature == 0:
            problems.append("temperature must be positive: GRPO's advantages compare sampled completions (0 is greedy)")
        if self.vllm_server and self.rollout_backend != "vllm":
            problems.append(f"--vllm-server {self.vllm_server} samples through vLLM: add --rollout-backend vllm")
        if self.vllm_server and not self.vllm_server.startswith(("http://", "https://")):
            problems.append(f"--vllm-server must be an http:// or https:// URL, got {self.vllm_server!r}")
        return problems


class GRPOLoss:
    """Clipped policy gradient on rollouts with group-normalised advantages (GRPO, Dr. GRPO, DAPO, BNPO, GSPO).

    Trains through ``toolkit grpo``, which samples the completions and fills ``token_meta`` and the
    ``advantage`` of each sequence; ``toolkit train --loss grpo`` has no rollouts and is refused.
    """

    name = "grpo"
    Config = GRPOConfig
    consumes = "logps"
    needs_reference = False  # the reference's per-token log-probs arrive in token_meta (see toolkit_rl.rollout)
    example_kinds = ("rollout",)
    cli_command = False  # toolkit_rl registers `toolkit grpo` with its own loop

    def __init__(self, config: GRPOConfig | None = None):
        self.config = config or GRPOConfig()
        problems = self.config.check()
        if problems:
            from toolkit.errors import ConfigError

            raise ConfigError(problems, source="grpo options")

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput:
        import torch

        from toolkit.errors import ToolkitError

        if "old_logps" not in out.token_meta or "advantage" not in out.sequence_meta:
            raise ToolkitError("loss 'grpo' trains on rollouts (old log-probs and advantages per completion); "
                               "run it with `toolkit grpo`, not `toolkit train --loss grpo`")
        c = self.config
        eps_low, eps_high, level, _, _ = c.resolved()
        mask = out.mask.to(out.logps.dtype)
        seq = out.sequence_ids.clamp(min=0)
        advantages = out.sequence_meta["advantage"].to(out.logps.dtype)[seq]
        log_ratio = (out.logps - out.token_meta["old_logps"].to(out.logps.dtype)) * mask
        lengths = out.sequence_token_counts().clamp(min=1)
        if level == "sequence":
            log_ratio = (out.sequence_sums(log_ratio) / lengths)[seq]
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        metrics: dict = {}
        if c.beta:
            if "ref_logps" not in out.token_meta:
                raise ToolkitError("loss 'grpo' with beta > 0 needs the reference's per-token log-probs (token_meta "
                                   "'ref_logps'); the rollout phase computes them when --grpo-beta is set")
            delta = out.token_meta["ref_logps"].to(out.logps.dtype) - out.logps
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + c.beta * kl
            metrics["kl"] = (kl * mask).sum().detach() / max(ctx.label_tokens, 1)
        loss = self._aggregate(per_token * mask, out, lengths, ctx)
        metrics.update(self._clip_metrics(ratio, advantages, mask, eps_low, eps_high, level, out, lengths, ctx))
        return LossOutput(loss=loss, metrics=metrics)

    def _aggregate(self, per_token, out: TokenLogps, lengths, ctx: StepContext):
        kind = self.config.loss_type
        sequences = max(ctx.sequences, 1)
        if kind in ("grpo", "gspo"):
            return (out.sequence_sums(per_token) / lengths).sum() / sequences
        if kind == "bnpo":  # the micro-batch's token mean, weighted by its share of the step's completions
            return per_token.sum() / lengths.sum() * out.num_sequences / sequences
        if kind == "dr_grpo":
            return per_token.sum() / (sequences * self.config.max_new_tokens)
        return per_token.sum() / max(ctx.label_tokens, 1)  # dapo: token mean over the whole step

    @staticmethod
    def _clip_metrics(ratio, advantages, mask, eps_low, eps_high, level, out, lengths, ctx) -> dict:
        low = ((ratio < 1 - eps_low) & (advantages < 0)).to(mask.dtype)
        high = ((ratio > 1 + eps_high) & (advantages > 0)).to(mask.dtype)
        if level == "sequence":  # one ratio per completion: fractions of completions, as TRL counts them
            share = max(ctx.sequences, 1)
            low, high = out.sequence_sums(low) / lengths, out.sequence_sums(high) / lengths
            return {"clip_ratio/low": low.sum().detach() / share, "clip_ratio/high": high.sum().detach() / share,
                    "clip_ratio/region": (low + high).sum().detach() / share}
        tokens = max(ctx.label_tokens, 1)
        return {"clip_ratio/low": (low * mask).sum().detach() / tokens, "clip_ratio/high": (high * mask).sum().detach() / tokens,
                "clip_ratio/region": ((low + high) * mask).sum().detach() / tokens}


LOSSES = (GRPOLoss,)
