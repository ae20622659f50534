"""Work leases: the learner owns the prompt stream and decides who generates what, and when.

Admission (AReaL's capacity rule): at policy version `v`, leases are granted only while

    granted - dropped  <  (max_staleness + v + 1) * prompts_per_step

so an actor never starts work that is certain to be too stale; nor, with `max_steps` given,
work for steps past the run's last (`max_staleness + v + 1` is capped at `max_steps`). A lease granted at version `v`
must be generated with weights of version >= `v` (its `min_version`): in-order consumption then
trains on it by step `v + max_staleness`. With max_staleness = 0, the groups of batch `v` are
granted only once version `v` is published: synchronous PPO.

Accounting invariant (in groups): granted = consumed + dropped + outstanding + buffered.

Evaluation leases (`add_eval`): one held-out prompt, one sample, `min_version` = the version
evaluated. They are granted before training leases, outside the capacity rule and the
accounting (they are never trained on), and an expired one goes back to the front of their
queue. After `close_training` only evaluation leases are granted (the run's end).

After a restart from a checkpoint the leases outstanding in it stay outstanding, but only those
an actor says it still holds (its Hello): the others were delivered to the run that died, whose
training since the checkpoint is lost, so their prompts are granted again. Leases that run
granted after the checkpoint are void: lease ids continue at least `RESUME_GAP` above the
checkpoint's, so a late result of one can never be taken for a new lease with the same id.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from buffer.accounting import DropReason, Drops
from tasks.base import Prompt, Task

log = logging.getLogger(__name__)

RESUME_GAP = 1 << 32
"""A resumed run's lease ids start a random multiple (1 to 2^16) of this above its checkpoint's
counter: above any id the run that died could have granted after its checkpoint, and apart from
those of another run resumed from the same checkpoint."""


@dataclass
class LeaseRecord:
    lease_id: int
    prompt: Prompt
    actor_id: str
    incarnation: str
    num_samples: int
    min_version: int
    granted_at: float = field(default_factory=time.monotonic)
    eval_version: int | None = None
    """Evaluation leases: the policy version evaluated (None: a training lease)."""


class LeaseTable:
    """Not thread-safe: owned by the learner's I/O thread."""

    def __init__(self, task: Task, prompts_per_step: int, group_size: int, max_staleness: int,
                 drops: Drops | None = None, max_steps: int | None = None) -> None:
        self.task = task
        self.max_steps = max_steps
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.cursor = 0
        """Index of the next fresh training prompt."""
        self.next_lease_id = 0
        self.granted = 0
        self.completed = 0
        self.drops = Drops() if drops is None else drops
        """Every drop, the buffer's stale ones included (the learner shares one Drops)."""
        self.outstanding: dict[int, LeaseRecord] = {}
        self.retry: deque[int] = deque()
        """Prompt indices whose lease expired: granted again before fresh prompts."""
        self.void = range(0)
        """Ids the run that died may have granted after the checkpoint this run resumed from
        (from that checkpoint's lease counter up to this run's first id)."""
        self.eval_queue: deque[tuple[int, Prompt]] = deque()
        """Evaluation prompts not granted yet, with the version each evaluates."""
        self.evaluating: dict[int, LeaseRecord] = {}
        """Evaluation leases granted and not completed."""
        self.training_open = True
        """False once training ended: only evaluation leases are granted."""

    def add_eval(self, version: int, prompts: list[Prompt]) -> None:
        """Queue one evaluation lease per prompt, evaluating `version`."""
        self.eval_queue.extend((version, p) for p in prompts)

    def close_training(self) -> None:
        self.training_open = False

    def capacity(self, version: int) -> int:
        """How many more groups may be granted at `version`."""
        live = self.granted - self.drops.total()
        steps = self.max_staleness + version + 1
        if self.max_steps is not None:
            steps = min(steps, self.max_steps)
        return steps * self.prompts_per_step - live

    def grant(self, actor_id: str, incarnation: str, max_groups: int,
              version: int) -> list[LeaseRecord]:
        """Evaluation leases first, then training leases as the capacity rule admits."""
        out = []
        while self.eval_queue and len(out) < max_groups:
            evaluated, prompt = self.eval_queue.popleft()
            rec = LeaseRecord(lease_id=self.next_lease_id, prompt=prompt, actor_id=actor_id,
                              incarnation=incarnation, num_samples=1, min_version=evaluated,
                              eval_version=evaluated)
            self.next_lease_id += 1
            self.evaluating[rec.lease_id] = rec
            out.append(rec)
        n = min(max_groups - len(out), self.capacity(version)) if self.training_open else 0
        for _ in range(max(n, 0)):
            index = self.retry.popleft() if self.retry else self._next_cursor()
            rec = LeaseRecord(lease_id=self.next_lease_id, prompt=self.task.train_prompt(index),
                              actor_id=actor_id, incarnation=incarnation,
                              num_samples=self.group_size,
                              min_version=version)
            self.next_lease_id += 1
            self.granted += 1
            self.outstanding[rec.lease_id] = rec
            out.append(rec)
        return out

    def _next_cursor(self) -> int:
        index = self.cursor
        self.cursor += 1
        return index

    def complete(self, lease_id: int, actor_id: str) -> LeaseRecord | None:
        """Close a lease whose trajectory arrived; None if it is not outstanding for this actor.
        An evaluation lease's record has `eval_version` set."""
        rec = self.evaluating.get(lease_id)
        if rec is not None and rec.actor_id == actor_id:
            del self.evaluating[lease_id]
            return rec
        rec = self.outstanding.get(lease_id)
        if rec is None or rec.actor_id != actor_id:
            return None
        del self.outstanding[lease_id]
        self.completed += 1
        return rec

    def held_by(self, actor_id: str) -> list[int]:
        """The ids of the leases outstanding for `actor_id`."""
        return sorted(r.lease_id for r in (*self.outstanding.values(), *self.evaluating.values())
                      if r.actor_id == actor_id)

    def is_void(self, lease_id: int) -> bool:
        """Granted by the run that died, after the checkpoint this run resumed from."""
        return lease_id in self.void

    def is_closed(self, lease_id: int) -> bool:
        """Granted once and no longer outstanding (completed, dropped or expired): a second
        result for it is a duplicate. Derived from the id counter, so it costs no memory and
        survives a checkpoint."""
        return (0 <= lease_id < self.next_lease_id and lease_id not in self.outstanding
                and lease_id not in self.evaluating)

    def drop(self, rec: LeaseRecord, reason: DropReason) -> None:
        """Count a lease whose trajectory will never be trained on (already removed or not)."""
        self.outstanding.pop(rec.lease_id, None)
        self.drops.add(reason)

    def expire_actor(self, actor_id: str, incarnation: str | None = None,
                     held: Collection[int] = ()) -> int:
        """Expire the leases granted to `actor_id` except those its process `incarnation` says
        it holds (`held`, from its Hello); their prompts are granted again. Returns the count."""
        recs = [r for r in self.outstanding.values() if r.actor_id == actor_id
                and not (r.incarnation == incarnation and r.lease_id in held)]
        self._requeue_evals([r for r in self.evaluating.values() if r.actor_id == actor_id
                             and not (r.incarnation == incarnation and r.lease_id in held)])
        return self._expire(recs, f"actor {actor_id}")

    def expire_unclaimed(self, registered: set[str], granted_before: float) -> int:
        """Expire leases of actors that are not connected, granted (or restored) before the time."""
        recs = [r for r in self.outstanding.values()
                if r.actor_id not in registered and r.granted_at < granted_before]
        self._requeue_evals([r for r in self.evaluating.values()
                             if r.actor_id not in registered and r.granted_at < granted_before])
        return self._expire(recs, "unclaimed")

    def _requeue_evals(self, recs: list[LeaseRecord]) -> None:
        """Evaluation leases of a lost actor: granted again, first (not drops: never trained)."""
        for rec in reversed(recs):
            del self.evaluating[rec.lease_id]
            self.eval_queue.appendleft((rec.eval_version, rec.prompt))

    def _expire(self, recs: list[LeaseRecord], whose: str) -> int:
        for rec in recs:
            self.drop(rec, DropReason.EXPIRED)
            self.retry.append(rec.prompt.prompt_id)
        if recs:
            log.warning("expired %d lease(s) (%s); their prompts will be granted again",
                        len(recs), whose)
        return len(recs)

    def state(self) -> dict:
        """What a checkpoint needs to continue the prompt stream and the accounting."""
        return {"cursor": self.cursor, "next_lease_id": self.next_lease_id,
                "granted": self.granted, "completed": self.completed,
                "dropped": self.drops.counts(), "retry": list(self.retry),
                "outstanding": [[r.lease_id, r.prompt.prompt_id, r.actor_id, r.incarnation,
                                 r.num_samples, r.min_version]
                                for r in self.outstanding.values()]}

    def load_state(self, state: dict) -> None:
        """Restore from `state()`. Leases outstanding at the checkpoint stay outstanding: their
        actors may still deliver (they reconnect on their own and say which they hold);
        unclaimed ones expire after peer_timeout_s like any other (`expire_unclaimed`)."""
        self.cursor = state["cursor"]
        floor = state["next_lease_id"]
        self.next_lease_id = floor + RESUME_GAP * (1 + secrets.randbelow(1 << 16))
        self.void = range(floor, self.next_lease_id)
        self.granted = state["granted"]
        self.completed = state["completed"]
        self.drops.load(state["dropped"])
        self.retry = deque(state["retry"])
        for lease_id, prompt_id, actor_id, inc, n, min_v in state["outstanding"]:
            self.outstanding[lease_id] = LeaseRecord(
                lease_id=lease_id, prompt=self.task.train_prompt(prompt_id), actor_id=actor_id,
                incarnation=inc, num_samples=n, min_version=min_v)

    def counts(self) -> dict:
        return {"granted": self.granted, "completed": self.completed,
                "outstanding": len(self.outstanding), "dropped": self.drops.counts(),
                "cursor": self.cursor}
