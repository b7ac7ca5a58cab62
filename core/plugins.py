"""Plug-ins by dotted path (reward functions, tasks, filters, ...), as slime does: adding one never
means editing the loop that calls it."""
from __future__ import annotations

import importlib

from orthon.core.errors import ConfigError


def resolve(dotted: str, what: str = "plug-in") -> object:
    """The object at ``package.module.name`` or ``package.module:name``; a ConfigError names what failed."""
    if ":" in dotted:
        module_name, _, attr = dotted.partition(":")
    else:
        module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{what} {dotted!r}: expected a dotted path like package.module.name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {dotted!r}: cannot import {module_name}: {exc}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {dotted!r}: {module_name} has no attribute {attr}")
        obj = getattr(obj, part)
    return obj
