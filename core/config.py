"""Typed configs from YAML: dataclasses in, dataclasses out.

Every component declares a dataclass config; a recipe is a YAML file whose
nesting mirrors those dataclasses. ``build(cls, mapping)`` turns a mapping into
the dataclass, checking every key and value on the way, and a problem is a
``ConfigError`` naming its dotted path (``model.hidden_size: expected int,
got 'abc'``). ``a.b.c=value`` overrides are applied to the mapping before it
is built, so they are checked by the same code.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from orthon.core.errors import ConfigError


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _describe(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{path}: must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} fits none of {_describe(tp)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {value!r}")
        return build(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = get_args(tp)
        item_type = args[0] if args else Any
        items = [_convert(item_type, v, _join(path, i)) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        key_type, value_type = get_args(tp) or (Any, Any)
        return {_convert(key_type, k, path): _convert(value_type, v, _join(path, str(k))) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            # YAML reads 1e9 as a string; accept integral numbers written that way.
            number = _number(value)
            if number is None or number != int(number):
                raise ConfigError(f"{path}: expected an integer, got {value!r}")
            return int(number)
        return value
    if tp is float:
        number = _number(value)
        if number is None:
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported config type {_describe(tp)}")


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.replace("_", ""))
        except ValueError:
            return None
    return None


def build(cls: type, mapping: dict, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``mapping``; unknown keys and bad values raise ConfigError."""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {mapping!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        where = path or "<top level>"
        raise ConfigError(
            f"{_join(path, unknown[0])}: unknown key in {where} (known: {', '.join(sorted(fields))})"
        )
    kwargs = {name: _convert(hints[name], mapping[name], _join(path, name)) for name in mapping}
    try:
        obj = cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{path or cls.__name__}: {exc}") from None
    except ConfigError as exc:
        # __post_init__ validation names fields relative to the object; prefix the object's path.
        raise ConfigError(f"{path}.{exc}" if path else str(exc)) from None
    return obj


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain YAML-able data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def apply_overrides(mapping: dict, overrides: typing.Iterable[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested mapping, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.path=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(f"override {item!r}: empty key in {dotted!r}")
        node = mapping
        for depth, key in enumerate(keys[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(keys[: depth + 1])}: is a value, cannot set {dotted}")
            node = child
        node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return mapping


def deep_merge(base: dict, top: dict) -> dict:
    """``top`` over ``base``: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """A recipe as a mapping. ``base: other.yaml`` (relative to this file) starts from that recipe."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path}: top level must be a mapping")
    if "base" in data:
        base_path = path.parent / str(data.pop("base"))
        if base_path.resolve() in _seen:
            raise ConfigError(f"recipe {path}: base {base_path} includes itself")
        data = deep_merge(read_yaml(base_path, (*_seen, path.resolve())), data)
    return data


def load(cls: type, path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Any:
    """Read a YAML recipe (or start empty), apply overrides, build ``cls``."""
    mapping = read_yaml(path) if path is not None else {}
    return build(cls, apply_overrides(mapping, overrides))
