"""The scoring desk: the learner's broker between finished samples and the scorer fleet.

    actor ─SampleDone─▶ (valid, lease outstanding) ─▶ ScoringDesk.stream: one item, queued
    actor ─GroupResult─▶ validate ─▶ ScoringDesk.add: the group joins its streamed items (same
                                     ids, checked); a sample not streamed becomes an item
                                          │ dispatch (every tick): a batch of up to batch_size
                                          │ items (of any actors) to the least loaded scorer
                                          │ with a free slot (in_flight), once the queue holds
                                          │ batch_size or its oldest item waited max_wait_s
    scorer ◀─ScoreBatch── control ROUTER ◀┘
    scorer ──ScoreDone──▶ on_done: each live item's scores are kept; a group that has arrived
                          and whose every sample is scored (or failed) is finished ─▶ taken by
                          the server ─▶ buffer

Owned by the learner's I/O thread (learner/server.py), like the lease table: every method is
called under the server's lock and none blocks (sending is ZeroMQ NOBLOCK).

Actors stream each sample as its rollout ends (SampleDone on the control socket, which is read
even while the buffer is full), so samples are scored while the rest of their group is still
generated; the group reaches the buffer once its GroupResult has arrived and every sample is
scored. A SampleDone that comes after its GroupResult (the two travel on different sockets) is
ignored (`stream_late`); the group's copy was queued instead.

Each sample is scored exactly once. An item is live (queued or in a batch) until its scores
arrive or it fails, then held until its group is finished. A result for an item that is not live
(a batch answered after it was given to another scorer, or after its deadline) is counted in
`late` and ignored. A batch goes back to the front of the queue when its scorer dies (silent for
peer_timeout_s, or a new incarnation says hello), when it is not answered within
batch_timeout_s, or when the scorer reports an error; its items are counted in `reassigned`. An
item still not scored deadline_s after its group arrived scores 0 on every model scorer with
`reward_failed` = 1 (every scored sample carries the flag, 0 or 1). Streamed items of a lease
that ends without its group reaching the desk (actor dead, agent error, invalid group) are
dropped: `discarded` if not scored yet, `wasted` if they were. The counters obey

    samples = scored + failed + live + discarded          (items)
    scored + failed = delivered + held + wasted           (delivered: in groups sent on)

Why the learner brokers (rather than actors calling scorers directly): direct routing would save
one hop of each completion through the learner, but every actor would need every scorer's
address (scorers binding ports reachable from every actor node, CURVE keys both ways), its own
retry and reassignment, and a way to agree with other actors on which scorer is dead; "scored
exactly once" and the deadline would be decided in N places. Brokered, scorers are clients like
actors (only the control address; CURVE as for actors), batches mix every actor's samples, one
table (item id -> live) makes a reassigned batch's late answer harmless, and the learner's
accounting covers the samples being scored. The cost: completion ids cross the learner once
more (a few KB per sample, twice with streaming: in SampleDone and in the GroupResult) and
per-batch bookkeeping on the I/O thread.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from buffer.record import TrajGroup
from configs.schema import TetherConfig, model_scorers
from learner.leases import LeaseRecord
from transport import messages as m

log = logging.getLogger(__name__)


class ItemState(enum.Enum):
    QUEUED = "queued"
    """Waiting for a batch."""
    SENT = "sent"
    """In a batch at a scorer."""
    HELD = "held"
    """Scored (or failed): waiting until its group has arrived and every sample is scored."""


@dataclass
class Item:
    """One sample to score."""

    lease_id: int
    sample_index: int
    completion_ids: np.ndarray
    queued_at: float
    state: ItemState = ItemState.QUEUED
    scores: dict[str, float] = field(default_factory=dict)
    failed: bool = False


@dataclass
class Waiting:
    """A validated group whose samples are being scored."""

    msg: m.GroupResult
    rec: LeaseRecord
    group: TrajGroup
    arrived: float


@dataclass
class Entry:
    """A lease with samples at the desk: streamed ones first, then (`waiting`) its group."""

    rec: LeaseRecord
    items: dict[int, int] = field(default_factory=dict)
    """Sample index -> item id."""
    waiting: Waiting | None = None
    """Set when its GroupResult arrives."""


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
    def __init__(self, cfg: TetherConfig, send, outstanding: Callable[[int], bool],
                 now=time.monotonic) -> None:
        """`send(identity, message)`: a non-blocking send on the control socket;
        `outstanding(lease_id)`: whether a lease is still granted and not completed (a lease
        with streamed samples that is not, and whose group never came, is dropped)."""
        self.cfg = cfg.scoring
        self.peer_timeout_s = cfg.transport.peer_timeout_s
        self.weights = {s.name: s.weight for s in model_scorers(cfg)}
        """Model scorer name -> its weight in the reward."""
        self.send = send
        self.outstanding = outstanding
        self.now = now
        self.entries: dict[int, Entry] = {}
        """Lease id -> its samples at the desk."""
        self.arrived = 0
        """Entries whose group has arrived (`len(self)`)."""
        self.items: dict[int, Item] = {}
        """Item id -> the item, until its group is finished or its lease dropped."""
        self.queue: deque[int] = deque()
        """Item ids waiting for a batch (ids no longer QUEUED are skipped)."""
        self.next_item = 0
        self.batches: dict[int, Batch] = {}
        self.next_batch = 0
        self.scorers: dict[str, ScorerLink] = {}
        self.finished: list[Waiting] = []
        """Groups whose every sample is scored, for the server to take (`take_finished`)."""
        self.counts: Counter[str] = Counter()
        """samples, streamed, stream_late, early (scored before their group arrived), scored,
        failed, delivered, discarded, wasted, reassigned, late, batches (sent)."""

    # ------------------------------------------------------------ samples and groups
    def stream(self, rec: LeaseRecord, sample_index: int, completion_ids: np.ndarray) -> None:
        """Queue one streamed sample of an outstanding lease (checked by the server). A second
        SampleDone for the same sample is counted in `stream_late` and ignored."""
        entry = self.entries.setdefault(rec.lease_id, Entry(rec))
        if sample_index in entry.items:
            self.counts["stream_late"] += 1
            return
        entry.items[sample_index] = self._new_item(rec.lease_id, sample_index, completion_ids)
        self.counts["streamed"] += 1

    def stream_late(self) -> None:
        """Count a SampleDone whose lease is closed: its group arrived first (or was dropped)."""
        self.counts["stream_late"] += 1

    def add(self, msg: m.GroupResult, rec: LeaseRecord, group: TrajGroup) -> str:
        """The group of a lease arrives: its streamed samples must carry the group's ids, the
        others are queued now. Returns "" or why the group is refused (its items are dropped)."""
        entry = self.entries.setdefault(rec.lease_id, Entry(rec))
        ids = msg.completion_ids.to_numpy()
        start = 0
        for s in msg.samples:
            own = ids[start:start + s.num_tokens]
            start += s.num_tokens
            item = entry.items.get(s.sample_index)
            if item is None:
                entry.items[s.sample_index] = self._new_item(rec.lease_id, s.sample_index, own)
            elif not np.array_equal(self.items[item].completion_ids, own):
                self._drop(rec.lease_id)
                return (f"lease {rec.lease_id}: sample {s.sample_index}'s completion differs "
                        "from the one streamed for scoring")
        self.counts["early"] += sum(self.items[i].state is ItemState.HELD
                                    for i in entry.items.values())
        entry.waiting = Waiting(msg, rec, group, self.now())
        self.arrived += 1
        self._finish_if_scored(entry)
        return ""

    def _new_item(self, lease_id: int, sample_index: int, completion_ids: np.ndarray) -> int:
        item = self.next_item
        self.next_item += 1
        self.items[item] = Item(lease_id, sample_index, completion_ids, self.now())
        self.queue.append(item)
        self.counts["samples"] += 1
        return item

    def take_finished(self) -> list[Waiting]:
        out, self.finished = self.finished, []
        return out

    def __len__(self) -> int:
        """Groups being scored (they hold buffer room: the server reads no more than it has)."""
        return self.arrived

    def records(self) -> list[LeaseRecord]:
        """The leases of the groups being scored (a checkpoint keeps them outstanding: a resumed
        run, to which no actor claims them, grants their prompts again)."""
        return [e.rec for e in self.entries.values() if e.waiting is not None]

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
            if self._live(item):
                self._score(item, got[item], failed=False)
            else:
                self.counts["late"] += 1  # failed at its deadline, or its lease dropped, meanwhile
        return ""

    # ------------------------------------------------------------ every tick
    def tick(self) -> None:
        """Give back the batches of dead or slow scorers, fail items past their deadline, drop
        the streamed samples of leases that ended without their group, send batches to free
        scorers."""
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
        for lease_id, entry in list(self.entries.items()):
            if entry.waiting is None:
                if not self.outstanding(lease_id):
                    self._drop(lease_id)
            elif now - entry.waiting.arrived > self.cfg.deadline_s:
                for item in list(entry.items.values()):
                    if self._live(item):
                        self._score(item, {}, failed=True)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        c = self.cfg
        while True:
            while self.queue and not self._queued(self.queue[0]):
                self.queue.popleft()  # failed or dropped while queued
            if not self.queue:
                return
            if (len(self.queue) < c.batch_size
                    and now - self.items[self.queue[0]].queued_at < c.max_wait_s):
                return
            free = [(len(link.batches), sid) for sid, link in self.scorers.items()
                    if len(link.batches) < c.in_flight]
            if not free:
                return
            sid = min(free)[1]
            take = []
            while self.queue and len(take) < c.batch_size:
                item = self.queue.popleft()
                if self._queued(item):
                    take.append(item)
            self._send_batch(sid, take, now)

    def _send_batch(self, sid: str, take: list[int], now: float) -> None:
        bid = self.next_batch
        self.next_batch += 1
        link = self.scorers[sid]
        items = []
        for item_id in take:
            item = self.items[item_id]
            item.state = ItemState.SENT
            prompt = self.entries[item.lease_id].rec.prompt
            items.append(m.ScoreItem(item_id=item_id, prompt_ids=m.Array.from_numpy(prompt.token_ids),
                                     completion_ids=m.Array.from_numpy(item.completion_ids),
                                     meta=prompt.meta))
        self.batches[bid] = Batch(sid, take, now)
        link.batches.add(bid)
        self.counts["batches"] += 1
        self.send(link.identity, m.ScoreBatch(batch_id=bid, items=items))

    # ------------------------------------------------------------ internals
    def _queued(self, item_id: int) -> bool:
        item = self.items.get(item_id)
        return item is not None and item.state is ItemState.QUEUED

    def _live(self, item_id: int) -> bool:
        item = self.items.get(item_id)
        return item is not None and item.state is not ItemState.HELD

    def _close_batch(self, bid: int) -> Batch:
        batch = self.batches.pop(bid)
        link = self.scorers.get(batch.scorer_id)
        if link is not None:
            link.batches.discard(bid)
        return batch

    def _requeue(self, bid: int) -> None:
        """Put a batch's live items back at the front of the queue (they keep their age)."""
        batch = self._close_batch(bid)
        live = [i for i in batch.items if self._live(i)]
        for i in live:
            self.items[i].state = ItemState.QUEUED
        self.queue.extendleft(reversed(live))
        self.counts["reassigned"] += len(live)

    def _requeue_scorer(self, sid: str, why: str) -> None:
        bids = sorted(self.scorers[sid].batches)
        for bid in bids:
            self._requeue(bid)
        if bids:
            log.warning("scorer %s %s: its %d batch(es) go to other scorers", sid, why, len(bids))

    def _score(self, item_id: int, scores: dict[str, float], failed: bool) -> None:
        """Keep one sample's model scores (all 0 and the flag when `failed`)."""
        item = self.items[item_id]
        item.state, item.scores, item.failed = ItemState.HELD, scores, failed
        self.counts["failed" if failed else "scored"] += 1
        self._finish_if_scored(self.entries[item.lease_id])

    def _finish_if_scored(self, entry: Entry) -> None:
        """Once the group has arrived and every sample is scored: apply the scores to its
        samples (weighted into the reward) and hand the group on."""
        w = entry.waiting
        if w is None or any(self.items[i].state is not ItemState.HELD
                            for i in entry.items.values()):
            return
        for s in w.msg.samples:
            item = self.items.pop(entry.items[s.sample_index])
            named = dict(s.scores)
            extra = 0.0
            for name, weight in self.weights.items():
                v = 0.0 if item.failed else item.scores[name]
                if math.isnan(v):
                    named[f"{name}_unparsed"] = 1.0
                    v = 0.0
                named[name] = v
                extra += weight * v
            named["reward_failed"] = float(item.failed)
            s.reward, s.scores = s.reward + extra, named
        self.counts["delivered"] += len(w.msg.samples)
        del self.entries[w.rec.lease_id]
        self.arrived -= 1
        by_index = sorted(w.msg.samples, key=lambda x: x.sample_index)
        w.group.rewards = np.array([x.reward for x in by_index], dtype=np.float32)
        self.finished.append(w)

    def _drop(self, lease_id: int) -> None:
        """Forget a lease's items: its group will never be trained on."""
        entry = self.entries.pop(lease_id)
        if entry.waiting is not None:
            self.arrived -= 1
        for item_id in entry.items.values():
            item = self.items.pop(item_id)
            self.counts["wasted" if item.state is ItemState.HELD else "discarded"] += 1

    def snapshot(self) -> dict:
        states = Counter(item.state for item in self.items.values())
        return {**{k: self.counts.get(k, 0) for k in
                   ("samples", "streamed", "stream_late", "early", "scored", "failed", "delivered",
                    "discarded", "wasted", "reassigned", "late", "batches")},
                "live": states[ItemState.QUEUED] + states[ItemState.SENT],
                "held": states[ItemState.HELD], "groups": self.arrived,
                "streaming": len(self.entries) - self.arrived,
                "scorers_connected": len(self.scorers)}


def balanced(snap: dict) -> bool:
    """The desk's counters obey its two identities (module docstring)."""
    return (snap["samples"] == snap["scored"] + snap["failed"] + snap["live"] + snap["discarded"]
            and snap["scored"] + snap["failed"] == snap["delivered"] + snap["held"] + snap["wasted"])


def _bad_results(got: dict[int, dict[str, float]], items: list[int], names: set[str]) -> str:
    if set(got) != set(items):
        return f"results for items {sorted(got)[:8]}, the batch has {sorted(items)[:8]}"
    for item, scores in got.items():
        if set(scores) != names:
            return f"item {item} has scores {sorted(scores)}, expected {sorted(names)}"
        if any(math.isinf(v) for v in scores.values()):
            return f"item {item} has an infinite score"
    return ""
