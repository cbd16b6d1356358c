"""The hook reference in docs/hooks.md matches core/toolkit/hookspecs.py exactly."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from toolkit import hookspecs

DOCS = Path(__file__).resolve().parents[1] / "docs"
HEADING = re.compile(r"^## `(toolkit_\w+)\((.*)\) -> (.+)`$")


def signature(function) -> str:
    """``(register: Register) -> None`` as written in the source (annotations are strings)."""
    sig = inspect.signature(function)
    params = ", ".join(f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name for p in sig.parameters.values())
    return f"({params}) -> {sig.return_annotation}"


def hookspec_functions() -> dict:
    return {name: fn for name, fn in vars(hookspecs).items() if name.startswith("toolkit_") and hasattr(fn, "toolkit_spec")}


def documented() -> dict[str, tuple[str, str]]:
    """hook name -> (signature, text of its section) from docs/hooks.md."""
    sections: dict[str, tuple[str, str]] = {}
    current = None
    for line in (DOCS / "hooks.md").read_text().splitlines():
        match = HEADING.match(line)
        if match:
            name, params, returns = match.groups()
            current = name
            assert name not in sections, f"docs/hooks.md describes {name} twice"
            sections[name] = (f"({params}) -> {returns}", "")
        elif line.startswith("## "):
            current = None
        elif current:
            sig, text = sections[current]
            sections[current] = (sig, text + line + "\n")
    return sections


def test_every_hook_is_documented_with_its_exact_signature():
    docs = documented()
    for name, function in hookspec_functions().items():
        assert name in docs, f"docs/hooks.md has no '## `{name}{signature(function)}`' section"
        assert docs[name][0] == signature(function), f"{name}: docs say {docs[name][0]}, hookspecs.py says {signature(function)}"


def test_no_documented_hook_is_missing_from_hookspecs():
    stale = set(documented()) - set(hookspec_functions())
    assert not stale, f"docs/hooks.md describes hooks that do not exist: {sorted(stale)}"


@pytest.mark.parametrize("name", sorted(hookspec_functions()))
def test_each_hook_section_has_an_example_and_says_when_it_is_called(name):
    text = documented()[name][1]
    assert f"def {name}(" in text and "@hookimpl" in text, f"{name}: add an example implementation"
    assert "**Called**" in text, f"{name}: say when the hook is called"
    firstresult = hookspec_functions()[name].toolkit_spec.get("firstresult", False)
    assert ("**firstresult**" in text) == firstresult, f"{name}: firstresult={firstresult} must match the docs"


def test_the_signature_check_catches_a_difference():
    def toolkit_register_losses(register: Register, extra: int) -> None:  # noqa: F821
        pass

    assert signature(toolkit_register_losses) != documented()["toolkit_register_losses"][0]


def test_examples_that_name_the_example_plugin_name_what_it_defines():
    """A hook example importing from plugins/toolkit-example names a module and a class or function it has."""
    source = DOCS.parent / "plugins" / "toolkit-example" / "src" / "toolkit_example"
    imports = re.findall(r"from toolkit_example\.(\w+) import (\w+)", (DOCS / "hooks.md").read_text())
    assert imports, "docs/hooks.md no longer shows the example plugin"
    for module, name in imports:
        path = source / f"{module}.py"
        assert path.is_file(), f"docs/hooks.md imports toolkit_example.{module}, which {path} would hold"
        assert re.search(rf"^(class|def) {name}\b", path.read_text(), re.M), f"docs/hooks.md imports {name}, not in {path}"
