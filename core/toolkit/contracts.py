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


@dataclass(frozen=True)
class AdapterSpec:
    """What a low-rank-adapter tuner adapts and how (``Tuner.adapter_spec()``), for strategies that build their own
    modules (Megatron-Core LoRA) and read this instead of a tuner's options or its library's config."""

    target_modules: tuple[str, ...]
    """Module names matched as suffixes (``q_proj``), ``all-linear``, or one regular expression over full paths."""
    rank: int
    alpha: float
    dropout: float = 0.0
    """On the adapter's input (0: none)."""
    dora: bool = False
    """Weight-decomposed (a trained magnitude per output row)."""
    rslora: bool = False
    """Scale by ``alpha / sqrt(rank)`` instead of ``alpha / rank``."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full beside the adapters."""
    bias: str = "none"
    """Which biases train beside the adapters: ``none``, ``all``, ``lora_only`` (those of adapted modules)."""
    init: str = "default"
    """How the adapters start (``default``: ``B = 0``; others are the tuner's own names)."""

    def scale(self, rank: int | None = None) -> float:
        """The update's factor for an adapter of ``rank`` (default: this spec's). An adapter of a multiple of the
        rank stands for that many targets fused into one (PEFT fuses MoE experts' gate and up projections), its
        alpha multiplied alike, so plain LoRA keeps ``alpha / rank``."""
        rank = rank or self.rank
        alpha = self.alpha * rank / self.rank
        return alpha / (rank ** 0.5 if self.rslora else rank)


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
    """Per-family facts of a strategy's or plugin's own model code (``families``: the HF ``model_type`` values).

    Optional (``OPTIONAL["architecture"]``): ``refusal(config)`` takes the dict of a model's config.json and returns
    why this architecture cannot build that model (a setting of the family it does not implement), or None; the
    planner asks it so that it never proposes a layout the strategy would refuse at start-up."""

    families: ClassVar[tuple[str, ...]]


class Tuner(Registered, Protocol):
    """What trains. Works on HF modules; a strategy with modules of its own (Megatron-Core) asks the
    tuner's optional methods (``OPTIONAL["tuner"]``) or implements the tuner kinds it supports itself.

    Optional: ``adapter_export(model)`` (the ``ExportModel.adapter`` callable of a model with adapters),
    ``adapter_from_checkpoint(checkpoint, source, recipe)`` (the same from a saved checkpoint),
    ``disabled_adapters(model)`` (a context manager in which the model is its base: the reference of
    preference losses without a second copy), ``optimizer_factory`` (``(params, recipe) -> optimizer``
    in place of AdamW, e.g. LoRA+), ``quantized`` (True: the base weights are quantized, which
    sharding strategies refuse), ``zero3_compatible`` (False: not under ZeRO-3) and
    ``before_step(model, optimizer, optimized, step)``, called by the ``local`` and ``fsdp`` engines at the start of
    every optimizer step (0-based ``step``) with ``optimized`` mapping parameter names to the tensors
    the optimizer holds: a tuner whose trainable set changes during the run (toolkit-optim's ``lisa``)
    switches ``requires_grad`` there and drops the optimizer state it no longer needs; strategies that
    do not call it must be refused by the tuner's ``validate``. ``initial_adapters(source, recipe)``:
    the trainable tensors ``checkpoint_state`` would give right after ``apply`` on the loaded model (same
    seed, same names), built without loading the base weights; strategies with modules of their own
    (Megatron-Core LoRA) split them over ranks instead of loading the HF model on every rank.
    ``adapter_spec()``: an :class:`AdapterSpec` of what the tuner adapts (targets, rank, alpha, dropout, DoRA,
    rslora, modules to save, trained biases, init); those strategies read it and nothing else of the tuner's options, and refuse a
    tuner without it.
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

    Optional (``OPTIONAL["engine"]``, defaults in :class:`EngineBase`): ``adapter_export()`` returns
    the ``ExportModel.adapter`` callable (or None) when the tuner cannot read adapters from
    ``engine.model`` itself (a sharded model); without it the runner asks the tuner's
    ``adapter_export(engine.model)``. ``model``: the HF module, where there is one; ``device``: the
    ``torch.device`` its parameters live on (RL rollouts generate there).
    ``release_reference()``: free the reference model once ``--precompute-reference`` has run.
    ``skips_nonfinite_updates`` (True when ``train_step`` can check the reduced loss and gradient
    norm before its optimizer step and skip a non-finite update; needed by ``--on-nan skip``, which
    sets ``engine.skip_nonfinite = True``) and ``supports_rollback`` (default True:
    ``load_checkpoint`` works in a running job; needed by ``--on-nan rollback``).
    For the planner's measurement harness (:mod:`toolkit.plan.measure`, which checks the memory model
    against a real engine): ``forward_loss(micro_batch, loss, ctx)``, the :class:`LossOutput` of one
    micro-batch's training forward as ``train_step`` runs it (autograd records; nothing is reduced,
    stepped or freed), and ``training_state_bytes()``, the bytes this rank holds for training between
    steps (parameters, gradients, master weights and their gradients, optimizer states). Default None
    each: the engine cannot be measured (the harness says so).
    """

    dp_rank: int
    dp_world_size: int
    is_main: bool

    def set_total_steps(self, total: int) -> None:
        """The run's optimizer steps, known once the data is counted: the learning-rate schedule's length."""

    def current_lr(self) -> float:
        """The learning rate the next step uses (logged as ``lr``)."""

    def train_step(self, micro_batches: list[dict], loss: Loss, ctx: StepContext) -> StepResult: ...

    def evaluate(self, micro_batches: list[dict], loss: Loss, ctx: StepContext) -> dict[str, float]:
        """The eval forward (``toolkit.train.evaluation``): the model in eval mode, no gradients, no update;
        ``loss`` applied to each micro-batch; returns ``{"loss": ..., **loss metrics}`` summed over the
        micro-batches and reduced over every rank (the same values on every rank). Every rank passes the same
        number of micro-batches; ``ctx`` holds the counts of the whole held-out set."""
        ...

    def reference_logps(self, micro_batch: dict) -> torch.Tensor: ...

    def save_checkpoint(self, directory: Path) -> None: ...

    def load_checkpoint(self, directory: Path) -> None: ...

    def export_tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def all_reduce_sum(self, values: list[float]) -> list[float]: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class Strategy(Registered, Protocol):
    """Places a model on the processes of a run. Optional: ``parallel_axes``, the model-splitting axes
    of :data:`toolkit.parallel.AXES` it supports (default none: data parallelism only); the runner
    refuses the others before ``validate`` is asked."""

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


