"""Typed option dataclasses: building them from YAML/flags, and one validation pass for all problems.

Every registered thing declares a ``Config`` dataclass (kw_only, a ``help`` in each field's
metadata). Flags and YAML keys are generated from it here, never kept in a second list.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, get_args, get_origin


def option(default: Any = dataclasses.MISSING, *, help: str = "", flag: str | None = None, aliases: tuple[str, ...] = (),
           replaced_by: str | None = None, **kw: Any) -> Any:
    """A documented dataclass field: ``help`` becomes the flag's help, ``aliases`` extra flags (and YAML keys).

    ``replaced_by`` (a plugin section's field only) names the :class:`~toolkit.recipe.Recipe` field that took
    over its job: a value given there is moved to that field with one deprecation line (``resolve_recipe``);
    the field's default must be ``None`` (not given), and its help is written from the new field's flag."""
    if not help and not replaced_by:
        raise TypeError("option() needs help= (the flag's help text)")
    metadata = {"help": help, "flag": flag, "aliases": aliases, "replaced_by": replaced_by}
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata, **kw)
    return dataclasses.field(default=default, metadata=metadata, **kw)


def parse_pairs(items: Any, example: str = "name=value") -> dict[str, str]:
    """``KEY=VALUE`` items (flags, or the lines of a form field) as a dict, keys and values stripped.
    A malformed item raises ``ValueError`` naming it; callers add the flag (one parser for every
    ``--option``, ``--columns`` and mapping field)."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE (for example {example}), got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def describe_type(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in get_args(tp))
    if origin is list:
        return f"list of {describe_type(get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any) -> Any:
    """Convert ``value`` (from YAML or a flag string) to ``tp`` or raise ``ValueError``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except ValueError:
                continue
        raise ValueError(f"expected {describe_type(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        for choice in choices:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise ValueError(f"expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    if origin is list:
        (inner,) = get_args(tp)
        items = value if isinstance(value, (list, tuple)) else [value]
        return [coerce(v, inner) for v in items]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ValueError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                try:
                    number = float(value)
                except ValueError:
                    number = None
                if number is not None and number.is_integer():
                    return int(number)
        raise ValueError(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"expected a string, got {value!r}")
    return value


def build_dataclass(cls: type, data: dict[str, Any], where: str, problems: list[str]) -> Any:
    """Instantiate ``cls`` from ``data``; append every problem (unknown key, bad type) to ``problems``."""
    hints = field_types(cls)
    # A field's flag aliases are YAML keys too (``--max-completion-length`` -> ``max_completion_length``).
    aliases = {flag.lstrip("-").replace("-", "_"): f.name for f in dataclasses.fields(cls) for flag in f.metadata.get("aliases", ())}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        name = aliases.get(name, name)
        if name not in hints:
            close = difflib.get_close_matches(name, list(hints), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(hints)}"
            problems.append(f"{where}: unknown key {key!r}{hint}")
            continue
        try:
            kwargs[name] = coerce(value, hints[name])
        except ValueError as exc:
            problems.append(f"{where}.{name}: {exc}")
    try:
        instance = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        problems.append(f"{where}: {exc}")
        return cls()
    check = getattr(instance, "check", None)
    if callable(check):
        problems.extend(f"{where}: {p}" for p in check())
    return instance


def to_dict(instance: Any) -> dict[str, Any]:
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


def flag_name(prefix: str | None, field: dataclasses.Field) -> str:
    if field.metadata.get("flag"):
        return field.metadata["flag"]
    stem = field.name.replace("_", "-")
    return f"--{prefix}-{stem}" if prefix else f"--{stem}"
