"""The layering the design promises, read from the source: the core imports no plugin, no plugin imports
another, plugins take shared machinery from declared core modules (``toolkit.builtins`` holds registrations:
a plugin may subclass a registered component, nothing else), and each writer exists once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "toolkit"
PLUGINS = sorted(p for p in (ROOT / "plugins").glob("toolkit-*/src/toolkit_*") if p.is_dir())


def _sources(*folders: Path) -> list[Path]:
    return sorted(path for folder in folders for path in folder.rglob("*.py"))


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, imported names, line)`` of every import in ``path``, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [alias.name for alias in node.names], node.lineno))
    return found


def test_the_core_imports_no_plugin():
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}" for path in _sources(CORE)
           for module, _, line in _imports(path) if module.startswith("toolkit_")]
    assert not bad, bad


# a plugin's published base classes, which other plugins subclass to extend it (an optional integration: the
# importing module is loaded only when that plugin is installed, as toolkit_example.megatron_family is)
EXTENSION_MODULES = {"toolkit_megatron.architectures"}


@pytest.mark.parametrize("package", PLUGINS, ids=lambda p: p.name)
def test_a_plugin_imports_no_other_plugin(package):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}" for path in _sources(package)
           for module, _, line in _imports(path)
           if module.startswith("toolkit_") and module.split(".")[0] != package.name and module not in EXTENSION_MODULES]
    assert not bad, bad


def test_plugins_take_no_machinery_from_builtins():
    """What plugins import from ``toolkit.builtins`` is a registered component class (to subclass), never
    a helper: shared machinery lives in declared modules (toolkit.models, toolkit.hfdir, toolkit.writes,
    toolkit.train.hf_engine, toolkit.train.optim, toolkit.inference, ...)."""
    import importlib

    from toolkit.plugins import KINDS, get_plugin_manager

    manager = get_plugin_manager()
    registered = {cls for kind in KINDS for _, cls in manager.registry(kind).items()}
    bad = []
    for path in _sources(*PLUGINS):
        for module, names, line in _imports(path):
            if module == "toolkit.builtins" or module.startswith("toolkit.builtins."):
                for name in names or ["(the module)"]:
                    value = getattr(importlib.import_module(module), name, None)
                    if value not in registered:
                        bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} from {module}")
    assert not bad, bad


def _calls(pattern: str) -> list[str]:
    regex = re.compile(pattern)
    return sorted(str(path.relative_to(ROOT)) for path in _sources(CORE, *PLUGINS) if regex.search(path.read_text()))


def test_one_writer_of_each_kind():
    # safetensors files: the HF writers (shards, adapters) and the training checkpoints, nothing else
    assert _calls(r"\bsave_file\(") == ["core/toolkit/hfdir.py", "core/toolkit/train/checkpoint.py",
                                        "core/toolkit/train/hf_engine.py", "core/toolkit/train/reference.py",
                                        "plugins/toolkit-deepspeed/src/toolkit_deepspeed/engine.py"]
    adapter_writers = [p for p in _calls(r"adapter_model\.safetensors") if "save_file(" in (ROOT / p).read_text()]
    assert adapter_writers == ["core/toolkit/hfdir.py"]
    assert _calls(r"index\.json\"\)\.write_text") == ["core/toolkit/hfdir.py"]  # safetensors shards + index
    # folders written complete or absent: one staging helper
    # (forkserver's and testing's temporary folders hold a socket and a test cache: no output of a command)
    assert _calls(r"\bmkdtemp\(") == ["core/toolkit/forkserver.py", "core/toolkit/testing.py", "core/toolkit/writes.py"]
    assert _calls(r"def free_port\b") == ["core/toolkit/train/distributed.py"]
    assert _calls(r"HashStore\(") == ["core/toolkit/train/distributed.py"]  # the one-process group
    # KEY=VALUE: toolkit.config.parse_pairs (commands/help.py splits argv's --flag=value, not options)
    assert _calls(r"\.(partition|split)\(\"=\"") == ["core/toolkit/commands/help.py", "core/toolkit/config.py"]