class Metric(Registered, Protocol):
    """A generation metric for ``toolkit eval``: one score per prediction against its reference answers.

    Optional ``prepare()`` (``OPTIONAL["metric"]``) runs before any model loads: check options and import optional
    dependencies there, raising a ``ToolkitError`` that names the flag or the ``pip install`` command. Scores are
    usually in [0, 1] (higher is better); ``toolkit eval`` reports their mean."""

    def prepare(self) -> None: ...

    def score(self, predictions: list[str], references: list[list[str]]) -> list[float]: ...


class Callback(Registered, Protocol):
    """Told about a run's progress on the main rank. Every method is optional (no-ops in
    :class:`CallbackBase`): implement the ones you need.

    Optional class attributes (``OPTIONAL["callback"]``): ``tracker`` (default False: the callback always
    runs; True: an experiment tracker, run only when ``--report-to`` names it, :mod:`toolkit.tracking`) and
    ``requires`` (the pip package a tracker needs, named when it is missing). Its ``Config`` fields become
    ``--NAME-FIELD`` flags and a YAML section, as for losses."""

    def available(self) -> bool: ...

    def on_train_start(self, run: Any) -> None: ...

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_train_end(self, run: Any) -> None: ...


# ----------------------------------------------------------------------------- conformance

PROTOCOLS: dict[str, type] = {
    "model_loader": ModelLoader, "architecture": Architecture, "strategy": Strategy, "tuner": Tuner, "loss": Loss,
    "dataset_format": DatasetFormat, "exporter": Exporter, "inference_backend": InferenceBackend,
    "callback": Callback, "reward": Reward, "metric": Metric, "engine": Engine, "optimizer": Optimizer,
    "quantizer": Quantizer,
}
"""The protocol of each registry kind (and of the engines strategies build)."""


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _available() -> bool:
    return True


OPTIONAL: dict[str, dict[str, Any]] = {
    "engine": {"adapter_export": None, "model": None, "device": None, "release_reference": None, "skips_nonfinite_updates": False,
               "supports_rollback": True, "skip_nonfinite": False, "forward_loss": None, "training_state_bytes": None},
    "strategy": {"parallel_axes": frozenset()},
    "tuner": {"adapter_export": None, "adapter_from_checkpoint": None, "disabled_adapters": None, "optimizer_factory": None,
              "quantized": False, "zero3_compatible": True, "before_step": None, "initial_adapters": None,
              "adapter_spec": None},
    "loss": {"train_on": "assistant", "uniform_token_gradient": False, "cli_command": True},
    "dataset_format": {"bundled_datasets": {}},
    "exporter": {"export_adapter": None},
    "inference_backend": {"serve": None},
    "callback": {"available": _available, "on_train_start": _noop, "on_step_end": _noop, "on_log": _noop,
                 "on_train_end": _noop, "tracker": False, "requires": ""},
    "metric": {"prepare": _noop},
    "architecture": {"refusal": None},
}
"""Members the core reads only when a component has them, with what their absence means. Everything
else a kind's protocol declares is required (:func:`missing_members`); the core reads nothing else
(tests/test_contracts.py checks both)."""


