"""Typed dataclass configs from YAML plus dotted command-line overrides.

`build(cls, mapping)` builds a (nested) dataclass from plain data, checking every
key and converting every value to the field's annotated type; an unknown key or a
value of the wrong type raises `ConfigError` naming the dotted field and the
source. `set_dotted(mapping, "optim.lr", "3e-4")` applies one override.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ..errors import HfmegError


class ConfigError(HfmegError):
    """A config file or override that does not fit the typed config."""


def convert(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in typing.get_args(tp):
                return None
        errors = []
        for a in args:
            try:
                return convert(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: cannot convert {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return build(tp, value, where)
    if origin in (list, tuple):
        (item,) = typing.get_args(tp)[:1] or (Any,)
        if isinstance(value, str):  # a comma-separated override; `none`: the empty list
            value = [] if value.lower() == "none" else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return origin(convert(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {list(choices)}")
        return value
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float, str):
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    return value


def build(cls: type, data: dict[str, Any], where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - fields
    if unknown:
        name = f"{where}.{sorted(unknown)[0]}".lstrip(".")
        raise ConfigError(f"unknown config field {name!r} (known: {', '.join(sorted(fields))})")
    kwargs = {k: convert(v, hints[k], f"{where}.{k}".lstrip(".")) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def to_yaml(obj: Any) -> str:
    """A (nested) dataclass as YAML in field order, which `build` reads back to an equal one."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read config ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {p} is not a section")
    node[leaf] = value
