"""From a judge's text to a score: a regex's first group, or a user function by import path;
and the judge's prompt from its template."""

from __future__ import annotations

import math
import re
from typing import Callable

from tasks.scorers.base import Item


def make_parser(spec: str, scale: float, field_name: str) -> Callable[[str], float]:
    """`spec` is `module:fn` (fn(text) -> float) or a regex whose first group (or whole match)
    is a number; the result is divided by `scale`. Unreadable text gives NaN."""
    if re.fullmatch(r"[\w.]+:\w+|.+\.py:\w+", spec):
        from tasks.rewards import load_function

        fn = load_function(spec, field_name)
        return lambda text: _number(fn(text)) / scale
    try:
        rx = re.compile(spec)
    except re.error as e:
        raise ValueError(f"{field_name} {spec!r} is not a valid regex: {e}") from None

    def parse(text: str) -> float:
        m = rx.search(text)
        if m is None:
            return math.nan
        return _number(m.group(1) if rx.groups else m.group(0)) / scale

    return parse


def _number(v) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return math.nan
    return x if math.isfinite(x) else math.nan


def fill(template: str, item: Item) -> str:
    """The template with {prompt}, {completion} and {label} filled in (other braces kept)."""
    return (template.replace("{prompt}", item.prompt).replace("{completion}", item.completion)
            .replace("{label}", "" if item.label is None else str(item.label)))
