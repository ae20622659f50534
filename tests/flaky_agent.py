"""An openai-kind agent (tests only) whose 4th and 8th calls in a process raise: a user agent
with a bug that shows on some prompts (in the learner's first evaluation, which makes the
process's first 8 calls)."""

from __future__ import annotations

import itertools

from actors.agents.openai.example import chat

_calls = itertools.count()


def agent(base_url: str, messages: list[dict]) -> None:
    if next(_calls) in (3, 7):
        raise RuntimeError("flaky agent: a bug on this prompt")
    chat(base_url, messages)
