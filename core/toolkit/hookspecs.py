"""The contract for plugin authors: every hook the core calls, typed and documented.

A plugin is a module (or object) listed under the ``toolkit`` entry-point group whose
functions are decorated with ``@toolkit.hookimpl`` and named exactly like the hooks below.
Registration hooks receive a ``register`` callback; the core owns the registries, so a plugin
never touches them directly. Each registered thing is a class with a ``name`` (what users type
on the CLI), a ``Config`` dataclass (its options; flags and YAML keys are generated from it)
and the methods of its protocol in :mod:`toolkit.contracts`.

Order in which the hooks fire (``toolkit <command>``)::

    toolkit_register_commands       when the CLI is assembled (every invocation)
    toolkit_register_*              lazily, the first time a registry of that kind is read
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click

hookspec = pluggy.HookspecMarker("toolkit")

Register = Callable[[type], None]
"""``register(cls)``: add one class to a registry. ``cls.name`` is the public name."""


@hookspec
def toolkit_register_model_loaders(register: Register) -> None:
    """Register model loaders: how a model reference becomes a :class:`~toolkit.contracts.ModelSource`.

    ``register(cls)`` takes a class following :class:`toolkit.contracts.ModelLoader`:
    ``name``, ``Config``, ``accepts(reference) -> bool`` and ``load(reference, options)``.
    The first loader whose ``accepts`` is true for ``--model`` wins, in registration order
    (core loaders last, so a plugin can claim references such as ``hub:org/name``).
    Called once, the first time any model is resolved.
    """


@hookspec
def toolkit_register_architectures(register: Register) -> None:
    """Register per-family model facts (llama, qwen2, qwen3, mixtral, ...).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Architecture`:
    ``name`` (the HF ``model_type``), ``families`` it covers, and whatever a backend needs
    (HF config -> parallel model config, weight-name maps). Several plugins may register facts
    for the same family under distinct names (``megatron:llama``). Called the first time a
    backend asks for an architecture.
    """


@hookspec
def toolkit_register_strategies(register: Register) -> None:
    """Register strategies (``local``, ``fsdp``, ``deepspeed``, ``megatron``).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Strategy`:
    it validates a layout before any memory is allocated (``validate``), materialises the
    model as an :class:`~toolkit.contracts.Engine` (``build``) that steps, checkpoints and
    exports, and converts its own checkpoints to HF tensors (``checkpoint_tensors``).
    Called the first time a training command or ``toolkit plugins`` needs the registry.
    """


@hookspec
def toolkit_strategy_axes(strategy: str) -> list[str]:
    """Parallel axes (names in :data:`toolkit.parallel.AXES`) your plugin implements inside the strategy
    named ``strategy``, which another plugin registered; return ``[]`` for strategies you do not extend.

    The runner accepts an axis when the strategy's own ``parallel_axes`` or any plugin's answer here
    holds it, and refuses it otherwise before anything loads. A plugin that claims an axis does the
    splitting itself (toolkit-moe answers ``["ep"]`` for ``local`` and splits its experts over
    ``recipe.expert_parallel`` ranks in :func:`toolkit_patch_model`), and refuses a run where it cannot.
    Called when a training command checks its layout, and when the planner (``toolkit plan``,
    ``--strategy auto``) enumerates each strategy's candidate layouts.
    """


@hookspec
def toolkit_register_tuners(register: Register) -> None:
    """Register tuners (``full``, ``freeze``, ``lora``, ``dora``, ``qlora``).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Tuner`: what is
    trainable and how, what a checkpoint holds, and how weights are merged for export.
    """


@hookspec
def toolkit_register_optimizers(register: Register) -> None:
    """Register optimizers (``adamw``, ``adafactor``; toolkit-optim: ``adamw-8bit``, ``galore``).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Optimizer`: ``validate(recipe)``
    names what the optimizer cannot do (a strategy it does not run under) before the model loads, and
    ``build(named_params, recipe)`` returns a ``torch.optim.Optimizer`` over the trainable
    ``(name, tensor)`` pairs. ``--optimizer NAME`` picks one; its ``Config`` fields become
    ``--NAME-FIELD`` flags and a YAML section. Called the first time a run resolves ``--optimizer``.
    """


@hookspec
def toolkit_register_losses(register: Register) -> None:
    """Register training objectives (``pt``, ``sft``, ``dpo``, ...).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Loss`. A loss is a
    function of label log-probabilities (:class:`~toolkit.contracts.TokenLogps`) or of
    per-sequence scores, so one implementation serves every strategy. Each registered loss
    also becomes a CLI subcommand (``toolkit <name>``) unless ``cli_command = False``.
    """


@hookspec
def toolkit_register_dataset_formats(register: Register) -> None:
    """Register dataset record formats (``alpaca``, ``messages``, ``sharegpt``, ``text``, ...).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.DatasetFormat`:
    ``detect(columns)`` for auto-detection and ``encode(record, tokenizer, template)``
    returning an :class:`~toolkit.contracts.Example` of token ids and shifted labels.
    """


@hookspec
def toolkit_register_exporters(register: Register) -> None:
    """Register exporters (``hf``, ``mcore``, ``vllm``, ``lmdeploy``).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Exporter`:
    ``export(model, output, options)`` writes an artefact another tool loads from an
    :class:`~toolkit.contracts.ExportModel` (HF-named tensors plus config and tokenizer).
    """


@hookspec
def toolkit_register_quantizers(register: Register) -> None:
    """Register post-training quantizers for ``toolkit export --to hf --quantize NAME`` (``bnb4``, ``gptq``, ...).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Quantizer`: ``validate()`` names what
    keeps it from running on this machine (a missing library, no GPU) before any model loads;
    ``quantize(model_dir, output, calibration)`` reads the unquantized HF directory the core exported
    and writes a quantized HF directory that ``transformers`` loads, calibrating on ``calibration``
    (token-id lists from ``--calibration-dataset``) when ``needs_calibration`` is true. The core then
    writes the size and perplexity report beside it. Called when ``toolkit export`` gets ``--quantize``.
    """


@hookspec
def toolkit_register_inference_backends(register: Register) -> None:
    """Register inference backends (``hf``, ``vllm``, ``lmdeploy``).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.InferenceBackend`:
    ``generate(model_dir, prompts, options)`` and optionally ``serve(model_dir, options)``.
    """


@hookspec
def toolkit_register_callbacks(register: Register) -> None:
    """Register training callbacks (loggers, progress displays).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Callback`; every
    registered callback is instantiated for every run and receives ``on_train_start``,
    ``on_log`` and ``on_train_end`` on the main process. A callback whose optional
    dependency is missing returns ``False`` from ``available()`` and is skipped.
    """


@hookspec
def toolkit_register_rewards(register: Register) -> None:
    """Register reward functions for reinforcement learning (``toolkit grpo --reward NAME``).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Reward`: ``name``,
    ``Config`` and ``__call__(prompts, completions, completion_ids, records) -> list[float | None]``,
    one score per completion (``None``: this reward does not apply to that completion).
    ``records[i]`` is the dataset record the prompt came from, so a reward can read its ``answer``
    column. Its ``Config`` fields become flags (``--answer-mode``) and a YAML section, as for losses.
    Called the first time a reward is looked up (``toolkit grpo``, ``toolkit plugins``).
    """


@hookspec
def toolkit_register_metrics(register: Register) -> None:
    """Register generation metrics for ``toolkit eval --metric NAME`` (``exact``, ``contains``, ``regex``, ``rouge``).

    ``register(cls)`` takes a class following :class:`toolkit.contracts.Metric`: ``name``, ``Config`` (its
    fields become ``--NAME-FIELD`` flags of ``toolkit eval``), ``prepare()`` (before the model loads: check
    options, import optional dependencies) and ``score(predictions, references) -> list[float]``, one score
    per prediction, ``references[i]`` the list of accepted answers of prediction ``i``. Called when
    ``toolkit eval`` is assembled or run, and by ``toolkit plugins``.
    """


@hookspec
def toolkit_register_commands(cli: click.Group) -> None:
    """Add click commands or groups to the ``toolkit`` CLI: ``cli.add_command(cmd)``.

    Called every time the CLI is assembled, so keep it cheap: define commands at module
    level and import heavy libraries inside the command body.
    """


@hookspec
def toolkit_patch_model(model: Any, source: Any, recipe: Any) -> None:
    """Modify a freshly built HF model in place, before the tuner is applied.

    Called by strategies that run HF modules (``local``, ``fsdp``, ``deepspeed``) right after
    the model is loaded and placed on its device, and before ``tuner.apply``. ``source`` is the
    :class:`~toolkit.contracts.ModelSource`, ``recipe`` the resolved :class:`~toolkit.recipe.Recipe`
    (read your options with ``toolkit.recipe.thing_options``). Return nothing; do nothing unless
    your options ask for it. Example: toolkit-moe swaps the sparse MoE blocks for its own.
    A patched model that produces an auxiliary loss exposes ``model.toolkit_pop_aux_loss(tokens=None)``
    returning ``(loss_or_None, metrics)`` for the last forward; engines add that loss. They pass
    ``tokens``, a bool tensor of the real (non-padding) positions of that forward flattened to
    ``[B * T]`` (``sequence_ids >= 0``), for the loss to leave padding out; a pop without that
    parameter is called without it.
    A parameter the plugin splits over ranks (dim 0, e.g. experts) carries
    ``param.toolkit_shard = toolkit.train.sharded.Shard(...)``: the ``local`` engine then leaves it
    out of DDP, sums its gradient over the replicas, counts it once in the gradient norm and
    gathers it for checkpoints and export.
    """


@hookspec(firstresult=True)
def toolkit_resolve_export_source(path: str) -> Any:
    """Claim an export source the core does not understand (e.g. a Megatron checkpoint).

    Return an :class:`~toolkit.contracts.ExportModel` for ``path`` or ``None`` to pass.
    The first non-``None`` result wins; the core tries its own resolvers (run directory,
    checkpoint, HF directory, preset) after every plugin passed.
    """
