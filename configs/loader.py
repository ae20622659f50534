"""Load a `TetherConfig` from a YAML preset plus dotted command-line overrides.

    cfg = load_config("configs/toy_reverse.yaml", ["learner.lr=1e-3", "actors.num_local=2"])

A preset may name another preset it extends (`base: toy_reverse.yaml`, relative to its own
directory) and then states only what differs. msgspec checks every type, choice and range
declared on the fields (`configs/schema.py`); `check_ranges` the rules between fields. Any
problem raises `ConfigError` with one line that names the field; entry points print it and
exit with status 2.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import types
import typing
from pathlib import Path

import msgspec
import msgspec.inspect
import yaml

from configs.schema import TetherConfig, check_ranges

PRESET_DIR = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field."""


class _YAMLLoader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-3` (no dot) as a string; read it as the float it is, as YAML 1.2 does."""


_YAMLLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                                  list("-+.0123456789"))


def _yaml(text: str) -> object:
    return yaml.load(text, Loader=_YAMLLoader)


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> TetherConfig:
    """Read `path` (a YAML file, or None for the defaults), apply `key=value` overrides, validate."""
    raw = {} if path is None else read_preset(path)
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
        node[parts[-1]] = _yaml(value) if value != "" else ""
    try:
        cfg = msgspec.convert(raw, TetherConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(str(e), raw)) from None
    errors = check_ranges(cfg)
    if errors:
        raise ConfigError(errors[0])
    return cfg


def read_preset(path: str | os.PathLike, seen: tuple[Path, ...] = ()) -> dict:
    """The preset's mapping merged over its `base:` chain (not validated yet)."""
    p = Path(path)
    if not p.exists() and (PRESET_DIR / p.name).exists():
        p = PRESET_DIR / p.name
    if not p.exists():
        raise ConfigError(f"config file {path} does not exist")
    loaded = _yaml(p.read_text())
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(loaded).__name__}")
    base = loaded.pop("base", None)
    if base is None:
        return loaded
    if not isinstance(base, str) or not base:
        raise ConfigError(f"config file {path}: base must name a preset file, got {base!r}")
    chain = (*seen, p.resolve())
    base_path = (p.parent / base).resolve()
    if base_path in chain:
        names = " -> ".join(q.name for q in (*chain, base_path))
        raise ConfigError(f"config file {path}: base presets form a cycle: {names}")
    return merge(read_preset(base_path, chain), loaded)


def merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, section by section."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = merge(out[key], value)
        out[key] = value
    return out


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _explain(message: str, raw: dict) -> str:
    """msgspec's `Expected `int` >= 1 - at `$.learner.max_steps`` as today's one line that names
    the field: `learner.max_steps must be >= 1, got 0`. Paths may index lists of tagged
    sections (`task.scorers[0].weight`)."""
    m = _AT.match(message)
    what = m["what"]
    parts = [p for p in re.split(r"\.|(?=\[)", m["path"] or "") if p]
    key = ".".join(parts).replace(".[", "[")
    unknown = re.match(r"Object contains unknown field `(.*)`$", what)
    if unknown:
        known = sorted(f.name for f in msgspec.structs.fields(_field_type(parts, raw)))
        return (f"unknown config key {key + '.' + unknown[1] if key else unknown[1]!r} "
                f"(known in this section: {', '.join(known)})")
    missing = re.match(r"Object missing required field `(.*)`$", what)
    if missing:
        return f"{key}.{missing[1]} must be set"
    value = _value(parts, raw)
    if parts and parts[-1] == "kind" and what.startswith("Invalid value"):
        kinds = [typing.get_args(t) for t in (_field_type(parts[:-1], raw, tagged=False),)][0]
        names = [msgspec.inspect.type_info(t).tag for t in kinds]
        return f"{key} must be one of {', '.join(names)}, got {value!r}"
    typed = re.match(r"Expected `(\w+)`, got `\w+`$", what)
    if typed:
        expected = {"object": "a mapping", "array": "a list"}.get(typed[1], typed[1])
        return f"{key} must be {expected}, got {value!r}"
    hint = _field_type(parts, raw)
    if typing.get_origin(hint) is typing.Literal:
        return f"{key} must be one of {', '.join(typing.get_args(hint))}, got {value!r}"
    base, meta = unwrap(hint)
    if meta is None:
        return f"{key}: {what}"
    if base is float and isinstance(value, int):
        value = float(value)
    return f"{key} must be {rule(meta)}, got {value!r}"


def _value(parts: list[str], raw: object) -> object:
    for part in parts:
        raw = raw[int(part[1:-1])] if part.startswith("[") else raw[part]
    return raw


def _field_type(parts: list[str], raw: object = None, tagged: bool = True) -> object:
    """The annotation of the field at `parts` (`TetherConfig` itself for no parts); a list
    index gives the element type, and a union of tagged sections the member that the raw
    value's `kind` names (with `tagged`)."""
    hint: object = TetherConfig
    for i, part in enumerate(parts):
        if part.startswith("["):
            hint = typing.get_args(hint)[0]
            if tagged and isinstance(hint, types.UnionType):
                kind = _value(parts[:i + 1], raw).get("kind")
                hint = next(t for t in typing.get_args(hint)
                            if msgspec.inspect.type_info(t).tag == kind)
        else:
            hint = {f.name: f.type for f in msgspec.structs.fields(hint)}[part]
    return hint


def unwrap(hint: object) -> tuple[object, msgspec.Meta | None]:
    """A field's annotation as (type, its `Meta` or None)."""
    if typing.get_origin(hint) is typing.Annotated:
        base, meta = typing.get_args(hint)[:2]
        return base, meta
    return hint, None


def rule(meta: msgspec.Meta) -> str:
    """What a field's `Meta` asks for, in words: `>= 1`, `in [0, 1)`, or its description."""
    if meta.description:
        return meta.description
    low = [(op, bound) for op, bound in ((">=", meta.ge), (">", meta.gt)) if bound is not None]
    high = [(op, bound) for op, bound in (("<=", meta.le), ("<", meta.lt)) if bound is not None]
    if low and high:
        (lo_op, lo), (hi_op, hi) = low[0], high[0]
        return f"in {'[' if lo_op == '>=' else '('}{lo}, {hi}{']' if hi_op == '<=' else ')'}"
    if low or high:
        op, bound = (low or high)[0]
        return f"{op} {bound}"
    return f"matching {meta.pattern!r}"


def to_dict(cfg: TetherConfig) -> dict:
    """The resolved config as plain data (what is written to run_dir/config.yaml)."""
    return msgspec.to_builtins(cfg)


def save_config(cfg: TetherConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML, loadable again with `load_config`."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config section."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[stmt.target.id] = str(nxt.value.value).strip()
    return docs


def describe(cls: type = TetherConfig, prefix: str = "") -> list[str]:
    """One line per leaf field: `key (default): doc`, for --help."""
    lines: list[str] = []
    docs = field_docs(cls)
    default = cls()
    for f in msgspec.structs.fields(cls):
        value = getattr(default, f.name)
        if isinstance(value, msgspec.Struct):
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
    for name in ("httpx", "httpx2"):  # OpenAI-client agents: a line per call
        logging.getLogger(name).setLevel(logging.WARNING)
