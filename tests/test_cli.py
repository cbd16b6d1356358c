"""The ``toolkit`` CLI: assembled from plugins, cheap to start, one-paragraph errors, --debug."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import click
import pytest

from conftest import PROBE_FLAGS
from toolkit import hookimpl
from toolkit.testing import write_plugin_distribution

OOPS_PLUGIN = '''
import click
from toolkit import hookimpl
from toolkit.errors import ToolkitError

@click.command("oops")
def oops():
    """Fail the way a bad input fails."""
    raise ToolkitError("the frobnicator file x.yaml is missing; create it with 'toolkit frob init'")

@hookimpl
def toolkit_register_commands(cli):
    cli.add_command(oops)
'''


def python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKIT_")}
    environment.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environment, timeout=120)


# Prints which heavy modules the command imported, at interpreter exit (after sys.exit).
HEAVY_PROBE = """
import atexit, sys
heavy = ("torch", "transformers")
atexit.register(lambda: print("HEAVY:" + ",".join(m for m in heavy if m in sys.modules), file=sys.stderr))
from toolkit.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("args", [["--help"], ["plugins"], ["plugins", "--json"]])
def test_help_and_plugins_do_not_import_torch(args):
    result = python("-c", HEAVY_PROBE, *args)
    assert result.returncode == 0, result.stderr
    heavy = [line for line in result.stderr.splitlines() if line.startswith("HEAVY:")]
    assert heavy == ["HEAVY:"], f"'toolkit {' '.join(args)}' imported {heavy}; move heavy imports inside functions"


def test_python_dash_m_toolkit_runs_the_cli():
    result = python("-m", "toolkit", "--version")
    assert result.returncode == 0 and "toolkit, version" in result.stdout
    result = python("-m", "toolkit", "plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert {"toolkit.commands", "toolkit.losses"} <= {row["name"] for row in rows}
    assert all(row["error"] is None for row in rows if row["distribution"] == "toolkit")


def test_core_commands_are_registered_like_plugin_commands(probe_manager, cli_runner):
    result = cli_runner.invoke("--help")
    assert result.exit_code == 0
    for command in ("plugins", "train", "export", "infer", "serve", "data", "launch", "probe"):
        assert f"  {command} " in result.stdout, command


def test_each_registered_loss_is_a_training_command_with_its_options(probe_manager, cli_runner):
    result = cli_runner.invoke("probe", "--strategy", "probe-strategy", "--tuner", "probe-tuner", "--help")
    assert result.exit_code == 0, result.output
    assert "Train with the probe objective" in result.stdout
    for flag in ("--model", "--dataset", "--tp", "--probe-weight", "--probe-mode [sum|mean]", "--probe-strategy-buckets",
                 "--probe-tuner-layers", "--probe-warm / --no-probe-warm"):
        assert flag in result.stdout, flag
    assert "Options of the tuner 'probe-tuner':" in result.stdout and "Options of the loss 'probe':" in result.stdout


def test_help_shows_the_options_of_the_components_in_use_and_help_all_every_one(probe_manager, cli_runner, tmp_path):
    plain = cli_runner.invoke("sft", "--help").stdout
    assert "--model" in plain and "--probe-weight" not in plain and "--probe-tuner-layers" not in plain
    assert "are not shown: name one (e.g. --tuner lora --help) or use --help-all" in " ".join(plain.split())
    chosen = cli_runner.invoke("sft", "--tuner", "probe-tuner", "--help").stdout
    assert "--probe-tuner-layers" in chosen and "--probe-strategy-buckets" not in chosen
    used = cli_runner.invoke("sft", "--probe-strategy-buckets", "3", "--help").stdout  # a flag in use shows its section
    assert "--probe-strategy-buckets" in used
    recipe = tmp_path / "r.yaml"
    recipe.write_text("strategy: probe-strategy\n")
    assert "--probe-strategy-buckets" in cli_runner.invoke("sft", "--config", str(recipe), "--help").stdout
    everything = cli_runner.invoke("sft", "--help-all")
    assert everything.exit_code == 0
    for flag in ("--probe-weight", "--probe-tuner-layers", "--probe-strategy-buckets"):
        assert flag in everything.stdout
    assert len(everything.stdout.splitlines()) > len(plain.splitlines())
    # hidden flags still parse: help is about showing, not accepting
    assert cli_runner.invoke("sft", "--probe-strategy-buckets", "x").exit_code == 2


def test_unknown_subcommand_is_one_paragraph_with_a_suggestion(probe_manager, cli_runner):
    result = cli_runner.invoke("plugin")
    assert result.exit_code == 2 and result.exception is None
    assert "unknown command 'plugin'. Did you mean 'plugins'?" in result.stderr
    assert "see 'toolkit plugins'" in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_unknown_flag_is_one_paragraph(probe_manager, cli_runner):
    result = cli_runner.invoke("probe", *PROBE_FLAGS[2:], "--probe-wieght", "2")
    assert result.exit_code == 2 and result.exception is None
    assert "No such option '--probe-wieght'" in result.stderr and "--probe-weight" in result.stderr
    assert "See 'toolkit probe --help'." in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1


def test_bad_flag_value_is_one_paragraph(probe_manager, cli_runner):
    result = cli_runner.invoke("probe", "--probe-mode", "median")
    assert result.exit_code == 2
    assert "'median' is not one of 'sum', 'mean'" in result.stderr and "Traceback" not in result.output


def test_toolkit_error_is_short_and_debug_shows_the_traceback(tmp_path):
    site = tmp_path / "site"
    write_plugin_distribution(site, "toolkit-oops", OOPS_PLUGIN)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}

    plain = python("-m", "toolkit", "oops", env=env)
    assert plain.returncode == 1
    assert plain.stderr.splitlines() == [
        "Error: the frobnicator file x.yaml is missing; create it with 'toolkit frob init'",
        "(run with --debug for the traceback)",
    ]
    for args in (["--debug", "oops"], ["oops", "--debug"]):
        debug = python("-m", "toolkit", *args, env=env)
        assert debug.returncode == 1
        assert "Traceback (most recent call last)" in debug.stderr and "ToolkitError: the frobnicator" in debug.stderr


def test_bad_key_value_flag(probe_manager, cli_runner, captured_runs):
    result = cli_runner.invoke("probe", *PROBE_FLAGS[2:], "--columns", "instruction")
    assert result.exit_code == 2 and "expected KEY=VALUE (for example --columns instruction=question), got 'instruction'" in result.stderr
    assert captured_runs == []


def test_a_command_name_clash_keeps_the_first_and_names_both(toolkit_manager, cli_runner):
    @click.command("plugins")
    def impostor():
        click.echo("impostor")

    class clashing:  # noqa: N801
        @staticmethod
        @hookimpl
        def toolkit_register_commands(cli):
            cli.add_command(impostor)

    toolkit_manager(("clashing", clashing), installed=False)
    result = cli_runner.invoke("plugins", "--json")
    assert result.exit_code == 0 and "impostor" not in result.stdout
    assert "command 'plugins' is registered twice: by plugin 'toolkit.commands' and by plugin 'clashing'" in result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert "plugins" in rows["toolkit.commands"]["registers"]["command"]
    assert "command" not in rows["clashing"]["registers"]
