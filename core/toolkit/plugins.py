"""Plugin manager: entry-point discovery, isolation of broken plugins, and the registries.

The rest of the code goes through :class:`Toolkit` (a typed facade) and never calls
``pm.hook.x(...)`` itself. Built-in plugins are listed under the same ``toolkit`` entry-point
group as third-party ones (``[project.entry-points.toolkit]`` in pyproject.toml).
"""

from __future__ import annotations

import difflib
import os
import sys
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from toolkit import __version__, hookspecs
from toolkit.errors import PluginLoadError, RegistryError

ENTRY_POINT_GROUP = "toolkit"

KINDS = {
    "model_loader": "toolkit_register_model_loaders",
    "architecture": "toolkit_register_architectures",
    "strategy": "toolkit_register_strategies",
    "tuner": "toolkit_register_tuners",
    "optimizer": "toolkit_register_optimizers",
    "loss": "toolkit_register_losses",
    "dataset_format": "toolkit_register_dataset_formats",
    "exporter": "toolkit_register_exporters",
    "quantizer": "toolkit_register_quantizers",
    "inference_backend": "toolkit_register_inference_backends",
    "callback": "toolkit_register_callbacks",
    "reward": "toolkit_register_rewards",
    "metric": "toolkit_register_metrics",
}

# Names the first-party plugins provide, so an unknown name can say what to install.
FIRST_PARTY = {
    ("strategy", "megatron"): "toolkit-megatron",
    ("strategy", "deepspeed"): "toolkit-deepspeed",
    ("tuner", "lora"): "toolkit-peft",
    ("tuner", "dora"): "toolkit-peft",
    ("tuner", "qlora"): "toolkit-peft",
    ("tuner", "lisa"): "toolkit-optim",
    ("optimizer", "adamw-8bit"): "toolkit-optim",
    ("optimizer", "galore"): "toolkit-optim",
    **{("loss", n): "toolkit-dpo" for n in ("dpo", "ipo", "hinge", "kto", "simpo", "orpo", "cpo", "rm")},
    ("dataset_format", "preference"): "toolkit-dpo",
    ("dataset_format", "kto"): "toolkit-dpo",
    ("architecture", "moe"): "toolkit-moe",
    ("exporter", "mcore"): "toolkit-megatron",
    **{("quantizer", n): "toolkit-quantize" for n in ("bnb4", "bnb8", "gptq", "awq", "fp8")},
    ("exporter", "vllm"): "toolkit-vllm",
    ("exporter", "gguf"): "toolkit-quantize",
    ("exporter", "lmdeploy"): "toolkit-lmdeploy",
    ("inference_backend", "vllm"): "toolkit-vllm",
    ("inference_backend", "lmdeploy"): "toolkit-lmdeploy",
    **{("reward", n): "toolkit-rl" for n in ("answer", "format", "length", "overlong", "reward-model")},
}


def install_hint(distribution: str, extra: str = "") -> str:
    """The commands that install a first-party plugin: the one that works once it is published,
    and the one that works from a clone of this repository today (plugins/<distribution>).

    >>> install_hint("toolkit-peft", "qlora")
    "pip install 'toolkit-peft[qlora]' (from a clone: pip install -c constraints.txt -e 'plugins/toolkit-peft[qlora]')"
    """
    if extra:
        return (f"pip install '{distribution}[{extra}]' "
                f"(from a clone: pip install -c constraints.txt -e 'plugins/{distribution}[{extra}]')")
    return f"pip install {distribution} (from a clone: pip install -c constraints.txt -e plugins/{distribution})"


@dataclass
class PluginInfo:
    """One loaded (or failed) plugin, as ``toolkit plugins`` shows it."""

    name: str
    distribution: str
    version: str
    module: str
    error: str | None = None
    registered: dict[str, list[str]] = field(default_factory=dict)
    hooks: list[str] = field(default_factory=list)


def plural(kind: str) -> str:
    """``loss`` -> ``losses``, ``strategy`` -> ``strategies``, ``tuner`` -> ``tuners``."""
    if kind.endswith("s"):
        return kind + "es"
    if kind.endswith("y"):
        return kind[:-1] + "ies"
    return kind + "s"


def _env_list(name: str) -> set[str] | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return {item.strip() for item in value.split(",") if item.strip()}


