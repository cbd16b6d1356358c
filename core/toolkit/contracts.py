"""Protocols of registered things and the data types that flow between them (no torch import).

Data flow of one run (DESIGN.md): recipe -> ModelLoader -> ModelSource -> Strategy.build ->
Engine; DatasetFormat -> Example -> packed micro-batches -> Engine.train_step(Loss) ->
metrics; Engine.export_tensors / Strategy.checkpoint_tensors -> ExportModel -> Exporter.

Label convention: ``labels`` are already shifted, ``labels[t]`` is the token that follows
``input_ids[t]`` (``-100`` where nothing is trained), so a strategy computes
``log_softmax(logits[t])[labels[t]]`` with no shifting and packing stays trivially correct.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from toolkit.recipe import Recipe

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- data


@dataclass
class Sequence:
    """One token sequence: ids, shifted labels (-100 = not trained) and per-sequence meta."""

    input_ids: list[int]
    labels: list[int]
    role: int = 0
    """0 for plain/chosen/desirable sequences, 1 for rejected (preference pairs)."""
    meta: dict[str, float] = field(default_factory=dict)
    """Scalars a loss may read per sequence (e.g. ``kto_label``)."""


@dataclass
class Example:
    """What a dataset format makes of one record: the sequences that must share a micro-batch."""

    sequences: list[Sequence]
    kind: str = "lm"
    """``lm`` (pt/sft), ``preference`` (chosen + rejected), ``unpaired`` (KTO)."""
    source: str = ""
    """Where the record came from (``file, line N``), set by the data pipeline; names samples in reports."""


@dataclass
class TokenLogps:
    """What a strategy hands a loss: log-probabilities of the labels, per token.

    ``logps``, ``mask`` and ``sequence_ids`` are ``[rows, tokens]``; ``sequence_ids`` maps
    each token to its sequence in the micro-batch (``-1`` for padding). ``sequence_meta``
    holds ``[num_sequences]`` tensors: ``example_ids`` (which example a sequence belongs to),
    ``roles`` and any format meta or precomputed ``reference_logps``.
    """

    logps: torch.Tensor
    mask: torch.Tensor
    sequence_ids: torch.Tensor
    num_sequences: int
    sequence_meta: dict[str, torch.Tensor]
    reference_logps: torch.Tensor | None = None
    """``[num_sequences]`` summed reference log-probs when the loss needs a reference."""
    scores: torch.Tensor | None = None
    """``[num_sequences]`` scalar scores from a value head (reward modeling)."""
    aux_loss: torch.Tensor | None = None
    """Auxiliary losses the model produced (MoE load balancing), already weighted."""
    aux_metrics: dict[str, float] = field(default_factory=dict)
    """Per-forward model metrics (MoE routing: dropped tokens, max load); engines average them."""
    token_meta: dict[str, torch.Tensor] = field(default_factory=dict)
    """``[rows, tokens]`` values aligned with ``logps`` that the micro-batch carried under ``token_meta``
    (RL: the rollout policy's and the reference's per-token log-probs); empty for every other loss."""

    def sequence_sums(self, values: torch.Tensor | None = None) -> torch.Tensor:
        """Sum ``values`` (default: masked logps) per sequence: ``[num_sequences]``."""
        import torch

        values = self.logps * self.mask if values is None else values * self.mask
        ids = self.sequence_ids.clamp(min=0).flatten()
        out = torch.zeros(self.num_sequences, dtype=values.dtype, device=values.device)
        return out.index_add(0, ids, (values * (self.sequence_ids >= 0)).flatten())

    def sequence_token_counts(self) -> torch.Tensor:
        """Number of label tokens per sequence: ``[num_sequences]``."""
        return self.sequence_sums(self.mask.new_ones(self.mask.shape, dtype=self.logps.dtype))


@dataclass
class StepContext:
    """Global counts of one optimizer step (all micro-batches, all data-parallel ranks).

    Loss contract: each micro-batch's loss is its *contribution* to the step loss, normalised
    by these global counts, so summing over micro-batches and ranks gives the step loss and
    accumulation or data parallelism give the same update as one big batch. Strategies sum
    gradients over ranks (they undo DDP's averaging). Metrics follow the same rule.
    """

    label_tokens: int
    sequences: int
    examples: int
    step: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    """Further global counts of the step, e.g. ``chosen_label_tokens`` (label tokens of role-0
    sequences), which preference losses with a cross-entropy term on chosen responses normalise by."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Contributions that sum over micro-batches and ranks to the step's value."""


@dataclass
class ModelSource:
    """A resolved model reference: an HF directory with config, weights and tokenizer."""

    reference: str
    directory: Path
    config: Any
    """``transformers.PretrainedConfig``."""
    tokenizer: Any
    weight_files: list[Path]
    trust_remote_code: bool = False

    @property
    def architecture(self) -> str:
        return self.config.model_type


@dataclass
class ExportModel:
    """What exporters consume: HF-named full tensors (a lazy iterator) plus metadata."""

    source: ModelSource
    tensors: Any
    """Callable returning an iterator of ``(hf_name, tensor)``; called once by the exporter."""
    adapter: Any = None
    """Optional callable returning ``(peft_config_dict, iterable of (name, tensor))`` for adapter-only exports."""
    description: str = ""
    destination: Any = None
    """The folder the export ends up in: exporters write into a staging folder that is renamed
    there once complete, so a path written into a file (a serve command) must use this one."""


@dataclass
class StepResult:
    loss: float
    """The step loss summed over micro-batches and reduced over every rank (NaN anywhere is NaN everywhere)."""
    grad_norm: float
    """Global gradient norm before clipping (the same value on every rank)."""
    metrics: dict[str, float]
    applied: bool = True
    """False when the engine found the loss or gradient norm non-finite and left weights, optimizer
    and learning-rate schedule untouched (engines with ``skips_nonfinite_updates = True``)."""


# ----------------------------------------------------------------------------- protocols


@runtime_checkable
class Registered(Protocol):
    name: ClassVar[str]
    Config: ClassVar[type]


class ModelLoader(Registered, Protocol):
    def accepts(self, reference: str) -> bool: ...

    def load(self, reference: str, *, trust_remote_code: bool = False) -> ModelSource: ...


class Architecture(Registered, Protocol):
    families: ClassVar[tuple[str, ...]]


class Tuner(Registered, Protocol):
    """What trains. Works on HF modules; strategies with their own modules call ``apply_megatron``.

    Optional: ``before_step(model, optimizer, optimized, step)``, called by the ``local`` engine at the
    start of every optimizer step (0-based ``step``) with ``optimized`` mapping parameter names to the
    tensors the optimizer holds: a tuner whose trainable set changes during the run (toolkit-optim's
    ``lisa``) switches ``requires_grad`` there and drops the optimizer state it no longer needs.
    Strategies that do not call it must be refused by the tuner's ``validate``.
    """

    def validate(self, recipe: Recipe, source: ModelSource) -> list[str]: ...

    def model_load_kwargs(self) -> dict[str, Any]: ...

    def apply(self, model: torch.nn.Module, source: ModelSource) -> torch.nn.Module: ...

    def checkpoint_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]: ...

    def load_checkpoint_state(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None: ...

    def export_tensors(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]: ...


class Optimizer(Registered, Protocol):
    """How the trainable tensors are updated (``--optimizer``): a factory of ``torch.optim.Optimizer``.

    ``named_params`` are the tensors the engine optimises, with their HF parameter names (fp32 master
    copies under ``--precision bf16``); the optimizer reads the recipe's ``lr``, ``weight_decay``, betas
    and its own ``Config``. Engines set the learning-rate schedule on the returned optimizer's
    ``param_groups`` and save its ``state_dict()`` in checkpoints (tensors only: checkpoints load with
    ``weights_only``).
    """

    def validate(self, recipe: Recipe) -> list[str]: ...

    def build(self, named_params: list[tuple[str, torch.Tensor]], recipe: Recipe) -> Any: ...


class Loss(Registered, Protocol):
    """A task objective over :class:`TokenLogps`.

    Optional class attribute ``uniform_token_gradient = True``: the loss's gradient with respect to
    every label log-prob of a micro-batch is one and the same number (token-averaged cross-entropy).
    Engines may then make the output head's gradients in forward (``--local-fused-loss``); a loss
    that weights tokens differently must not declare it. Engines read it from the class that defines
    ``__call__``, so overriding ``__call__`` in a subclass drops the promise unless it is repeated.
    """

    consumes: ClassVar[Literal["logps", "scores"]]
    needs_reference: ClassVar[bool]
    example_kinds: ClassVar[tuple[str, ...]]

    def __call__(self, out: TokenLogps, ctx: StepContext) -> LossOutput: ...


class DatasetFormat(Registered, Protocol):
    example_kind: ClassVar[str]

    def detect(self, columns: list[str]) -> bool: ...

    def encode(self, record: dict[str, Any], tokenizer: Any, template: Any) -> Example: ...


class Engine(Protocol):
    """A model placed by a strategy: steps, checkpoints and exports it.

    Optional: ``adapter_export()`` returns the ``ExportModel.adapter`` callable (or None) when the
    tuner cannot read adapters from ``engine.model`` itself (a sharded model); without it the
    runner asks the tuner's ``adapter_export(engine.model)``.

    Optional class attributes the runner reads: ``skips_nonfinite_updates`` (True when
    ``train_step`` can check the reduced loss and gradient norm before its optimizer step and
    skip a non-finite update; needed by ``--on-nan skip``, which sets ``engine.skip_nonfinite =
    True``) and ``supports_rollback`` (default True: ``load_checkpoint`` works in a running job;
    needed by ``--on-nan rollback``).
    """

    dp_rank: int
    dp_world_size: int
    is_main: bool

    def train_step(self, micro_batches: list[dict], loss: Loss, ctx: StepContext) -> StepResult: ...

    def evaluate(self, micro_batches: list[dict], loss: Loss, ctx: StepContext) -> dict[str, float]: ...

    def reference_logps(self, micro_batch: dict) -> torch.Tensor: ...

    def save_checkpoint(self, directory: Path) -> None: ...

    def load_checkpoint(self, directory: Path) -> None: ...

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def all_reduce_sum(self, values: list[float]) -> list[float]: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class Strategy(Registered, Protocol):
    def validate(self, recipe: Recipe, world_size: int) -> list[str]: ...

    def build(self, source: ModelSource, tuner: Tuner, loss: Loss, recipe: Recipe) -> Engine: ...

    def checkpoint_tensors(
        self, checkpoint: Path, source: ModelSource, tuner: Tuner, recipe: Recipe
    ) -> Iterator[tuple[str, torch.Tensor]]: ...


class Exporter(Registered, Protocol):
    def export(self, model: ExportModel, output: Path, options: Any) -> Path: ...


class Quantizer(Registered, Protocol):
    """Post-training quantization of an HF directory (``toolkit export --quantize NAME``).

    ``needs_calibration``: the method reads ``--calibration-dataset`` (GPTQ, AWQ); ``calibration`` is then a
    list of token-id lists, else ``None``. ``quantize`` writes config (with its ``quantization_config``),
    weights and tokenizer into ``output``; it never writes elsewhere.
    """

    needs_calibration: ClassVar[bool]

    def validate(self) -> list[str]: ...

    def quantize(self, model_dir: Path, output: Path, calibration: list[list[int]] | None) -> None: ...


class InferenceBackend(Registered, Protocol):
    def generate(self, model_dir: Path, prompts: list[str], options: Any) -> list[str]: ...


class Reward(Registered, Protocol):
    """A reward function for RL: one score per completion (``None`` where it does not apply)."""

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 records: list[dict[str, Any]]) -> list[float | None]: ...


class Callback(Registered, Protocol):
    def available(self) -> bool: ...

    def on_train_start(self, run: Any) -> None: ...

    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_train_end(self, run: Any) -> None: ...
