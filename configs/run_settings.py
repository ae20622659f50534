"""The run's settings that the learner owns and every actor runs: the task (prompts, reward,
sampling) and the agent. The learner sends them in the Welcome (`Welcome.run_settings`); an
actor replaces its own with them and logs each field that differed, so an actor started with
another preset (or none) cannot train on wrong rollouts. Everything else in an actor's config
(its engine, device, transport and keys, the local port and sandbox of its agent) stays its own.
"""

from __future__ import annotations

from typing import Any

import msgspec

from configs.loader import ConfigError, merge
from configs.schema import TetherConfig, check_ranges

OWNED: dict[str, tuple[str, ...] | None] = {
    "task": None,  # every field
    "actors": ("agent", "tools", "max_turns", "max_total_tokens", "tool_timeout_s", "tool_parser",
               "openai_agent", "environment"),
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
    try:
        new = msgspec.convert(merge(mine, settings), TetherConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"the learner's run settings do not fit this actor's version: {e}") \
            from None
    errors = check_ranges(new)
    if errors:
        raise ConfigError(f"the learner's run settings do not fit this actor's config: {errors[0]}")
    theirs = msgspec.to_builtins(new)
    changed = [f"{section}.{name}={theirs[section][name]!r} (this actor's: {mine[section][name]!r})"
               for section, fields in settings.items() for name in fields
               if theirs[section][name] != mine[section][name]]
    return new, changed