class Registry:
    """Registered classes of one kind, by name, remembering which plugin registered each."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, type] = {}
        self._owners: dict[str, str] = {}

    def add(self, cls: type, owner: str) -> None:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise RegistryError(f"plugin {owner!r} registered a {self.kind} without a 'name': {cls!r}")
        if name in self._items:
            raise RegistryError(
                f"{self.kind} {name!r} is registered twice: by plugin {self._owners[name]!r} "
                f"and by plugin {owner!r}. Uninstall one of them or disable it with "
                f"TOOLKIT_DISABLE_PLUGINS={owner}."
            )
        self._items[name] = cls
        self._owners[name] = owner

    def get(self, name: str) -> type:
        if name in self._items:
            return self._items[name]
        installed = ", ".join(sorted(self._items)) or "none"
        provider = FIRST_PARTY.get((self.kind, name))
        if provider:
            hint = f"{self.kind} {name!r} is not installed: {install_hint(provider)}"
        else:
            close = difflib.get_close_matches(name, list(self._items), n=1)
            hint = f"unknown {self.kind} {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        raise RegistryError(f"{hint}. Installed {plural(self.kind)}: {installed}.")

    def owner(self, name: str) -> str:
        return self._owners[name]

    def names(self) -> list[str]:
        return list(self._items)

    def items(self) -> list[tuple[str, type]]:
        return list(self._items.items())

    def __contains__(self, name: object) -> bool:
        return name in self._items


class Toolkit:
    """Typed facade over the pluggy manager: plugin list, registries, commands."""

    def __init__(self, pm: pluggy.PluginManager, plugins: list[PluginInfo]):
        self.pm = pm
        self.plugins = plugins
        self._registries: dict[str, Registry] = {}

    def registry(self, kind: str) -> Registry:
        if kind not in KINDS:
            raise RegistryError(f"no registry kind {kind!r}; kinds: {', '.join(KINDS)}")
        if kind not in self._registries:
            self._registries[kind] = self._collect(kind)
        return self._registries[kind]

    def _collect(self, kind: str) -> Registry:
        registry = Registry(kind)
        hook = getattr(self.pm.hook, KINDS[kind])
        by_name = {p.name: p for p in self.plugins}
        for impl in reversed(hook.get_hookimpls()):  # registration order: first plugin first
            owner = self.pm.get_name(impl.plugin) or "?"
            info = by_name.get(owner)

            def register(cls: type, _owner: str = owner, _info: PluginInfo | None = info) -> None:
                registry.add(cls, _owner)
                if _info is not None:
                    _info.registered.setdefault(kind, []).append(cls.name)

            try:
                impl.function(register=register)
            except RegistryError:
                raise
            except (Exception, SystemExit) as exc:  # a plugin's registration code is its own business
                _report_broken(owner, info.version if info else "?", exc)
                if info is not None:
                    info.error = f"{type(exc).__name__}: {exc}"
        return registry

    def get(self, kind: str, name: str) -> type:
        return self.registry(kind).get(name)

    def create(self, kind: str, name: str, options: Any = None) -> Any:
        """Instantiate a registered class with its ``Config`` (default options if ``None``)."""
        cls = self.get(kind, name)
        config = options if options is not None else cls.Config()
        return cls(config)

    def collect_all(self) -> None:
        for kind in KINDS:
            self.registry(kind)

    def register_commands(self, cli: Any) -> None:
        """Let every plugin add its commands, the core's first. A command name taken by an
        earlier plugin keeps the earlier command, and the clash is reported naming both."""
        owners: dict[str, str] = {}
        for impl in self.pm.hook.toolkit_register_commands.get_hookimpls():  # registration order
            owner = self.pm.get_name(impl.plugin) or "?"
            info = next((p for p in self.plugins if p.name == owner), None)
            before = dict(cli.commands)
            try:
                impl.function(cli=cli)
            except RegistryError as exc:  # e.g. a duplicate name: both plugins are named in it
                print(f"toolkit: {exc}", file=sys.stderr)
            except (Exception, SystemExit) as exc:
                _report_broken(owner, info.version if info else "?", exc)
            for name, command in list(cli.commands.items()):
                if before.get(name) is command:
                    continue
                if name in before:
                    cli.commands[name] = before[name]
                    print(f"toolkit: command {name!r} is registered twice: by plugin {owners.get(name, '?')!r} and by "
                          f"plugin {owner!r}; keeping the first. Disable one with TOOLKIT_DISABLE_PLUGINS={owner}.", file=sys.stderr)
                    continue
                owners[name] = owner
                if info is not None and name not in info.registered.get("command", []):  # the CLI may be built twice
                    info.registered.setdefault("command", []).append(name)

    def resolve_export_source(self, path: str) -> Any:
        return self.pm.hook.toolkit_resolve_export_source(path=path)

    def parallel_axes(self, strategy_cls: type) -> frozenset[str]:
        """The axes a strategy supports: its own ``parallel_axes`` and those plugins add (``toolkit_strategy_axes``)."""
        from toolkit.contracts import member

        added = self.pm.hook.toolkit_strategy_axes(strategy=strategy_cls.name)
        return frozenset(member(strategy_cls, "strategy", "parallel_axes")).union(*map(frozenset, added))

    def patch_model(self, model: Any, source: Any, recipe: Any) -> None:
        """Let plugins modify a built HF model before the tuner (``toolkit_patch_model``)."""
        self.pm.hook.toolkit_patch_model(model=model, source=source, recipe=recipe)


def _report_broken(name: str, version: str, exc: BaseException) -> None:
    message = f"toolkit: plugin {name} {version} failed and was skipped (core {__version__}): {type(exc).__name__}: {exc}"
    print(message, file=sys.stderr)
    if os.environ.get("TOOLKIT_DEBUG"):
        traceback.print_exception(exc)


def _entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.value.split(".")[0] != "toolkit", ep.name))


def build_plugin_manager(extra_plugins: list[tuple[str, object]] | None = None) -> Toolkit:
    """Discover and load every plugin, each inside its own guard.

    ``TOOLKIT_PLUGINS`` (comma-separated names) loads only those; ``TOOLKIT_DISABLE_PLUGINS``
    skips those. ``extra_plugins`` registers in-process plugins (tests, embedding apps).
    """
    pm = pluggy.PluginManager("toolkit")
    pm.add_hookspecs(hookspecs)
    allow, block = _env_list("TOOLKIT_PLUGINS"), _env_list("TOOLKIT_DISABLE_PLUGINS") or set()
    infos: list[PluginInfo] = []
    # (name, distribution, version, entry point or in-process object, in process?): not isinstance(EntryPoint),
    # since once the importlib_metadata backport is imported (MLflow does) its EntryPoint class comes back instead
    candidates: list[tuple[str, str, str, Any, bool]] = []
    for ep in _entry_points():
        dist = ep.dist.name if ep.dist else "?"
        version = ep.dist.version if ep.dist else "?"
        candidates.append((ep.name, dist, version, ep, False))
    for name, obj in extra_plugins or []:
        candidates.append((name, "(in-process)", __version__, obj, True))
    _warn_unknown_names(allow, block, {c[0] for c in candidates})
    for name, dist, version, target, in_process in candidates:
        allowed = allow is None or name in allow or name.startswith("toolkit.") or in_process
        if not allowed or name in block:
            continue
        if any(info.name == name for info in infos):
            first = next(info for info in infos if info.name == name)
            print(f"toolkit: plugin name {name!r} is provided by {first.distribution} {first.version} and by {dist} {version}; "
                  f"loading the first only. Uninstall one of them.", file=sys.stderr)
            continue
        info = PluginInfo(name=name, distribution=dist, version=version, module=getattr(target, "value", repr(target)))
        infos.append(info)
        try:
            plugin = target if in_process else target.load()
            _check_hooks(plugin)
            pm.register(plugin, name=name)
            pm.check_pending()
        except (Exception, SystemExit) as exc:  # sys.exit() at import is contained like an exception
            if pm.has_plugin(name):
                pm.unregister(name=name)
            info.error = f"{type(exc).__name__}: {exc}"
            _report_broken(name, version, exc)
            continue
        info.hooks = sorted(h.name for h in pm.get_hookcallers(pm.get_plugin(name)) or [])
    return Toolkit(pm, infos)


def _warn_unknown_names(allow: set[str] | None, block: set[str], installed: set[str]) -> None:
    """A typo in TOOLKIT_PLUGINS / TOOLKIT_DISABLE_PLUGINS would otherwise silently do nothing."""
    for variable, names in (("TOOLKIT_PLUGINS", allow or set()), ("TOOLKIT_DISABLE_PLUGINS", block)):
        unknown = sorted(names - installed)
        if unknown:
            print(f"toolkit: {variable} names {', '.join(unknown)}, which no installed plugin is called; "
                  f"plugins: {', '.join(sorted(installed))}", file=sys.stderr)


HOOK_NAMES = frozenset(n for n in dir(hookspecs) if n.startswith("toolkit_"))


def _check_hooks(plugin: object) -> None:
    """Reject misspelled or unprefixed hook implementations before registering the plugin
    (pluggy's ``check_pending`` only catches prefixed ones, and without a suggestion)."""
    for attr in dir(plugin):
        function = getattr(plugin, attr, None)
        marked = callable(function) and hasattr(function, "toolkit_impl")
        if marked and attr not in HOOK_NAMES:
            close = difflib.get_close_matches(attr, sorted(HOOK_NAMES), n=1, cutoff=0.5)
            hint = f" (did you mean {close[0]}?)" if close else f"; hooks: {', '.join(sorted(HOOK_NAMES))}"
            raise PluginLoadError(f"hook implementation {attr!r} matches no toolkit hook{hint}")


_MANAGER: Toolkit | None = None


def get_plugin_manager() -> Toolkit:
    """The process-wide :class:`Toolkit`, built on first use (never at import time)."""
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = build_plugin_manager()
    return _MANAGER


def set_plugin_manager(manager: Toolkit | None) -> Toolkit | None:
    """Replace the process-wide manager (tests); returns the previous one."""
    global _MANAGER
    previous, _MANAGER = _MANAGER, manager
    return previous
