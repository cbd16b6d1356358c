"""The plugin manager: entry-point discovery, broken-plugin isolation, allow/block lists, registries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from conftest import ProbeLoss, probe_plugin
from toolkit import hookimpl
from toolkit.errors import RegistryError
from toolkit.plugins import FIRST_PARTY, build_plugin_manager, plural
from toolkit.testing import write_plugin_distribution

GOOD_PLUGIN = '''
import dataclasses
from toolkit import hookimpl

class {cls}:
    """A loss from {dist}."""
    name = "{loss}"

    @dataclasses.dataclass(kw_only=True)
    class Config:
        pass

    def __init__(self, config):
        self.config = config

@hookimpl
def toolkit_register_losses(register):
    register({cls})
'''


def good_plugin(loss: str, dist: str = "toolkit-x", cls: str = "ALoss") -> str:
    return GOOD_PLUGIN.format(loss=loss, dist=dist, cls=cls)


def run_toolkit(*args: str, site=None, env=None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKIT_")}
    if site is not None:
        environment["PYTHONPATH"] = os.pathsep.join([str(site), environment.get("PYTHONPATH", "")])
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, env=environment, timeout=120)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path where tests write throwaway installed distributions."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    for name in ("TOOLKIT_PLUGINS", "TOOLKIT_DISABLE_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    yield path
    for name, module in list(sys.modules.items()):  # the next test writes other modules of the same name
        if str(getattr(module, "__file__", "") or "").startswith(str(path)):
            del sys.modules[name]


def test_builtins_are_discovered_through_the_entry_point_group():
    declared = {ep.name: ep.value for ep in metadata.distribution("toolkit-core").entry_points if ep.group == "toolkit"}
    assert "toolkit.commands" in declared and len(declared) >= 5
    manager = build_plugin_manager()
    loaded = {p.name: p for p in manager.plugins}
    for name, module in declared.items():
        assert loaded[name].distribution == "toolkit-core"
        assert loaded[name].module == module
        assert loaded[name].error is None
    assert "toolkit_register_commands" in loaded["toolkit.commands"].hooks


def test_a_plugin_that_raises_on_import_is_one_line_and_the_cli_still_works(tmp_path):
    site = tmp_path / "site"
    write_plugin_distribution(site, "toolkit-broken", "raise ImportError('needs libfoo 3.1, found 2.0')", version="0.4.2")
    write_plugin_distribution(site, "toolkit-fine", good_plugin("fine-loss", "toolkit-fine"), version="1.0")

    listed = run_toolkit("plugins", site=site)
    assert listed.returncode == 0, listed.stderr
    lines = [line for line in listed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, listed.stderr
    assert "broken" in lines[0] and "0.4.2" in lines[0] and "needs libfoo 3.1, found 2.0" in lines[0]
    assert "Traceback" not in listed.stderr
    assert "fine  (toolkit-fine 1.0)" in listed.stdout and "loss: fine-loss" in listed.stdout
    assert "broken  (toolkit-broken 0.4.2)  FAILED: ImportError" in listed.stdout

    helped = run_toolkit("--help", site=site)
    assert helped.returncode == 0 and "plugins" in helped.stdout
    assert "fine-loss" in helped.stdout  # the healthy plugin's loss became a command

    debug = run_toolkit("--debug", "plugins", site=site)
    assert debug.returncode == 0 and "Traceback" in debug.stderr  # --debug shows where it broke


def test_a_plugin_whose_registration_raises_keeps_the_rest(toolkit_manager):
    class half_broken:  # noqa: N801
        @staticmethod
        @hookimpl
        def toolkit_register_losses(register):
            raise RuntimeError("bad config table")

    manager = toolkit_manager(("probe", probe_plugin), ("half-broken", half_broken), installed=False)
    assert manager.get("loss", "probe") is ProbeLoss
    info = next(p for p in manager.plugins if p.name == "half-broken")
    assert info.error == "RuntimeError: bad config table"


def test_allow_list_loads_only_named_plugins_and_the_builtins(site, monkeypatch):
    write_plugin_distribution(site, "toolkit-aa", good_plugin("aa-loss", "toolkit-aa"))
    write_plugin_distribution(site, "toolkit-bb", good_plugin("bb-loss", "toolkit-bb"))
    monkeypatch.setenv("TOOLKIT_PLUGINS", "aa")
    names = {p.name for p in build_plugin_manager().plugins}
    assert "aa" in names and "bb" not in names and "toolkit.commands" in names


def test_block_list_skips_named_plugins_including_builtins(site, monkeypatch):
    write_plugin_distribution(site, "toolkit-aa", good_plugin("aa-loss", "toolkit-aa"))
    write_plugin_distribution(site, "toolkit-bb", good_plugin("bb-loss", "toolkit-bb"))
    monkeypatch.setenv("TOOLKIT_DISABLE_PLUGINS", "bb, toolkit.commands")
    manager = build_plugin_manager()
    names = {p.name for p in manager.plugins}
    assert "aa" in names and "bb" not in names and "toolkit.commands" not in names
    assert "aa-loss" in manager.registry("loss") and "bb-loss" not in manager.registry("loss")


def test_duplicate_names_name_both_plugins(site):
    write_plugin_distribution(site, "toolkit-aa", good_plugin("same", "toolkit-aa"))
    write_plugin_distribution(site, "toolkit-bb", good_plugin("same", "toolkit-bb"))
    manager = build_plugin_manager()
    with pytest.raises(RegistryError) as error:
        manager.registry("loss")
    assert "'same'" in str(error.value) and "'aa'" in str(error.value) and "'bb'" in str(error.value)
    assert "TOOLKIT_DISABLE_PLUGINS" in str(error.value)


def test_duplicate_names_on_the_cli_are_one_line_naming_both(tmp_path):
    site = tmp_path / "site"
    write_plugin_distribution(site, "toolkit-aa", good_plugin("same", "toolkit-aa"))
    write_plugin_distribution(site, "toolkit-bb", good_plugin("same", "toolkit-bb"))
    result = run_toolkit("--help", site=site)
    assert result.returncode == 0  # the CLI still starts; the conflict is reported
    assert "Traceback" not in result.stderr
    assert "'same' is registered twice" in result.stderr and "'aa'" in result.stderr and "'bb'" in result.stderr


@pytest.mark.parametrize("spelling", ["toolkit_register_loss", "register_losses", "toolkit_register_lossses"])
def test_a_misspelled_hook_implementation_is_rejected(toolkit_manager, capsys, spelling):
    def register(register):
        register(ProbeLoss)

    register.__name__ = spelling
    namespace = type("typo_plugin", (), {spelling: staticmethod(hookimpl(register))})
    manager = toolkit_manager(("typo", namespace), installed=False)
    info = next(p for p in manager.plugins if p.name == "typo")
    assert info.error is not None and spelling in info.error
    assert "probe" not in manager.registry("loss")
    assert "did you mean toolkit_register_losses" in capsys.readouterr().err
    assert not manager.pm.has_plugin("typo")


def test_unknown_first_party_name_says_what_to_install(probe_manager):
    for (kind, name), distribution in FIRST_PARTY.items():
        if name in probe_manager.registry(kind):
            continue  # installed in this environment
        with pytest.raises(RegistryError) as error:
            probe_manager.get(kind, name)
        assert f"pip install {distribution}" in str(error.value)
        assert f"Installed {plural(kind)}:" in str(error.value)


def test_unknown_name_lists_installed_and_suggests_the_closest(probe_manager):
    with pytest.raises(RegistryError) as error:
        probe_manager.get("loss", "prob")
    message = str(error.value)
    assert "unknown loss 'prob'" in message and "did you mean 'probe'" in message
    assert "probe" in message.split("Installed losses:")[1]


def test_unknown_kind_and_nameless_class_are_errors(probe_manager, toolkit_manager):
    with pytest.raises(RegistryError, match="no registry kind 'losses'"):
        probe_manager.registry("losses")

    class nameless:  # noqa: N801
        @staticmethod
        @hookimpl
        def toolkit_register_losses(register):
            register(type("NoName", (), {}))

    manager = toolkit_manager(("nameless", nameless), installed=False)
    with pytest.raises(RegistryError, match="'nameless' registered a loss without a 'name'"):
        manager.registry("loss")


def test_create_instantiates_with_default_or_given_options(probe_manager):
    loss = probe_manager.create("loss", "probe")
    assert loss.config == ProbeLoss.Config()
    loss = probe_manager.create("loss", "probe", ProbeLoss.Config(weight=2.0))
    assert loss.config.weight == 2.0
    assert probe_manager.registry("loss").owner("probe") == "probe"


def test_plugins_json_lists_distributions_versions_and_registered_names(probe_manager, cli_runner):
    result = cli_runner.invoke("plugins", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert set(rows["probe"]) == {"name", "distribution", "version", "module", "hooks", "registers", "error"}
    assert rows["probe"]["registers"] == {"loss": ["probe"], "strategy": ["probe-strategy"], "tuner": ["probe-tuner"]}
    assert rows["probe"]["distribution"] == "(in-process)"
    assert rows["toolkit.commands"]["distribution"] == "toolkit-core"
    assert rows["toolkit.commands"]["version"] == metadata.version("toolkit-core")
    assert rows["probe"]["hooks"] == ["toolkit_register_losses", "toolkit_register_strategies", "toolkit_register_tuners"]


def test_a_misspelled_allow_or_block_entry_is_reported(site, monkeypatch, capsys):
    write_plugin_distribution(site, "toolkit-aa", good_plugin("aa-loss", "toolkit-aa"))
    monkeypatch.setenv("TOOLKIT_PLUGINS", "a")
    monkeypatch.setenv("TOOLKIT_DISABLE_PLUGINS", "zz")
    build_plugin_manager()
    err = capsys.readouterr().err
    assert "TOOLKIT_PLUGINS names a, which no installed plugin is called" in err and "aa" in err.split("plugins:")[1]
    assert "TOOLKIT_DISABLE_PLUGINS names zz" in err


def test_two_distributions_with_one_plugin_name_load_the_first_and_say_so(site, capsys):
    write_plugin_distribution(site, "toolkit-aa", good_plugin("aa-loss", "toolkit-aa"), entry_point="same")
    write_plugin_distribution(site, "toolkit-bb", good_plugin("bb-loss", "toolkit-bb"), entry_point="same")
    manager = build_plugin_manager()
    (loaded,) = [p.distribution for p in manager.plugins if p.name == "same"]
    other = ({"toolkit-aa", "toolkit-bb"} - {loaded}).pop()
    assert f"plugin name 'same' is provided by {loaded} 0.0.1 and by {other} 0.0.1" in capsys.readouterr().err


def test_entry_points_of_another_metadata_library_still_load(monkeypatch):
    """Once the importlib_metadata backport is imported (MLflow does), entry points come back as its own class."""
    import toolkit.plugins as plugins

    class ForeignEntryPoint:
        def __init__(self, ep):
            self.name, self.value, self.dist, self._ep = ep.name, ep.value, ep.dist, ep

        def load(self):
            return self._ep.load()

    stdlib = plugins._entry_points()
    monkeypatch.setattr(plugins, "_entry_points", lambda: [ForeignEntryPoint(ep) for ep in stdlib])
    manager = plugins.build_plugin_manager()
    assert "local" in manager.registry("strategy") and "sft" in manager.registry("loss")


def _string_parts(path):
    """(line, text) of every string literal in ``path``, f-strings' constant parts joined with their fields as {}."""
    import ast

    parts = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            parts.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts.append((node.lineno, node.value))
    return parts


def test_every_install_hint_of_a_first_party_plugin_also_works_from_a_clone():
    """`pip install toolkit-<x>` answers "No matching distribution" until the plugins are published: a message
    that names it gives the command that works from a clone too (install_hint), or none of either."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = [*sorted((root / "core" / "toolkit").rglob("*.py")), *sorted(root.glob("plugins/*/src/**/*.py"))]
    assert len(sources) > 50
    bare = [f"{path.relative_to(root)}:{line}: {text.strip()[:120]}"
            for path in sources for line, text in _string_parts(path)
            if ("pip install toolkit-" in text or "pip install 'toolkit-" in text) and "from a clone" not in text]
    assert not bare, "install hints without the command that works from a clone (use toolkit.plugins.install_hint):\n" + "\n".join(bare)
