"""The ``toolkit`` commands written in README.md, docs/ and the plugin READMEs stay true.

Every command line in a code block is parsed by the real CLI (subcommand, flags, arguments;
nothing runs), and the cheap ones (``--help``, ``plugins``, ``data inspect``, ``plan``) are run.
A renamed flag or command, or a doc that invents one, fails here with the file and line.
"""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("plugins/*/README.md"))]
PLACEHOLDER = re.compile(r"\.\.\.|<|^[A-Z][A-Z_]+$|^\[")  # `toolkit sft ...`, `<loss>`, `NAME`, `[--json]`
CHEAP = ("plugins", "plan", "data")
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
DIAGRAM = re.compile(r"->|[└├│]")  # hooks.md draws the order hooks fire in with commands as labels


def _toolkit_args(tokens: list[str]) -> list[str] | None:
    """The arguments after ``toolkit`` (or ``python -m toolkit``, ``torchrun ... -m toolkit``)."""
    for index, token in enumerate(tokens):
        if (token == "toolkit" or token.endswith("/bin/toolkit")) and (index == 0 or tokens[index - 1] == "-m"):
            return tokens[index + 1:]
    return None


def code_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of the shell code in ``page``: fenced shell blocks and indented blocks,
    continuation lines (``\\``) joined; a fenced block that draws (arrows, tree lines) is not code."""
    lines, block, fenced, tag = [], [], False, ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            if fenced and tag in SHELL_BLOCKS and not any(DIAGRAM.search(text) for _, text in block):
                lines += block
            fenced, tag, block = not fenced, line.strip().removeprefix("```"), []
        elif fenced:
            block.append((number, line))
        elif line.startswith("    "):
            lines.append((number, line))
    joined: list[tuple[int, str]] = []
    for number, line in lines:
        if joined and joined[-1][1].endswith("\\"):
            joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
        else:
            joined.append((number, line.strip()))
    return joined


def documented_commands() -> list[tuple[str, list[str]]]:
    """(``file:line``, args) for every ``toolkit`` command in the code of the pages."""
    found = []
    for page in PAGES:
        for number, line in code_lines(page):
            for part in re.split(r"\s+(?:&&|;|\|)\s+", line):
                try:
                    tokens = shlex.split(part, comments=True)
                except ValueError:
                    continue
                args = _toolkit_args(tokens)
                if args and not any(PLACEHOLDER.search(token) for token in args):
                    found.append((f"{page.relative_to(ROOT)}:{number}", args))
    return found


COMMANDS = documented_commands()


def _launched(args: list[str]) -> list[str]:
    """``launch --nproc 2 sft ...`` -> ``sft ...`` (the command launch runs is parsed too)."""
    from toolkit.commands.launch import launch_command

    context = launch_command.make_context("launch", args)
    return list(context.params["args"])


def parse(args: list[str]) -> None:
    """Parse ``toolkit ARGS`` down to the last subcommand without running anything."""
    from toolkit.cli import build_cli

    command: click.Command = build_cli()
    name = "toolkit"
    while True:
        context = command.make_context(name, list(args), resilient_parsing=False)
        if not isinstance(command, click.Group):
            return
        with warnings.catch_warnings():  # click 8.2 deprecates protected_args; 9.0 puts them in args
            warnings.simplefilter("ignore", DeprecationWarning)
            rest = [*getattr(context, "protected_args", []), *context.args]
        if not rest:
            return
        name, *args = rest
        if name not in command.commands:
            pytest.skip(f"'toolkit {name}' is not registered here (its plugin is not installed)")
        command = command.commands[name]
        if name == "launch":
            inner = _launched(args)
            if inner:
                parse(inner)
            return


def _missing_input(args: list[str]) -> str | None:
    """A model, recipe or dataset path of the example that is not in this repository (``./my-model``)."""
    from toolkit.models import PRESETS

    values = [value for flag, value in zip(args, args[1:]) if flag in ("--model", "--config", "--dataset")]
    if args[:2] == ["data", "inspect"] and len(args) > 2:
        values.append(args[2])
    return next((v for v in values if v not in PRESETS and ("/" in v or "." in v) and not (ROOT / v).exists()), None)


def test_the_docs_hold_toolkit_commands():
    pages = {where.split(":")[0] for where, _ in COMMANDS}
    assert len(COMMANDS) > 40 and {"README.md", "docs/getting-started.md", "docs/megatron.md"} <= pages


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_a_documented_command_parses(where, args, monkeypatch):
    monkeypatch.chdir(ROOT)
    try:
        parse(args)
    except click.exceptions.Exit:  # --help, --version
        pass
    except click.UsageError as exc:
        pytest.fail(f"{where}: toolkit {shlex.join(args)}: {exc.format_message()}")


@pytest.mark.parametrize(("where", "args"), [c for c in COMMANDS if c[1][0] in CHEAP or "--help" in c[1]],
                         ids=[w for w, a in COMMANDS if a[0] in CHEAP or "--help" in a])
def test_a_cheap_documented_command_runs(where, args, cli_runner, monkeypatch):
    monkeypatch.chdir(ROOT)
    missing = _missing_input(args)
    if missing:
        pytest.skip(f"{where}: needs the reader's own {missing}")
    result = cli_runner.invoke(*args)
    assert result.exit_code == 0, f"{where}: toolkit {shlex.join(args)} failed:\n{result.output[-2000:]}"


@pytest.mark.parametrize("args", [["sft", "--max-step", "3"], ["data", "inspect"], ["launch", "--nproc", "2", "sft", "--tp2"]])
def test_a_command_the_cli_does_not_take_is_caught(args):
    with pytest.raises(click.UsageError):
        parse(args)
