"""Bounded replay buffer of complete GRPO groups, with staleness enforcement at consumption.

Threads: the learner's I/O thread calls `put` (only after `has_room()`; while the buffer is full
it stops reading the trajectory socket, so backpressure reaches the actors through ZeroMQ's
high-water marks). The trainer thread calls `take`, which blocks until enough fresh groups are
there or the timeout passes. One condition variable guards all state.

Staleness rule (the one place it is enforced at consumption): a group may be trained on at
version `v` only if `v - group.min_version <= max_staleness`; older groups leave the buffer and
are counted: as dropped (stale) if never trained on, as consumed otherwise.

Replay: with `max_reuse` > 1 a group stays in the buffer until it was served that many times
(or went stale); `sampling` picks which fresh groups a batch gets: `fifo` (oldest first),
`newest`, or `uniform` (seeded). A batch never holds the same group twice.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from buffer.accounting import DropReason, Drops
from buffer.record import TrajGroup, from_arrays, to_arrays


SAMPLING = ("fifo", "newest", "uniform")


class ReplayBuffer:
    def __init__(self, capacity: int, max_staleness: int, max_reuse: int = 1,
                 sampling: str = "fifo", seed: int = 0, drops: Drops | None = None) -> None:
        if sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.max_reuse = max_reuse
        self.sampling = sampling
        self._rng = np.random.default_rng(seed)
        self._groups: deque[TrajGroup] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._takers = 0
        """Threads inside `take` (blocked or about to return)."""
        self.received = 0
        self.consumed = 0
        """Groups trained on at least once that have left the buffer."""
        self.served = 0
        """Group-servings in batches (> consumed when groups are reused)."""
        self.drops = Drops() if drops is None else drops
        """Stale groups are counted here (shared with the lease table in the learner)."""

    def has_room(self) -> bool:
        with self._cond:
            return len(self._groups) < self.capacity

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def room(self) -> int:
        """How many groups `put_many` may add now (single producer: it only grows meanwhile)."""
        with self._cond:
            return self.capacity - len(self._groups)

    def put(self, group: TrajGroup) -> None:
        """Add a complete group. The caller must have checked `has_room()` (single producer)."""
        self.put_many([group])

    def put_many(self, groups: list[TrajGroup]) -> None:
        """Add complete groups under one lock and one wake-up of `take`. The caller must have
        checked `room()` (single producer)."""
        if not groups:
            return
        with self._cond:
            if len(self._groups) + len(groups) > self.capacity:
                raise RuntimeError("ReplayBuffer.put on a full buffer: check room() first")
            self._groups.extend(groups)
            self.received += len(groups)
            self._cond.notify_all()

    def take(self, n: int, version: int, timeout: float) -> list[TrajGroup] | None:
        """Return `n` distinct groups fresh enough for `version`, sorted by lease id.

        Drops (and counts) stale groups it meets. Blocks until `n` fresh groups are present;
        returns None if `timeout` seconds pass first or the buffer is closed."""
        with self._cond:
            self._takers += 1
            self._cond.notify_all()  # for wait_for_takers
            ok = self._cond.wait_for(lambda: self._closed or self._count_fresh(version) >= n,
                                     timeout=timeout)
            self._takers -= 1
            if not ok or self._closed:
                return None
            batch = [self._groups[i] for i in self._pick(n)]
            for g in batch:
                g.uses += 1
                if g.uses >= self.max_reuse:
                    self._groups.remove(g)
                    self.consumed += 1
            self.served += n
            self._cond.notify_all()
        return sorted(batch, key=lambda g: g.lease_id)

    def _pick(self, n: int) -> list[int]:
        size = len(self._groups)
        if self.sampling == "fifo":
            return list(range(n))
        if self.sampling == "newest":
            return list(range(size - n, size))
        return sorted(self._rng.choice(size, size=n, replace=False).tolist())

    def _count_fresh(self, version: int) -> int:
        """Remove every group too stale for `version` (counted); return how many remain."""
        stale = [g for g in self._groups if version - g.min_version > self.max_staleness]
        for g in stale:
            self._groups.remove(g)
            if g.uses:
                self.consumed += 1
            else:
                self.drops.add(DropReason.STALE)
        return len(self._groups)

    def export(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Counters and the waiting groups for a checkpoint: (JSON-able state, the groups'
        arrays from the record codec, np.savez-able without pickle)."""
        with self._cond:
            return self.counts(), to_arrays(list(self._groups))

    def restore(self, state: dict, arrays) -> None:
        """Inverse of `export`: counters and the groups that were waiting, in order."""
        with self._cond:
            self.received, self.consumed = state["received"], state["consumed"]
            self.served = state["served"]
            self._groups.extend(from_arrays(arrays))

    def wait_for_takers(self, n: int, timeout: float) -> bool:
        """Block until at least `n` threads are inside `take` (lets a caller know the trainer
        is waiting, not working); False if `timeout` passes first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._takers >= n, timeout=timeout)

    def close(self) -> None:
        """Wake any blocked `take` so the trainer can shut down."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def counts(self) -> dict:
        with self._cond:
            return {"received": self.received, "consumed": self.consumed, "served": self.served,
                    "dropped": self.drops.counts(), "size": len(self._groups),
                    "capacity": self.capacity}
