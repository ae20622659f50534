"""The scorers family's vocabulary: what a model scorer is given and what it returns.

A model scorer (classifier, judge, remote) scores a batch of samples at once:

    class MyScorer:
        name: str
        weight: float
        async def score(self, items: list[Item]) -> list[float]: ...

One float per item, in order; NaN = the scorer could not read a score for that item (a judge's
text that its parser does not match): it counts as 0 and is flagged `<name>_unparsed`. An
exception fails the whole batch (the learner gives its samples to another scorer). Model
scorers are frozen: they load their weights once and never take policy versions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Item:
    """One sample to score: the prompt and completion as text (decoded with the policy's
    tokenizer, special tokens skipped) and as ids, and the row's label and metadata."""

    prompt: str
    completion: str
    label: Any
    metadata: dict
    prompt_ids: list[int]
    completion_ids: list[int]


class ModelScorer(Protocol):
    name: str
    weight: float

    async def score(self, items: list[Item]) -> list[float]:
        """One score per item (NaN: unreadable); never blocks the event loop."""

    async def close(self) -> None:
        """Release the model / engine / connections (on the loop that scored)."""


def label_and_metadata(meta: dict[str, str]) -> tuple[Any, dict]:
    """A prompt's `meta` (tasks/base.py) as the reward's (label, metadata): the data task's
    JSON-encoded `label` and `metadata`; other tasks' meta as the metadata, no label."""
    label = json.loads(meta["label"]) if "label" in meta else None
    metadata = json.loads(meta["metadata"]) if "metadata" in meta else dict(meta)
    return label, metadata


def make_item(tokenizer, meta: dict[str, str], prompt_ids, completion_ids) -> Item:
    p, c = [int(x) for x in prompt_ids], [int(x) for x in completion_ids]
    label, metadata = label_and_metadata(meta)
    return Item(prompt=tokenizer.decode(p, skip_special_tokens=True),
                completion=tokenizer.decode(c, skip_special_tokens=True), label=label,
                metadata=metadata, prompt_ids=p, completion_ids=c)
