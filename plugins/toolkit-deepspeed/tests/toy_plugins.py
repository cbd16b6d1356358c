"""In-process test plugins: an adapter tuner and a reference-model loss, written only against the protocols.

``toy-lora`` freezes the model and adds a trainable low-rank delta to ``q_proj``/``v_proj``; its
export merges the delta into the weights (so the names differ from the model's state dict, as
with PEFT). ``toy-ref`` is a DPO-shaped loss on single sequences that needs reference log-probs.
They exercise what real LoRA/DPO plugins need from a strategy without importing them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar

from toolkit import hookimpl
from toolkit.contracts import LossOutput


@dataclasses.dataclass(kw_only=True)
class ToyOptions:
    pass


def _low_rank_class():
    import torch
    from torch import nn

    class LowRank(nn.Module):
        def __init__(self, base: nn.Linear, rank: int = 4):
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.05)
            self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.05)
            self.enabled = True

        def forward(self, x):
            out = self.base(x)
            return out + (x @ self.a.T) @ self.b.T if self.enabled else out

    return LowRank


class ToyLoraTuner:
    name: ClassVar[str] = "toy-lora"
    Config: ClassVar[type] = ToyOptions

    def __init__(self, config: Any = None):
        self.config = config

    def validate(self, recipe, source):
        return []

    def model_load_kwargs(self):
        return {}

    def apply(self, model, source):
        low_rank = _low_rank_class()
        model.requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj = low_rank(layer.self_attn.q_proj)
            layer.self_attn.v_proj = low_rank(layer.self_attn.v_proj)
        return model

    def checkpoint_state(self, model):
        return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def load_checkpoint_state(self, model, state):
        params = dict(model.named_parameters())
        for name, tensor in state.items():
            params[name].data.copy_(tensor)

    def export_tensors(self, model):
        state = model.state_dict()
        for name, tensor in state.items():
            if name.endswith((".a", ".b")):
                continue
            if name.endswith(".base.weight"):
                stem = name[: -len(".base.weight")]
                merged = tensor + state[stem + ".b"] @ state[stem + ".a"]
                yield stem + ".weight", merged
            elif ".base." in name:
                yield name.replace(".base.", "."), tensor
            else:
                yield name, tensor

    @contextlib.contextmanager
    def disabled_adapters(self, model):
        modules = [m for m in model.modules() if hasattr(m, "enabled")]
        for module in modules:
            module.enabled = False
        try:
            yield model
        finally:
            for module in modules:
                module.enabled = True


class ToyReferenceLoss:
    """-log sigmoid(beta * (policy - reference)) per sequence, averaged over the step's sequences."""

    name: ClassVar[str] = "toy-ref"
    Config: ClassVar[type] = ToyOptions
    consumes: ClassVar[str] = "logps"
    needs_reference: ClassVar[bool] = True
    example_kinds: ClassVar[tuple[str, ...]] = ("lm",)
    train_on: ClassVar[str] = "assistant"
    cli_command: ClassVar[bool] = False

    def __init__(self, config: Any = None):
        self.config = config

    def __call__(self, out, ctx):
        import torch

        margin = (out.sequence_sums() - out.reference_logps) / out.sequence_token_counts().clamp(min=1)
        loss = -torch.nn.functional.logsigmoid(4.0 * margin + 0.1).sum() / ctx.sequences
        return LossOutput(loss=loss, metrics={"margin": margin.detach().sum() / ctx.sequences})


@hookimpl
def toolkit_register_tuners(register):
    register(ToyLoraTuner)


@hookimpl
def toolkit_register_losses(register):
    register(ToyReferenceLoss)
