"""Training commands: one per registered loss (``toolkit sft``, ``toolkit dpo``) and ``toolkit train``.

Flags are generated from :class:`toolkit.recipe.Recipe` and from the ``Config`` dataclass of
every registered strategy, tuner, loss and dataset format (``--lora-rank``, ``--dpo-beta``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin

import click

from toolkit.config import describe_type, field_types, flag_name
from toolkit.contracts import member
from toolkit.recipe import OPTION_KINDS, Recipe, replacement_flag


def _click_type(tp: Any) -> tuple[Any, bool]:
    """(click type, is_list) for a dataclass field type."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if bool in args:  # ``bool | Literal["auto"]``: an on/off flag pair; leaving both out keeps the default
            return bool, False
        return _click_type(args[0]) if len(args) == 1 else (str, False)
    if origin is Literal:
        return click.Choice([str(a) for a in get_args(tp)]), False
    if origin is list:
        return _click_type(get_args(tp)[0])[0], True
    if origin is dict:
        return str, True
    return {int: int, float: float, str: str, bool: bool}.get(tp, str), False


def _metavar(tp: Any) -> str:
    """``int`` -> ``INT``; ``str | None`` -> ``STR`` (leaving a flag out is how one says None)."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        tp = args[0] if len(args) == 1 else tp
    return describe_type(tp).upper()


def _deprecation_help(replaced_by: str) -> str:
    """The help of a plugin field that ``option(replaced_by=...)`` retired in favour of a core option."""
    return f"Deprecated: use {replacement_flag(replaced_by)} (one flag for every strategy); this value is moved there with a warning."


def _options_for(cls: type, prefix: str | None, dest_prefix: str) -> list[click.Option]:
    options = []
    hints = field_types(cls)
    for field in dataclasses.fields(cls):
        if field.name == "options":
            continue
        tp = hints[field.name]
        ctype, is_list = _click_type(tp)
        flag = flag_name(prefix, field)
        help_text = field.metadata.get("help", "")
        if not help_text and field.metadata.get("replaced_by"):
            help_text = _deprecation_help(field.metadata["replaced_by"])
        dest = f"{dest_prefix}{field.name}"
        names = [flag, *field.metadata.get("aliases", ())]
        if ctype is bool:
            negative = "--no-" + flag[2:]
            options.append(click.Option([f"{flag}/{negative}", dest], default=None, help=help_text))
        elif is_list:
            is_dict = get_origin(tp) is dict
            help_text += " (repeatable" + (", KEY=VALUE)" if is_dict else ")")
            options.append(click.Option([*names, dest], type=ctype, multiple=True, default=None, help=help_text,
                                        callback=key_value_pairs if is_dict else None))
        else:
            default = field.default if field.default is not dataclasses.MISSING else None
            show = f" [default: {default}]" if default not in (None, "") else ""
            options.append(click.Option([*names, dest], type=ctype, default=None, help=help_text + show,
                                        metavar=_metavar(tp) if ctype in (int, float, str) else None))
    return options


def key_value_pairs(ctx: click.Context, param: click.Parameter, value: tuple[str, ...] | None) -> dict[str, str] | None:
    """``--columns instruction=question`` (repeatable) -> ``{"instruction": "question"}``."""
    if not value:
        return None
    from toolkit.config import parse_pairs

    try:
        return parse_pairs(value, "--columns instruction=question")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def collect_values(params: dict[str, Any], sections: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Flags the user actually set, as a nested dict like a YAML recipe.

    ``sections`` maps the parameter name of a plugin option to its (section, field).
    """
    values: dict[str, Any] = {}
    for key, value in params.items():
        if value is None or value == ():
            continue
        if key in sections:
            section, name = sections[key]
            values.setdefault(section, {})[name] = list(value) if isinstance(value, tuple) else value
        elif key in ("config", "debug"):
            continue
        else:
            values[key] = list(value) if isinstance(value, tuple) else value
    return values


