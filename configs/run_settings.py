"""The run's settings that the learner owns and every actor runs: the task (prompts, reward,
sampling) and the agent. The learner sends them in the Welcome (`Welcome.run_settings`); an
actor replaces its own with them and logs each field that differed, so an actor started with
another preset (or none) cannot train on wrong rollouts. Everything else in an actor's config
(its engine, device, transport and keys, the local port and sandbox of its agent) stays its own.
"""

from __future__ import annotations

from typing import Any

import msgspec

from configs.loader import ConfigError
from configs.schema import TetherConfig, check_ranges

OWNED: dict[str, tuple[str, ...] | None] = {
    "task": None,  # every field
    "actors": ("agent",),  # the whole agent section (its kind and every field of it)
}
"""Per section, the fields the learner owns (None: the whole section)."""


def run_settings(cfg: TetherConfig) -> dict[str, dict[str, Any]]:
    """The learner's owned settings, as plain data for the Welcome."""
    out = {}
    for section, fields in OWNED.items():
        values = msgspec.to_builtins(getattr(cfg, section))
        out[section] = values if fields is None else {f: values[f] for f in fields}
    return out


def adopt(cfg: TetherConfig, settings: dict[str, dict[str, Any]]) -> tuple[TetherConfig, list[str]]:
    """`cfg` with the learner's `settings` in place of its own, and one `key=new (this actor's:
    old)` per field that differed. ConfigError if the result is no valid config."""
    if not settings:
        return cfg, []
    unknown = {f"{s}.{f}" for s, fields in settings.items() for f in fields
               if s not in OWNED or (OWNED[s] is not None and f not in OWNED[s])}
    if unknown:
        raise ConfigError(f"the learner sent run settings this actor does not own: "
                          f"{', '.join(sorted(unknown))}")
    mine = msgspec.to_builtins(cfg)
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in mine.items()}
    for section, fields in settings.items():
        merged[section].update(fields)  # owned fields are replaced whole, never merged
    try:
        new = msgspec.convert(merged, TetherConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"the learner's run settings do not fit this actor's version: {e}") \
            from None
    errors = check_ranges(new)
    if errors:
        raise ConfigError(f"the learner's run settings do not fit this actor's config: {errors[0]}")
    theirs, was = _flat(msgspec.to_builtins(new)), _flat(mine)
    changed = [f"{key}={theirs.get(key)!r} (this actor's: {was.get(key)!r})"
               for key in sorted(set(theirs) | set(was), key=_order(theirs, was))
               if key.split(".")[0] in settings and theirs.get(key) != was.get(key)]
    return new, changed


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} (sections and kind sections; other dicts stay values)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and (not prefix or "kind" in v):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _order(*trees: dict):
    """Sort keys in the order the config lists them (`kind` first)."""
    keys = [k for t in trees for k in t]
    return lambda key: (keys.index(key), key)