def protocol_members(kind: str) -> list[str]:
    """Every member the protocol of ``kind`` declares (methods and annotated attributes), its optional ones included."""
    names: set[str] = set()
    for cls in PROTOCOLS[kind].__mro__:
        if cls in (object, Protocol) or cls.__module__ != __name__:
            continue
        names |= {n for n in vars(cls) if not n.startswith("_") or n == "__call__"} | set(vars(cls).get("__annotations__", {}))
    return sorted(names | set(OPTIONAL.get(kind, {})))


def missing_members(kind: str, component: Any) -> list[str]:
    """The required members of ``kind``'s protocol that ``component`` (a class or an instance) lacks."""
    optional = OPTIONAL.get(kind, {})
    return [n for n in protocol_members(kind) if n not in optional and not hasattr(component, n)]


def member(component: Any, kind: str, name: str) -> Any:
    """``component.name``, or what its absence means when the member is optional (``OPTIONAL``).
    Asking for a member the protocol does not declare is a bug in the caller (KeyError)."""
    optional = OPTIONAL.get(kind, {})
    if name not in optional and name not in protocol_members(kind):
        raise KeyError(f"{name!r} is not a member of contracts.{PROTOCOLS[kind].__name__}")
    return getattr(component, name, optional.get(name))


class EngineBase:
    """Defaults of an engine's optional members, for strategies to inherit (they need not)."""

    adapter_export: Any = None
    model: Any = None
    device: Any = None
    skips_nonfinite_updates: ClassVar[bool] = False
    supports_rollback: ClassVar[bool] = True
    skip_nonfinite: bool = False
    forward_loss: Any = None
    training_state_bytes: Any = None

    def release_reference(self) -> None:
        """Nothing to free."""


class StrategyBase:
    """Defaults of a strategy's optional members: data parallelism only."""

    parallel_axes: ClassVar[frozenset[str]] = frozenset()


class TunerBase:
    """Defaults of a tuner's optional members: no adapters, full-precision base weights, a fixed trainable set.
    ``None`` is an absent method (``member`` gives it as such): override the ones the tuner has."""

    adapter_export: Any = None
    adapter_from_checkpoint: Any = None
    disabled_adapters: Any = None
    optimizer_factory: Any = None
    quantized: ClassVar[bool] = False
    zero3_compatible: ClassVar[bool] = True
    before_step: Any = None
    initial_adapters: Any = None
    adapter_spec: Any = None


class LossBase:
    """Defaults of a loss's optional members: trains on assistant tokens, no uniform-gradient promise, a command."""

    train_on: ClassVar[str] = "assistant"
    uniform_token_gradient: ClassVar[bool] = False
    cli_command: ClassVar[bool] = True


class DatasetFormatBase:
    """Defaults of a dataset format's optional members: no bundled datasets."""

    bundled_datasets: ClassVar[dict[str, Any]] = {}


class ExporterBase:
    """Defaults of an exporter's optional members: no ``--adapter-only`` export."""

    export_adapter: Any = None


class InferenceBackendBase:
    """Defaults of an inference backend's optional members: ``toolkit serve`` refuses it."""

    serve: Any = None


class MetricBase:
    """Defaults of a metric's optional members: nothing to prepare."""

    def prepare(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to prepare."""


class ArchitectureBase:
    """Defaults of an architecture's optional members: it refuses no config (``refusal`` absent)."""

    refusal: Any = None


BASES: dict[str, type] = {}
"""The base class of each kind with optional members (filled below): a plugin may inherit it for the defaults."""


class CallbackBase:
    """A callback with every method a no-op; subclasses override what they need."""

    name: ClassVar[str] = ""
    tracker: ClassVar[bool] = False
    requires: ClassVar[str] = ""

    def __init__(self, config: Any = None):
        self.config = config

    def available(self) -> bool:
        return True

    def on_train_start(self, run: Any) -> None: ...

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_log(self, step: int, metrics: dict[str, float]) -> None: ...

    def on_train_end(self, run: Any) -> None: ...


BASES.update(engine=EngineBase, strategy=StrategyBase, tuner=TunerBase, loss=LossBase, dataset_format=DatasetFormatBase,
             exporter=ExporterBase, inference_backend=InferenceBackendBase, callback=CallbackBase, metric=MetricBase,
             architecture=ArchitectureBase)
