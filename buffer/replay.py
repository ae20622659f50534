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

import enum
import functools
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
    """One finished lease: `num_samples` rollouts of one prompt.

    Per-token arrays are read-only and keep the dtype they arrived in (ids/versions: an
    integer type, logprobs: a float type, loss_masks: integer or bool 0/1); consumers cast."""

    lease_id: int
    prompt_id: int
    actor_id: str
    prompt_ids: np.ndarray
    completions: list[np.ndarray]
    logprobs: list[np.ndarray]
    versions: list[np.ndarray]
    loss_masks: list[np.ndarray]
    rewards: np.ndarray
    uses: int = 0
    """How many batches this group has been served in."""

    @functools.cached_property
    def min_version(self) -> int:
        """Oldest version among model tokens (loss_mask 1); tool tokens were sampled by no policy.
        Computed once (the arrays never change): `take` asks for it on every wake-up."""
        return min((int(v[m > 0].min()) for v, m in zip(self.versions, self.loss_masks)
                    if (m > 0).any()), default=0)

    @functools.cached_property
    def max_version(self) -> int:
        return max((int(v[m > 0].max()) for v, m in zip(self.versions, self.loss_masks)
                    if (m > 0).any()), default=0)

    @property
    def num_tokens(self) -> int:
        return sum(int(c.size) for c in self.completions)


SAMPLING = ("fifo", "newest", "uniform")


class ReplayBuffer:
    def __init__(self, capacity: int, max_staleness: int, max_reuse: int = 1,
                 sampling: str = "fifo", seed: int = 0) -> None:
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
        self.received = 0
        self.consumed = 0
        """Groups trained on at least once that have left the buffer."""
        self.served = 0
        """Group-servings in batches (> consumed when groups are reused)."""
        self.dropped: Counter[str] = Counter()

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
            ok = self._cond.wait_for(lambda: self._closed or self._count_fresh(version) >= n,
                                     timeout=timeout)
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
                self.dropped[DropReason.STALE.value] += 1
        return len(self._groups)

    def export(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Counters, group metadata and arrays for a checkpoint (np.savez-able, no pickle)."""
        with self._cond:
            meta, arrays = [], {}
            for i, g in enumerate(self._groups):
                meta.append([g.lease_id, g.prompt_id, g.actor_id, g.uses, len(g.completions)])
                arrays[f"g{i}_prompt"] = g.prompt_ids
                arrays[f"g{i}_rewards"] = g.rewards
                for j, (c, lp, v, lm) in enumerate(zip(g.completions, g.logprobs, g.versions,
                                                       g.loss_masks)):
                    for name, a in (("ids", c), ("lp", lp), ("ver", v), ("mask", lm)):
                        arrays[f"g{i}_s{j}_{name}"] = a
            return {**self.counts(), "groups": meta}, arrays

    def restore(self, state: dict, arrays) -> None:
        """Inverse of `export`: counters and the groups that were waiting, in order."""
        with self._cond:
            self.received, self.consumed = state["received"], state["consumed"]
            self.served = state["served"]
            self.dropped = Counter(state["dropped"])
            for i, (lease_id, prompt_id, actor_id, uses, n) in enumerate(state["groups"]):
                def col(name: str) -> list[np.ndarray]:
                    return [arrays[f"g{i}_s{j}_{name}"] for j in range(n)]

                self._groups.append(TrajGroup(
                    lease_id=lease_id, prompt_id=prompt_id, actor_id=actor_id,
                    prompt_ids=arrays[f"g{i}_prompt"], completions=col("ids"), logprobs=col("lp"),
                    versions=col("ver"), loss_masks=col("mask"), rewards=arrays[f"g{i}_rewards"],
                    uses=uses))

    def close(self) -> None:
        """Wake any blocked `take` so the trainer can shut down."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def counts(self) -> dict:
        with self._cond:
            return {"received": self.received, "consumed": self.consumed, "served": self.served,
                    "dropped": dict(self.dropped), "size": len(self._groups),
                    "capacity": self.capacity}