def add_registered_options(params: list[click.Parameter], manager: Any, kinds: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Append ``--<name>-<field>`` options for the ``Config`` of every registered thing of ``kinds``
    to ``params`` (skipping flags already taken); returns parameter name -> (section, field),
    for :func:`collect_values`."""
    taken = {flag for p in params for flag in (*p.opts, *p.secondary_opts)}
    sections: dict[str, tuple[str, str]] = {}
    for kind in kinds:
        for thing_name, cls in manager.registry(kind).items():
            # Parameter names must be identifiers; thing names may hold dashes.
            prefix = f"opt{len(sections)}_{kind}__"
            for opt in _options_for(cls.Config, thing_name, prefix):
                flags = {*opt.opts, *opt.secondary_opts}
                if flags & taken:
                    continue  # e.g. a thing named "seq" with a field "len": the YAML section still works
                taken |= flags
                sections[opt.name] = (thing_name, opt.name.removeprefix(prefix))
                params.append(opt)
    return sections


def dataclass_options(cls: type) -> list[click.Option]:
    """The flags of a dataclass's fields (``--NAME`` or the field's ``flag``), each option named after its field."""
    return _options_for(cls, None, "")


def recipe_options() -> list[click.Option]:
    """The flags of :class:`Recipe`'s own fields (``--model``, ``--tp``); each option's name is its field's.

    With :func:`add_registered_options` this is the training commands' whole flag table, which
    toolkit-webui writes its command lines from, so they parse back to the same recipe.
    """
    return dataclass_options(Recipe)


def make_training_command(name: str, loss: str | None, help_text: str, manager: Any,
                          run: Callable[[Recipe], Any] | None = None) -> click.Command:
    """``toolkit <name>``: every Recipe flag and every registered thing's options, merged with ``--config``.

    ``run`` trains from the resolved recipe (default: :func:`toolkit.train.runner.run_training`); a
    plugin with its own loop (toolkit-rl's ``grpo``: rollouts between optimizer steps) passes its own.
    """
    params: list[click.Parameter] = [
        click.Option(["--config", "config"], type=click.Path(dir_okay=False), default=None,
                     help="YAML recipe; flags given on the command line override it."),
    ]
    params += recipe_options()
    sections = add_registered_options(params, manager, OPTION_KINDS)

    def callback(**kwargs: Any) -> None:
        from toolkit.recipe import read_yaml, resolve_recipe

        config = kwargs.get("config")
        values = read_yaml(config) if config else {}
        if values.get("trust_remote_code") is True and not kwargs.get("trust_remote_code"):
            raise click.UsageError(f"{config} sets trust_remote_code: true; the model's own code runs only when "
                                   "--trust-remote-code is given on this command line")
        flags = collect_values(kwargs, sections)
        for key, value in flags.items():
            if isinstance(value, dict) and isinstance(values.get(key), dict):
                values[key] = {**values[key], **value}
            else:
                values[key] = value
        if loss is not None:
            if "loss" in values and values["loss"] != loss:
                raise click.UsageError(f"'toolkit {name}' trains with loss {loss!r}; the recipe asks for {values['loss']!r}. Use 'toolkit train' to choose the loss in the recipe.")
            values["loss"] = loss
        recipe = resolve_recipe(values, source=config or "command line", manager=manager)
        if run is not None:
            run(recipe)
            return
        from toolkit.train.runner import run_training

        run_training(recipe, raise_if_stopped=True)

    from toolkit.commands.help import TrainingCommand

    return TrainingCommand(name, params=params, callback=callback, help=help_text, short_help=help_text.split("\n")[0],
                           context_settings={"max_content_width": 110}, sections=sections, loss=loss)


def add_training_commands(cli: click.Group) -> None:
    from toolkit.plugins import get_plugin_manager

    manager = get_plugin_manager()

    for loss_name, cls in manager.registry("loss").items():
        if member(cls, "loss", "cli_command") and loss_name not in cli.commands:
            doc = (cls.__doc__ or f"Train with the {loss_name} objective.").strip()
            cli.add_command(make_training_command(loss_name, loss_name, doc, manager))
    cli.add_command(make_training_command("train", None, "Train with any registered objective (--loss NAME).", manager))
