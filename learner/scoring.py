"""The scoring desk: the learner's broker between finished groups and the scorer fleet.

    actor ─GroupResult─▶ validate ─▶ ScoringDesk.add: one item per sample, queued
                                          │ dispatch (every tick): a batch of up to batch_size
                                          │ items (of any actors) to the least loaded scorer
                                          │ with a free slot (in_flight), once the queue holds
                                          │ batch_size or its oldest item waited max_wait_s
    scorer ◀─ScoreBatch── control ROUTER ◀┘
    scorer ──ScoreDone──▶ on_done: each live item's scores; a group whose every sample is
                          scored (or failed) is finished ─▶ taken by the server ─▶ buffer

Owned by the learner's I/O thread (learner/server.py), like the lease table: every method is
called under the server's lock and none blocks (sending is ZeroMQ NOBLOCK).

Each sample is scored exactly once. An item is live from `add` until its scores are applied
or it fails; a result for an item that is not live (a batch answered after it was given to
another scorer, or after its deadline) is counted in `late` and ignored. A batch goes back to
the front of the queue when its scorer dies (silent for peer_timeout_s, or a new incarnation
says hello), when it is not answered within batch_timeout_s, or when the scorer reports an error;
its items are counted in `reassigned`. An item still not scored deadline_s after its group
arrived scores 0 on every model scorer with `reward_failed` = 1 (every scored sample carries the
flag, 0 or 1). The counters obey

    samples = scored + failed + live        (items; `live` = queued or in a batch)

Why the learner brokers (rather than actors calling scorers directly): direct routing would save
one hop of each completion through the learner, but every actor would need every scorer's
address (scorers binding ports reachable from every actor node, CURVE keys both ways), its own
retry and reassignment, and a way to agree with other actors on which scorer is dead; "scored
exactly once" and the deadline would be decided in N places. Brokered, scorers are clients like
actors (only the control address; CURVE as for actors), batches mix every actor's samples, one
table (item id -> live) makes a reassigned batch's late answer harmless, and the learner's
accounting covers the samples being scored. The cost: completion ids cross the learner once
more (a few KB per group, beside its intake of the same bytes) and per-batch bookkeeping on the
I/O thread. Not built: per-sample streaming from actors (scoring starts when a group arrives).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from buffer.record import TrajGroup
from configs.schema import TetherConfig, model_scorers
from learner.leases import LeaseRecord
from transport import messages as m

log = logging.getLogger(__name__)


@dataclass
class Waiting:
    """A validated group whose samples are being scored."""

    msg: m.GroupResult
    rec: LeaseRecord
    group: TrajGroup
    arrived: float
    left: int
    """Samples not scored (nor failed) yet."""


@dataclass
class Batch:
    scorer_id: str
    items: list[int]
    sent_at: float


@dataclass
class ScorerLink:
    identity: bytes
    incarnation: str
    last_seen: float
    batches: set[int] = field(default_factory=set)


class ScoringDesk:
    def __init__(self, cfg: TetherConfig, send, now=time.monotonic) -> None:
        """`send(identity, message)`: a non-blocking send on the control socket."""
        self.cfg = cfg.scoring
        self.peer_timeout_s = cfg.transport.peer_timeout_s
        self.weights = {s.name: s.weight for s in model_scorers(cfg)}
        """Model scorer name -> its weight in the reward."""
        self.send = send
        self.now = now
        self.groups: dict[int, Waiting] = {}
        """Lease id -> its group while it is scored."""
        self.items: dict[int, tuple[int, int]] = {}
        """Live item id -> (lease id, position of its sample in the GroupResult)."""
        self.queue: deque[int] = deque()
        """Item ids waiting for a batch (ids that are no longer live are skipped)."""
        self.queued_at: dict[int, float] = {}
        self.next_item = 0
        self.batches: dict[int, Batch] = {}
        self.next_batch = 0
        self.scorers: dict[str, ScorerLink] = {}
        self.finished: list[Waiting] = []
        """Groups whose every sample is scored, for the server to take (`take_finished`)."""
        self.counts: Counter[str] = Counter()
        """samples, scored, failed, reassigned, late, batches (sent)."""

    # ------------------------------------------------------------ groups
    def add(self, msg: m.GroupResult, rec: LeaseRecord, group: TrajGroup) -> None:
        now = self.now()
        self.groups[rec.lease_id] = Waiting(msg, rec, group, now, left=len(msg.samples))
        for pos in range(len(msg.samples)):
            item = self.next_item
            self.next_item += 1
            self.items[item] = (rec.lease_id, pos)
            self.queue.append(item)
            self.queued_at[item] = now
        self.counts["samples"] += len(msg.samples)

    def take_finished(self) -> list[Waiting]:
        out, self.finished = self.finished, []
        return out

    def __len__(self) -> int:
        """Groups being scored (they hold buffer room: the server reads no more than it has)."""
        return len(self.groups)

    def records(self) -> list[LeaseRecord]:
        """The leases of the groups being scored (a checkpoint keeps them outstanding: a resumed
        run, to which no actor claims them, grants their prompts again)."""
        return [w.rec for w in self.groups.values()]

    # ------------------------------------------------------------ scorers
    def hello(self, identity: bytes, msg: m.ScorerHello) -> str:
        """Register a scorer; returns "" or why it is refused."""
        if sorted(msg.scorers) != sorted(self.weights):
            return (f"scorer {msg.scorer_id!r} runs {sorted(msg.scorers)}, the learner's "
                    f"task.scorers has the model scorers {sorted(self.weights)}")
        link = self.scorers.get(msg.scorer_id)
        if link is not None and link.incarnation == msg.incarnation:
            link.identity, link.last_seen = identity, self.now()
            return ""
        if link is not None:
            self._requeue_scorer(msg.scorer_id, "restarted")
        self.scorers[msg.scorer_id] = ScorerLink(identity, msg.incarnation, self.now())
        log.info("scorer %s joined; %d connected", msg.scorer_id, len(self.scorers))
        return ""

    def seen(self, scorer_id: str, identity: bytes) -> ScorerLink | None:
        """The registered scorer that sent a message (its liveness renewed), or None."""
        link = self.scorers.get(scorer_id)
        if link is None or link.identity != identity:
            return None
        link.last_seen = self.now()
        return link

    def on_done(self, msg: m.ScoreDone) -> str:
        """Apply a batch's answer; returns "" or why it is malformed (then the batch is given to
        another scorer)."""
        batch = self.batches.get(msg.batch_id)
        if batch is None or batch.scorer_id != msg.scorer_id:
            self.counts["late"] += sum(1 for _ in msg.results) or 1
            return ""
        if msg.error:
            log.warning("scorer %s failed batch %d: %s", msg.scorer_id, msg.batch_id, msg.error)
            self._requeue(msg.batch_id)
            return ""
        got = {r.item_id: r.scores for r in msg.results}
        problem = _bad_results(got, batch.items, set(self.weights))
        if problem:
            self._requeue(msg.batch_id)
            return f"score_done of {msg.scorer_id!r} for batch {msg.batch_id}: {problem}"
        self._close_batch(msg.batch_id)
        for item in batch.items:
            if item in self.items:
                self._apply(item, got[item], failed=False)
            else:
                self.counts["late"] += 1  # failed at its deadline meanwhile
        return ""

    # ------------------------------------------------------------ every tick
    def tick(self) -> None:
        """Give back the batches of dead or slow scorers, fail items past their deadline, send
        batches to free scorers."""
        now = self.now()
        for sid, link in list(self.scorers.items()):
            if now - link.last_seen > self.peer_timeout_s:
                log.warning("scorer %s silent for %.1fs: declared dead", sid, now - link.last_seen)
                self._requeue_scorer(sid, "dead")
                del self.scorers[sid]
        for bid, batch in list(self.batches.items()):
            if now - batch.sent_at > self.cfg.batch_timeout_s:
                log.warning("batch %d not scored by %s within %.0fs: giving it to another scorer",
                            bid, batch.scorer_id, self.cfg.batch_timeout_s)
                self._requeue(bid)
        for lease_id, w in list(self.groups.items()):
            if now - w.arrived > self.cfg.deadline_s:
                for item, (lid, _) in list(self.items.items()):
                    if lid == lease_id:
                        self._apply(item, {}, failed=True)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        c = self.cfg
        while True:
            while self.queue and self.queue[0] not in self.items:
                self.queue.popleft()  # failed at its deadline while queued
            if not self.queue:
                return
            if len(self.queue) < c.batch_size and now - self.queued_at[self.queue[0]] < c.max_wait_s:
                return
            free = [(len(link.batches), sid) for sid, link in self.scorers.items()
                    if len(link.batches) < c.in_flight]
            if not free:
                return
            sid = min(free)[1]
            take = []
            while self.queue and len(take) < c.batch_size:
                item = self.queue.popleft()
                if item in self.items:
                    take.append(item)
            self._send_batch(sid, take, now)

    def _send_batch(self, sid: str, take: list[int], now: float) -> None:
        bid = self.next_batch
        self.next_batch += 1
        link = self.scorers[sid]
        items = []
        for item in take:
            lease_id, pos = self.items[item]
            w = self.groups[lease_id]
            s = w.msg.samples[pos]
            start = sum(x.num_tokens for x in w.msg.samples[:pos])
            ids = w.msg.completion_ids.to_numpy()[start:start + s.num_tokens]
            items.append(m.ScoreItem(item_id=item, prompt_ids=m.Array.from_numpy(w.rec.prompt.token_ids),
                                     completion_ids=m.Array.from_numpy(ids),
                                     meta=w.rec.prompt.meta))
        self.batches[bid] = Batch(sid, take, now)
        link.batches.add(bid)
        self.counts["batches"] += 1
        self.send(link.identity, m.ScoreBatch(batch_id=bid, items=items))

    # ------------------------------------------------------------ internals
    def _close_batch(self, bid: int) -> Batch:
        batch = self.batches.pop(bid)
        link = self.scorers.get(batch.scorer_id)
        if link is not None:
            link.batches.discard(bid)
        return batch

    def _requeue(self, bid: int) -> None:
        """Put a batch's live items back at the front of the queue (they keep their age)."""
        batch = self._close_batch(bid)
        live = [i for i in batch.items if i in self.items]
        self.queue.extendleft(reversed(live))
        self.counts["reassigned"] += len(live)

    def _requeue_scorer(self, sid: str, why: str) -> None:
        bids = sorted(self.scorers[sid].batches)
        for bid in bids:
            self._requeue(bid)
        if bids:
            log.warning("scorer %s %s: its %d batch(es) go to other scorers", sid, why, len(bids))

    def _apply(self, item: int, scores: dict[str, float], failed: bool) -> None:
        """Give one sample its model scores (all 0 and the flag when `failed`)."""
        lease_id, pos = self.items.pop(item)
        self.queued_at.pop(item, None)
        w = self.groups[lease_id]
        s = w.msg.samples[pos]
        named = dict(s.scores)
        extra = 0.0
        for name, weight in self.weights.items():
            v = 0.0 if failed else scores[name]
            if math.isnan(v):
                named[f"{name}_unparsed"] = 1.0
                v = 0.0
            named[name] = v
            extra += weight * v
        named["reward_failed"] = float(failed)
        s.reward, s.scores = s.reward + extra, named
        self.counts["failed" if failed else "scored"] += 1
        w.left -= 1
        if w.left == 0:
            del self.groups[lease_id]
            by_index = sorted(w.msg.samples, key=lambda x: x.sample_index)
            w.group.rewards = np.array([x.reward for x in by_index], dtype=np.float32)
            self.finished.append(w)

    def snapshot(self) -> dict:
        return {**{k: self.counts.get(k, 0) for k in
                   ("samples", "scored", "failed", "reassigned", "late", "batches")},
                "live": len(self.items), "groups": len(self.groups),
                "scorers_connected": len(self.scorers)}


def _bad_results(got: dict[int, dict[str, float]], items: list[int], names: set[str]) -> str:
    if set(got) != set(items):
        return f"results for items {sorted(got)[:8]}, the batch has {sorted(items)[:8]}"
    for item, scores in got.items():
        if set(scores) != names:
            return f"item {item} has scores {sorted(scores)}, expected {sorted(names)}"
        if any(math.isinf(v) for v in scores.values()):
            return f"item {item} has an infinite score"
    return ""
