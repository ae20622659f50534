"""Load a `TetherConfig` from a YAML preset plus dotted command-line overrides.

    cfg = load_config("configs/toy_reverse.yaml", ["learner.lr=1e-3", "actors.num_local=2"])

A preset may name another preset it extends (`base: toy_reverse.yaml`, relative to its own
directory) and then states only what differs. A family's section (`actors.engine`,
`actors.agent`, `learner.backend`) may be given as its kind's name alone, `actors.engine: vllm`,
which stands for `{kind: vllm}`: that kind with its defaults; a section that names no kind keeps
the kind it extends (or the default's). Each field is checked against its declared type, choices
and range (`configs/schema.py`) by walking the schema, so the one line of a `ConfigError` names
the field from the schema itself, not from msgspec's error text; `check_ranges` then checks the
rules between fields. Entry points print the line and exit with status 2.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import sys
import typing
from pathlib import Path

import msgspec
import yaml

from configs.base import Kind, kinds_of
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
        expand_kinds(raw, TetherConfig)  # `actors.engine=vllm` then `actors.engine.kv_cache_gb=1`
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[parts[-1]] = _yaml(value) if value != "" else ""
    expand_kinds(raw, TetherConfig, fill=True)
    error = check_fields(raw, TetherConfig, "")
    if error:
        raise ConfigError(error)
    cfg = msgspec.convert(raw, TetherConfig)  # every field was checked above: this cannot fail
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
    expand_kinds(loaded, TetherConfig)
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
    """`over` on top of `base`, section by section; a section naming another kind replaces."""
    out = dict(base)
    for key, value in over.items():
        if (isinstance(value, dict) and isinstance(out.get(key), dict)
                and value.get("kind", out[key].get("kind")) == out[key].get("kind")):
            value = merge(out[key], value)
        out[key] = value
    return out


def expand_kinds(raw: dict, cls: type, fill: bool = False) -> None:
    """In place: every family section given as a kind's name alone becomes `{kind: name}`; with
    `fill`, a family section naming no kind gets its default's kind."""
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    for name, value in raw.items():
        f = fields.get(name)
        if f is None:
            continue
        kinds = kinds_of(f.type)
        if kinds is not None and isinstance(value, str):
            raw[name] = value = {"kind": value}
        if kinds is not None and isinstance(value, dict):
            if fill and "kind" not in value:
                value["kind"] = f.default_factory().kind
            if value.get("kind") in kinds:
                expand_kinds(value, kinds[value["kind"]], fill)
        elif _is_section(f.type) and isinstance(value, dict):
            expand_kinds(value, f.type, fill)


def _is_section(hint: object) -> bool:
    return isinstance(hint, type) and issubclass(hint, msgspec.Struct)


def check_fields(raw: object, cls: type, key: str) -> str | None:
    """The first field of `raw` that `cls` (a section) does not accept, as one line naming it;
    None when every field is valid. Keys are joined to `key` (the section's own dotted key)."""
    if not isinstance(raw, dict):
        return f"{key} must be a mapping, got {raw!r}"
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    tagged = issubclass(cls, Kind)
    for name, value in raw.items():
        sub = f"{key}.{name}" if key else str(name)
        if tagged and name == "kind":
            continue
        if name not in fields:
            where = f" for {key} kind {cls.__struct_config__.tag}" if tagged else ""
            return (f"unknown config key {sub!r}{where} (known in this section: "
                    f"{', '.join(sorted(fields)) or 'none'})")
        error = _check_value(value, fields[name].type, sub)
        if error:
            return error
    for name, f in fields.items():
        if f.required and name not in raw:
            what = f" to {rule(unwrap(f.type)[1])}" if unwrap(f.type)[1] else ""
            return (f"{key}.{name} must be set{what} when {key} is "
                    f"{cls.__struct_config__.tag}")
    return None


