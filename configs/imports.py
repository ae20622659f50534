"""The one way a config field names user code: `package.module:attribute` or
`path/to/file.py:attribute` (task.name, task.reward, task.environment, task.verifiers_env,
actors.openai_agent, actors.environment). Errors are one line naming the field."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def load_object(spec: str, field_name: str, kind: str = "attribute") -> object:
    """The attribute `spec` names; ValueError naming `field_name` (and `kind`: what it should
    be) when it cannot be found."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"{field_name} {spec!r} must look like package.module:{kind} or "
                         f"path/to/file.py:{kind}")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"{field_name} {spec!r}: file {path} does not exist")
        mod_name = f"tether_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise ValueError(f"{field_name} {spec!r}: cannot import {target!r}: "
                             f"no module named {e.name!r}") from None
    obj = getattr(module, name, None)
    if obj is None or (kind == "function" and not callable(obj)):
        raise ValueError(f"{field_name} {spec!r}: module {target!r} has no {kind} {name!r}")
    return obj


def load_function(spec: str, field_name: str):
    """The function `spec` names (as `load_object`, and it must be callable)."""
    return load_object(spec, field_name, "function")
