"""The recipe form as data: one :class:`Field` per Recipe field and per field of every registered
strategy's, tuner's, loss's, dataset format's and architecture's ``Config``, with the CLI flag
the core generates for it; values -> recipe dict -> YAML and the equivalent command line.

Nothing here knows a plugin by name: a third-party plugin's loss and its options appear because
they are in the registry. No Gradio here, so the form logic is tested without a browser.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import types
import typing
from typing import Any, Literal, get_args, get_origin

from toolkit.config import coerce, field_types
from toolkit.errors import ToolkitError
from toolkit.recipe import OPTION_KINDS, Recipe

# Recipe fields whose value names a registered thing: shown as a choice of the installed ones.
NAMED_BY_REGISTRY = {"loss": "loss", "tuner": "tuner", "strategy": "strategy", "optimizer": "optimizer",
                     "dataset_format": "dataset_format", "export": "exporter"}
# The Recipe fields that choose which registered thing's options apply (a file that sets none of one
# kind but holds the options of exactly one such thing means that one: examples/dpo.yaml is run as
# `toolkit dpo --config examples/dpo.yaml` and names no loss).
CHOOSERS = ("strategy", "tuner", "optimizer", "loss", "dataset_format")
# Choices the core accepts besides registered names.
EXTRA_CHOICES = {"strategy": ["auto"], "dataset_format": ["auto"], "export": [""]}
# Written into every recipe even at their defaults: a recipe should say what it trains on.
ALWAYS_WRITTEN = ("model", "dataset", "output", "loss")
# Fields whose value may be a path: checked against the UI's directories before a launch.
PATH_FIELDS = ("model", "dataset", "eval_dataset", "output", "resume")


@dataclasses.dataclass(frozen=True)
class Field:
    """One input of the form."""

    section: str | None            # None: a Recipe field; else the registered thing whose Config holds it
    kind: str | None               # the registry kind of ``section`` ("loss", "tuner", ...)
    name: str
    type: Any
    default: Any
    help: str
    flag: str | None               # the CLI flag, None when only a YAML section can set it
    negative: str | None = None    # ``--no-...`` for booleans
    choices: tuple[str, ...] = ()  # a fixed set (Literal) or the registered names
    custom: bool = False           # a value outside ``choices`` is allowed (model presets or a path)

    @property
    def key(self) -> str:
        return self.name if self.section is None else f"{self.section}.{self.name}"

    @property
    def shape(self) -> str:
        """How the page shows it: bool, int, float, choice, list, mapping or text."""
        if self.choices:
            return "choice"
        tp = _without_none(self.type)
        origin = get_origin(tp)
        if origin is list:
            return "list"
        if origin is dict:
            return "mapping"
        return {bool: "bool", int: "int", float: "float"}.get(tp, "text")

    @property
    def typed_as_text(self) -> bool:
        """An optional number: the page shows it as text, as a number box sends 0 for an empty box and "none"
        (grpo's epsilon: the default clip range; an MoE's aux_loss_coef: the model's own) would silently become 0."""
        return self.shape in ("int", "float") and type(None) in get_args(self.type)


def _without_none(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def _is_switch(tp: Any) -> bool:
    """``bool | None`` or ``bool | Literal["auto"]``: three states, which a checkbox cannot show."""
    if get_origin(tp) not in (typing.Union, types.UnionType):
        return False
    args = get_args(tp)
    return bool in args and all(a in (bool, type(None)) or get_origin(a) is Literal for a in args)


def _switch_choices(tp: Any) -> tuple[str, ...]:
    choices: list[str] = []
    for arg in get_args(tp):
        if arg is type(None):
            choices.insert(0, "")
        elif arg is bool:
            choices += ["true", "false"]
        else:
            choices += [str(a) for a in get_args(arg)]
    return tuple(choices)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def config_fields(cls: type, section: str | None, kind: str | None, flags: dict[str, Any] | None = None,
                  registry_choices: dict[str, list[str]] | None = None) -> list[Field]:
    """The fields of one Config dataclass (``flags``: its click options by field name, where it has flags)."""
    flags, registry_choices = flags or {}, registry_choices or {}
    hints = field_types(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name == "options":
            continue
        tp = hints[f.name]
        option = flags.get(f.name)
        choices: tuple[str, ...] = ()
        custom = False
        if section is None and f.name in registry_choices:
            choices = tuple(registry_choices[f.name])
        elif get_origin(_without_none(tp)) is Literal:
            choices = ("",) * (type(None) in get_args(tp)) + tuple(str(a) for a in get_args(_without_none(tp)))
        elif _is_switch(tp):
            choices = _switch_choices(tp)
        if section is None and f.name == "model":
            from toolkit.models import PRESETS

            choices, custom = tuple(PRESETS), True
        out.append(Field(section=section, kind=kind, name=f.name, type=tp, default=_default(f), help=f.metadata.get("help", "") or getattr(option, "help", ""),
                         flag=option.opts[0] if option is not None else None,
                         negative=option.secondary_opts[0] if option is not None and option.secondary_opts else None,
                         choices=choices, custom=custom))
    return out


def form_fields(manager: Any) -> list[Field]:
    """Every Recipe field, then every registered thing's Config fields, with the flags of the CLI."""
    from toolkit.commands.train import add_registered_options, recipe_options

    own = recipe_options()
    params: list[Any] = list(own)
    sections = add_registered_options(params, manager, OPTION_KINDS)
    plugin = params[len(own):]
    choices = {name: sorted(manager.registry(kind).names()) + EXTRA_CHOICES.get(name, [])
               for name, kind in NAMED_BY_REGISTRY.items()}
    fields = config_fields(Recipe, None, None, {o.name: o for o in own}, choices)
    by_thing: dict[str, dict[str, Any]] = {}
    for option in plugin:
        thing, name = sections[option.name]
        by_thing.setdefault(thing, {})[name] = option
    seen = set()
    for kind in OPTION_KINDS:
        for thing, cls in manager.registry(kind).items():
            if thing in seen:
                continue  # the core resolves a section name to the first kind that has it
            seen.add(thing)
            fields += config_fields(cls.Config, thing, kind, by_thing.get(thing, {}), {})
    return fields


def _names(value: Any) -> set[str]:
    """The registered names a value may hold: a string (``answer`` or ``answer:0.5``) or a list of them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return {part for item in items if isinstance(item, str) for part in (item.strip(), item.split(":")[0].strip())}


def active_sections(values: dict[str, Any], fields: list[Field], options: dict[str, dict[str, Any]] | None = None) -> set[str]:
    """The option sections that apply: every architecture's, the chosen strategy, tuner, optimizer, loss and
    dataset format, the --report-to trackers, and whatever the options of those name (toolkit-rl's
    ``rewards: [answer]`` brings the answer reward's section). ``options``: section -> its option values."""
    kinds = {f.section: f.kind for f in fields if f.section is not None}
    active = {section for section, kind in kinds.items() if kind == "architecture"}
    named = set().union(*(_names(values.get(name)) for name in (*CHOOSERS, "report_to")))
    while True:
        new = {section for section in kinds if section in named} - active
        if not new:
            return active
        active |= new
        named |= set().union(*(_names(v) for section in new for v in (options or {}).get(section, {}).values()))


def implied_choices(fields: list[Field], data: dict[str, Any]) -> dict[str, str]:
    """What a recipe file chooses by holding options only: ``{"loss": "dpo"}`` for a file with a ``dpo:``
    section and no ``loss:`` (one thing of that kind, nothing else of it)."""
    held = set(data) | set(data.get("options") or {})
    kinds = {f.section: f.kind for f in fields if f.section is not None}
    implied = {}
    for name in CHOOSERS:
        candidates = sorted(section for section in held if kinds.get(section) == name)
        if name not in data and name.replace("_", "-") not in data and len(candidates) == 1:
            implied[name] = candidates[0]
    return implied


def parse_widget(field: Field, raw: Any) -> Any:
    """What the page holds (text, number, checkbox) -> the field's value; ValueError naming the problem."""
    shape = field.shape
    if shape == "list":
        items = raw if isinstance(raw, list) else [part.strip() for part in str(raw or "").replace("\n", ",").split(",")]
        return coerce([item for item in items if item != ""], field.type)
    if shape == "mapping":
        if isinstance(raw, dict):
            return dict(raw)
        from toolkit.config import parse_pairs

        return parse_pairs(line for line in str(raw or "").splitlines() if line.strip())
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        if type(None) in get_args(field.type):
            return None
        if shape == "text" or field.default == "":
            return ""
        raise ValueError("give a value")
    return coerce(raw, field.type)


def widget_value(field: Field, value: Any) -> Any:
    """The field's value as the page shows it (the inverse of :func:`parse_widget`)."""
    if field.shape == "list":
        return ", ".join(str(v) for v in value or [])
    if field.shape == "mapping":
        return "\n".join(f"{k}={v}" for k, v in (value or {}).items())
    if field.typed_as_text:  # as the page holds it: a loaded recipe that sent None would count as a change
        return "" if value is None else str(value)
    if value is None:
        return None if field.shape in ("int", "float") else ""
    if isinstance(value, bool) and field.shape == "choice":
        return "true" if value else "false"
    if field.shape == "choice" or field.shape == "text":
        return str(value)
    return value


def _parsed(fields: list[Field], raw: dict[str, Any]) -> tuple[dict[str, Any], list[str], set[str]]:
    """Form values -> (values by key, problems, the sections that apply)."""
    parsed: dict[str, Any] = {}
    problems = []
    for field in fields:
        if field.key not in raw:
            continue
        try:
            parsed[field.key] = parse_widget(field, raw[field.key])
        except ValueError as exc:
            problems.append(f"{field.flag or field.key}: {exc}")
    top = {f.name: parsed[f.key] for f in fields if f.section is None and f.key in parsed}
    options: dict[str, dict[str, Any]] = {}
    for field in fields:
        if field.section is not None and field.key in parsed:
            options.setdefault(field.section, {})[field.name] = parsed[field.key]
    return parsed, problems, active_sections(top, fields, options)


def form_sections(fields: list[Field], raw: dict[str, Any]) -> set[str]:
    """The option sections the form shows for these values (:func:`active_sections`)."""
    return _parsed(fields, raw)[2]


def recipe_values(fields: list[Field], raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Form values (by :attr:`Field.key`) -> a recipe dict like the YAML (defaults left out), and problems."""
    parsed, problems, sections = _parsed(fields, raw)
    values: dict[str, Any] = {}
    for field in fields:
        if field.key not in parsed:
            continue
        value = parsed[field.key]
        if field.section is None:
            if value != field.default or field.name in ALWAYS_WRITTEN:
                values[field.name] = value
        elif field.section in sections and value != field.default:
            values.setdefault(field.section, {})[field.name] = value
    return values, problems


def values_from_recipe(fields: list[Field], data: dict[str, Any]) -> dict[str, Any]:
    """A recipe dict (a YAML file) -> form values by key; fields it does not set take their defaults, and
    a loss (tuner, ...) it does not name is the one whose options it holds (:func:`implied_choices`)."""
    data = {**data, **implied_choices(fields, data)}
    out = {}
    for field in fields:
        container = data if field.section is None else (data.get(field.section) or data.get("options", {}).get(field.section) or {})
        value = container.get(field.name, container.get(field.name.replace("_", "-"), field.default))
        if value is not None and field.section is None and field.shape not in ("list", "mapping"):
            value = coerce(value, field.type)
        out[field.key] = widget_value(field, value)
    return out


def recipe_yaml(values: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(values, sort_keys=False, allow_unicode=True)


def command_args(fields: list[Field], values: dict[str, Any], manager: Any) -> list[str]:
    """The ``toolkit`` arguments that train this recipe: ``["sft", "--model", "tiny-llama", ...]``.

    Raises when an option has no flag (a clash the CLI resolved by leaving it to YAML).
    """
    loss = values.get("loss", "sft")
    manager.registry("loss").get(loss)  # an unknown loss: named here, with the installed ones
    args = training_command(loss)
    by_key = {f.key: f for f in fields}
    for key, value in values.items():
        if isinstance(value, dict) and key not in by_key:
            pairs = [(by_key[f"{key}.{name}"], v) for name, v in value.items()]
        else:
            if key == "loss":
                continue
            pairs = [(by_key[key], value)]
        for field, item in pairs:
            args += _flag_args(field, item)
    return args


@functools.cache
def training_commands() -> dict[str, str]:
    """Loss name -> the ``toolkit`` command that trains it: the loss's own (``toolkit focal``, and
    ``toolkit grpo``, which runs toolkit-rl's loop, not the core's runner), from the CLI itself."""
    from toolkit.cli import build_cli
    from toolkit.commands.help import TrainingCommand

    return {command.loss: name for name, command in build_cli().commands.items()
            if isinstance(command, TrainingCommand) and command.loss}


def training_command(loss: str) -> list[str]:
    """``["grpo"]``, ``["sft"]``, or ``["train", "--loss", NAME]`` for a loss without a command of its own."""
    command = training_commands().get(loss)
    return [command] if command else ["train", "--loss", loss]


def _flag_args(field: Field, value: Any) -> list[str]:
    if field.flag is None:
        raise ToolkitError(f"option {field.key} has no command-line flag (its name clashes with another); "
                           "save the recipe and run it with --config FILE")
    if field.shape == "bool" or (isinstance(value, bool) and field.negative):
        return [field.flag] if value else [field.negative or f"--no-{field.flag[2:]}"]
    if field.shape == "list":
        return [part for item in value for part in (field.flag, str(item))]
    if field.shape == "mapping":
        return [part for k, v in value.items() for part in (field.flag, f"{k}={v}")]
    if value is None:
        return [field.flag, "none"]
    return [field.flag, str(value)]


def shell_command(args: list[str], nproc: int = 1) -> str:
    """What to type in a shell: ``toolkit sft ...`` or, on several processes, ``toolkit launch --nproc N sft ...``."""
    prefix = ["toolkit"] if nproc <= 1 else ["toolkit", "launch", "--nproc", str(nproc)]
    return shlex.join(prefix + args)