def _check_value(value: object, hint: object, key: str) -> str | None:
    """One field's value against its annotation (a section, a family of kinds, a list of a
    family's sections, or a leaf)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and kinds_of(args[0]) is not None:
        if not isinstance(value, list):
            return f"{key} must be a list, got {value!r}"
        for i, item in enumerate(value):
            error = _check_value(item, args[0], f"{key}[{i}]")
            if error:
                return error
        return None
    kinds = kinds_of(hint)
    if kinds is not None:
        kind = value.get("kind") if isinstance(value, dict) else value
        if not isinstance(kind, str) or kind not in kinds:
            return f"{key} must be one of {', '.join(kinds)}, got {kind!r}"
        return check_fields(value, kinds[kind], key)
    if _is_section(hint):
        return check_fields(value, hint, key)
    literal = typing.get_origin(hint) is typing.Literal
    base, meta = unwrap(hint)
    if literal:
        base = type(typing.get_args(hint)[0])
    if not _accepts(base, value):
        return f"{key} must be {_type_name(base)}, got {value!r}"
    if literal and not _accepts(hint, value):
        return f"{key} must be one of {', '.join(typing.get_args(hint))}, got {value!r}"
    if meta is not None and not _accepts(hint, value):
        if base is float and isinstance(value, int):
            value = float(value)
        return f"{key} must be {rule(meta)}, got {value!r}"
    return None


def _accepts(hint: object, value: object) -> bool:
    try:
        msgspec.convert(value, hint)
    except msgspec.ValidationError:
        return False
    return True


def _type_name(base: object) -> str:
    """`int`, `a mapping` (dict), `float or null` (`float | None`)."""
    if base is dict:
        return "a mapping"
    args = typing.get_args(base)
    if args:
        return " or ".join("null" if a is type(None) else a.__name__ for a in args)
    return getattr(base, "__name__", str(base))


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
    """The docstring written under each field of a config section (its bases' fields too)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not issubclass(klass, msgspec.Struct) or klass.__module__ == "msgspec":
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
                docs[stmt.target.id] = str(nxt.value.value).strip()
    return docs


def default_of(f: msgspec.structs.FieldInfo) -> object:
    """A field's default value (msgspec.NODEFAULT when the field is required)."""
    return f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default


def describe(cls: type = TetherConfig, prefix: str = "") -> list[str]:
    """One line per leaf field: `key = default` and its doc, for --help. A family's line lists
    its kinds; each kind's field follows once, tagged with the kinds having it: `[vllm, sglang]`."""
    lines: list[str] = []
    docs = field_docs(cls)
    for f in msgspec.structs.fields(cls):
        value, kinds = default_of(f), kinds_of(f.type)
        if kinds is not None:
            lines.append(f"  {prefix}{f.name} = {value.kind!r}\n      {docs.get(f.name, '')} "
                         f"(kinds: {', '.join(kinds)})")
            lines.extend(_describe_kinds(kinds, f"{prefix}{f.name}."))
        elif _is_section(f.type):
            lines.extend(describe(f.type, prefix + f.name + "."))
        else:
            lines.append(_leaf(prefix + f.name, value, docs.get(f.name, "")))
    return lines


def _describe_kinds(kinds: dict[str, type], prefix: str) -> list[str]:
    fields: dict[str, tuple[msgspec.structs.FieldInfo, str, list[str]]] = {}
    for kind, section in kinds.items():
        docs = field_docs(section)
        for f in msgspec.structs.fields(section):
            fields.setdefault(f.name, (f, docs.get(f.name, ""), []))[2].append(kind)
    return [_leaf(prefix + name, default_of(f), f"[{', '.join(owners)}] {doc}")
            for name, (f, doc, owners) in fields.items()]


def _leaf(key: str, value: object, doc: str) -> str:
    shown = "required" if value is msgspec.NODEFAULT else repr(value)
    return f"  {key} = {shown}\n      {doc}"


def exit_now(code: int) -> None:
    """End the process with `code` once its own work is done: the atexit handlers run (they
    flush the logs, end multiprocessing's helpers), then the process exits without the
    interpreter's teardown, which frees every module and an engine's heap object by object and
    took 0.4-4 s on a loaded machine. An actor told to stop ends within a second (#45)."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def setup_process(tag: str) -> None:
    """Process set-up shared by the entry points, after the config parsed: offline HF (no hub
    at run time, no progress bars) and log lines tagged with the role, e.g. `actor[node-3]`."""
    import logging

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {tag} %(levelname)s %(message)s")
    for name in ("httpx", "httpx2"):  # OpenAI-client agents: a line per call
        logging.getLogger(name).setLevel(logging.WARNING)


def resolve_endpoint(target: str, socket: str = "control") -> str:
    """A role's LEARNER argument -> the learner's `socket` endpoint ("control" for actors and
    scorers, "weights" for relays): tcp://host:port or host:port as given, or a run directory
    or endpoints.json (which the learner writes once its sockets are bound)."""
    path = Path(target)
    if path.is_dir():
        path = path / "endpoints.json"
    if path.suffix == ".json":
        if not path.exists():
            raise ConfigError(f"{path} does not exist (has the learner started?)")
        return json.loads(path.read_text())[socket]
    if target.startswith("tcp://"):
        return target
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"learner address {target!r} must be tcp://host:port, host:port, "
                          f"a run directory or an endpoints.json (for its {socket} endpoint)")
    return f"tcp://{host}:{port}"
