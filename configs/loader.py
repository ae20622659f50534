"""Load a `TetherConfig` from a YAML preset plus dotted command-line overrides.

    cfg = load_config("configs/toy_reverse.yaml", ["learner.lr=1e-3", "actors.num_local=2"])

Any problem (unknown key, wrong type, out-of-range value) raises `ConfigError` with one line
that names the field; entry points print it and exit with status 2.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import typing
from pathlib import Path

import yaml

from configs.schema import CHOICES, TetherConfig, check_ranges

PRESET_DIR = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field."""


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> TetherConfig:
    """Read `path` (a YAML file, or None for the defaults), apply `key=value` overrides, validate."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists() and (PRESET_DIR / p.name).exists():
            p = PRESET_DIR / p.name
        if not p.exists():
            raise ConfigError(f"config file {path} does not exist")
        loaded = yaml.safe_load(p.read_text())
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping, got {type(loaded).__name__}")
        raw = loaded
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
    cfg = _build(TetherConfig, raw, prefix="")
    errors = check_ranges(cfg)
    if errors:
        raise ConfigError(errors[0])
    return cfg


def _build(cls: type, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = prefix + str(unknown[0])
        raise ConfigError(f"unknown config key {key!r} (known in this section: "
                          f"{', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in raw.items():
        key = prefix + name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, prefix=key + ".")
        else:
            kwargs[name] = _coerce(key, hint, value)
    return cls(**kwargs)


def _coerce(key: str, hint: type, value: object) -> object:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads "1e-3" as a string; accept plain float literals.
        try_value = _parse_float(value)
        if try_value is not None:
            value = try_value
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{key} must be {hint.__name__}, got {value!r}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"{key} must be one of {', '.join(CHOICES[key])}, got {value!r}")
    return value


def _parse_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def to_dict(cfg: TetherConfig) -> dict:
    """The resolved config as plain data (what is written to run_dir/config.yaml)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: TetherConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML, loadable again with `load_config`."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[stmt.target.id] = str(nxt.value.value).strip()
    return docs


def describe(cls: type = TetherConfig, prefix: str = "") -> list[str]:
    """One line per leaf field: `key (default): doc`, for --help and the README."""
    lines: list[str] = []
    docs = field_docs(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            lines.extend(describe(type(value), prefix + f.name + "."))
        else:
            lines.append(f"  {prefix}{f.name} = {value!r}\n      {docs.get(f.name, '')}")
    return lines



def setup_process(tag: str) -> None:
    """Process set-up shared by the entry points, after the config parsed: offline HF (no hub
    at run time, no progress bars) and log lines tagged with the role, e.g. `actor[node-3]`."""
    import logging

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {tag} %(levelname)s %(message)s")
