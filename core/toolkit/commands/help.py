"""``--help`` of the training commands: the core's options and those of the components in use.

Every registered strategy, tuner, loss, dataset format, architecture and reward adds its options to
every training command (``--lora-rank``, ``--dpo-beta``), so the whole table is long. ``--help``
shows the core's options, then one section per component the command line (or its ``--config``)
chooses, by name (``--tuner lora``) or by default (``--strategy local``, ``toolkit dpo``'s loss), or
whose flags it uses; ``--help-all`` shows every section. Parsing is unchanged: every flag is accepted
whether its section is shown or not.
"""

from __future__ import annotations

import re
from typing import Any

import click

CHOOSERS = {"strategy": "--strategy", "tuner": "--tuner", "optimizer": "--optimizer", "loss": "--loss", "dataset_format": "--dataset-format"}
OWNER = re.compile(r"^opt\d+_(?P<kind>[a-z_]+?)__")


def flag_value(args: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in raw ``args`` (``--flag V`` or ``--flag=V``), the last one winning."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def chosen_components(args: list[str], loss: str | None) -> dict[str, set[str]]:
    """kind -> the component names the raw command line (and its ``--config`` file) selects, defaults
    included; callbacks are the trackers ``--report-to`` names."""
    from toolkit.recipe import Recipe

    chosen = {"strategy": Recipe.strategy, "tuner": Recipe.tuner, "loss": loss or Recipe.loss}
    trackers = {t for i, a in enumerate(args[:-1]) if a == "--report-to" for t in args[i + 1].split(",")}
    trackers |= {t for a in args if a.startswith("--report-to=") for t in a.split("=", 1)[1].split(",")}
    config = flag_value(args, "--config")
    if config:
        import yaml

        try:
            with open(config) as handle:
                values = yaml.safe_load(handle) or {}
        except (OSError, yaml.YAMLError):  # the run itself reports a bad file
            values = {}
        if isinstance(values, dict):
            chosen.update({kind: str(values[kind]) for kind in CHOOSERS if values.get(kind)})
            trackers |= {str(t) for t in values.get("report_to") or []} if isinstance(values.get("report_to"), list) else set()
    for kind, flag in CHOOSERS.items():
        value = flag_value(args, flag)
        if value and (kind != "loss" or loss is None):
            chosen[kind] = value
    return {**{kind: {name} for kind, name in chosen.items()}, "callback": trackers}


class TrainingCommand(click.Command):
    """A training command whose help groups the registered components' options by component and
    shows only those in use (``--help-all``: all)."""

    def __init__(self, *args: Any, sections: dict[str, tuple[str, str]], loss: str | None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sections, self.loss = sections, loss
        self.params.append(click.Option(["--help-all"], is_flag=True, expose_value=False, is_eager=True,
                                        callback=self._help_all, help="Show the options of every installed component."))

    def _help_all(self, ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            ctx.meta["toolkit.help_all"] = True
            click.echo(ctx.get_help(), color=ctx.color)
            ctx.exit()

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["toolkit.args"] = list(args)
        return super().parse_args(ctx, args)

    def owner(self, param: click.Parameter) -> tuple[str, str] | None:
        """(kind, component) of a registered component's option; None for the core's own."""
        match = OWNER.match(param.name or "")
        if not match or param.name not in self.sections:
            return None
        return match.group("kind"), self.sections[param.name][0]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        args = ctx.meta.get("toolkit.args", [])
        show_all = bool(ctx.meta.get("toolkit.help_all"))
        chosen = chosen_components(args, self.loss)
        used = {a.split("=", 1)[0] for a in args if a.startswith("--")}
        core: list[tuple[str, str]] = []
        groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
        hidden: set[tuple[str, str]] = set()
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            owner = self.owner(param)
            if owner is None:
                core.append(record)
            elif show_all or owner[1] in chosen.get(owner[0], ()) or used & {*param.opts, *param.secondary_opts}:
                groups.setdefault(owner, []).append(record)
            else:
                hidden.add(owner)
        with formatter.section("Options"):
            formatter.write_dl(core)
        for (kind, name), records in groups.items():
            with formatter.section(f"Options of the {kind.replace('_', ' ')} {name!r}"):
                formatter.write_dl(records)
        hidden -= set(groups)
        if hidden:
            formatter.write_paragraph()
            kinds = sorted({kind.replace("_", " ") for kind, _ in hidden})
            formatter.write_text(f"Options of {len(hidden)} other installed components ({', '.join(kinds)}) are not shown: "
                                 f"name one (e.g. --tuner lora --help) or use --help-all.")
