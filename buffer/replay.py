"""Bounded replay buffer of complete GRPO groups, with staleness enforcement at consumption.

Threads: the learner's I/O thread calls `put` (only after `has_room()`; while the buffer is full
it stops reading the trajectory socket, so backpressure reaches the actors through ZeroMQ's
high-water marks). The trainer thread calls `take`, which blocks until enough fresh groups are
there or the timeout passes. One condition variable guards all state.

Staleness rule (the one place it is enforced at consumption): a group may be trained on at
version `v` only if `v - group.min_version <= max_staleness`; older groups are dropped and counted.
"""

from __future__ import annotations

import enum
import threading
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np


class DropReason(str, enum.Enum):
    STALE = "stale"
    """Oldest token version is more than max_staleness behind the learner."""
    INVALID = "invalid"
    """The trajectory failed validation (bad token ids, NaN logprobs, lengths...)."""
    EXPIRED = "expired"
    """The actor holding the lease died or went silent; the prompt is granted again."""
    AGENT_ERROR = "agent_error"
    """The agent raised; the actor reported the error instead of a trajectory."""


@dataclass
class TrajGroup:
    """One finished lease: `num_samples` rollouts of one prompt (learner-side arrays)."""

    lease_id: int
    prompt_id: int
    actor_id: str
    prompt_ids: np.ndarray
    completions: list[np.ndarray]
    logprobs: list[np.ndarray]
    versions: list[np.ndarray]
    loss_masks: list[np.ndarray]
    rewards: np.ndarray

    @property
    def min_version(self) -> int:
        return min((int(v.min()) for v in self.versions if v.size), default=0)

    @property
    def max_version(self) -> int:
        return max((int(v.max()) for v in self.versions if v.size), default=0)

    @property
    def num_tokens(self) -> int:
        return sum(int(c.size) for c in self.completions)


class ReplayBuffer:
    def __init__(self, capacity: int, max_staleness: int) -> None:
        self.capacity = capacity
        self.max_staleness = max_staleness
        self._groups: deque[TrajGroup] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.received = 0
        self.consumed = 0
        self.dropped: Counter[str] = Counter()

    def has_room(self) -> bool:
        with self._cond:
            return len(self._groups) < self.capacity

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def put(self, group: TrajGroup) -> None:
        """Add a complete group. The caller must have checked `has_room()` (single producer)."""
        with self._cond:
            if len(self._groups) >= self.capacity:
                raise RuntimeError("ReplayBuffer.put on a full buffer: check has_room() first")
            self._groups.append(group)
            self.received += 1
            self._cond.notify_all()

    def take(self, n: int, version: int, timeout: float) -> list[TrajGroup] | None:
        """Remove and return `n` groups fresh enough for `version` (FIFO), sorted by lease id.

        Drops (and counts) stale groups it meets. Blocks until `n` fresh groups are present;
        returns None if `timeout` seconds pass first or the buffer is closed."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed or self._count_fresh(version) >= n,
                                     timeout=timeout)
            if not ok or self._closed:
                return None
            batch = [self._groups.popleft() for _ in range(n)]
            self.consumed += n
            self._cond.notify_all()
        return sorted(batch, key=lambda g: g.lease_id)

    def _count_fresh(self, version: int) -> int:
        """Drop (and count) every group too stale for `version`; return how many remain."""
        stale = [g for g in self._groups if version - g.min_version > self.max_staleness]
        for g in stale:
            self._groups.remove(g)
            self.dropped[DropReason.STALE.value] += 1
        return len(self._groups)

    def close(self) -> None:
        """Wake any blocked `take` so the trainer can shut down."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def counts(self) -> dict:
        with self._cond:
            return {"received": self.received, "consumed": self.consumed,
                    "dropped": dict(self.dropped), "size": len(self._groups),
                    "capacity": self.capacity}
