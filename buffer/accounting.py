"""Where groups go when they are not trained on: the one tally of drops.

The lease table (expired, invalid, agent_error, uniform) and the replay buffer (stale) both count into
one `Drops`, shared by the learner's I/O and trainer threads; the capacity rule and the
summary's accounting read it from there:

    granted = consumed + dropped (all reasons) + outstanding + in_buffer
"""

from __future__ import annotations

import enum
import threading
from collections import Counter


class DropReason(str, enum.Enum):
    STALE = "stale"
    """Oldest token version is more than max_staleness behind the learner."""
    INVALID = "invalid"
    """The trajectory failed validation (bad token ids, NaN logprobs, lengths...)."""
    EXPIRED = "expired"
    """The actor holding the lease died or went silent; the prompt is granted again."""
    AGENT_ERROR = "agent_error"
    """The agent raised; the actor reported the error instead of a trajectory."""
    UNIFORM = "uniform"
    """Every sample of the group got the same reward (learner.drop_uniform_groups, DAPO)."""
    AFTER_END = "after_end"
    """Arrived after training ended (during the final evaluation) with the buffer full."""


class Drops:
    """Dropped groups by reason. Thread-safe: every method takes one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, reason: DropReason, n: int = 1) -> None:
        with self._lock:
            self._counts[reason.value] += n

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def load(self, counts: dict[str, int]) -> None:
        """Restore from `counts()` (a checkpoint); unknown reasons are an error."""
        with self._lock:
            self._counts = Counter({DropReason(k).value: int(v) for k, v in counts.items()})
