"""What the learner serves on its weights socket: the versions it published (full buckets,
deltas, a LoRA run's base) and the relay tree. Used by the learner's I/O thread only (no locks).

    WeightRequest(have, held)   -> offer(): the manifests to fetch, from the learner's digests
    BucketRequest(key, index)   -> bucket(): zero-copy bytes, or None (not held any more)
    RelayHello                  -> RelayTree.hello(): the relay's upstream in the tree

Offers (`transport.weight_full_every` = K): version v is sent in full when K = 0, when v is a
multiple of K (every peer resynchronises there, through the relays' caches), or when the peer
holds no version since the last such full point; otherwise as the chain of deltas from the
peer's version to v, if those are smaller than the full version. Kept: the full buckets of the
newest `FULLS_KEPT` versions (a peer still fetching the previous one can finish) and the deltas
since the last full point.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from transport import messages as m
from transport.weights import PackedWeights


@dataclass(frozen=True)
class Published:
    """One version as the learner's packer made it: the full buckets, and the delta against the
    previous version when deltas are on (None: off, the first version, or a new layout)."""

    full: PackedWeights
    delta: PackedWeights | None = None


@dataclass(frozen=True)
class ShardRef:
    """A bucket another learner rank holds and serves (transport/weightsrc/shards.py): it
    stands in rank 0's PackedWeights where that rank's bytes would be."""

    rank: int
    nbytes: int


def _is_full(key: str) -> bool:
    """A full version's buckets (f12) or an adapter's (a12): what a peer loads whole."""
    return key[:1] in ("f", "a", "")


@dataclass
class _Fetch:
    """One peer's fetch of one full version: the bucket indices it asked for, and when last."""

    asked: set[int] = field(default_factory=set)
    last: float = field(default_factory=time.monotonic)


class VersionStore:
    def __init__(self, full_every: int, base: PackedWeights | None = None,
                 hold_s: float = 60.0, on_drop: Callable[[list[str]], None] | None = None
                 ) -> None:
        """`hold_s`: how long an older version stays for a peer that stopped asking for its
        buckets (transport.peer_timeout_s). `on_drop(keys)`: told the keys it no longer holds
        (the other learner ranks then free their buckets of them)."""
        self.full_every = full_every
        self.on_drop = on_drop
        self.base = base
        self.hold_s = hold_s
        self.fetches: dict[tuple[str, str], _Fetch] = {}
        """(peer, full key) -> the peer's fetch in progress."""
        self.latest: PackedWeights | None = None
        self.blobs: dict[str, PackedWeights] = {} if base is None else {base.manifest.key: base}
        """Buckets by manifest key (f12, d12, a12, b)."""
        self.sent_bytes: Counter[str] = Counter()
        """Bucket bytes sent, by requester kind ("actor", "relay")."""
        self.missing = 0
        """BucketRequests for a key or index not held (evicted, or never published)."""

    def add(self, pub: Published) -> None:
        """Make `pub` the newest version; evict what no offer names any more."""
        v = pub.full.manifest.version
        self.latest = pub.full
        self.blobs[pub.full.manifest.key] = pub.full
        if pub.delta is not None:
            self.blobs[pub.delta.manifest.key] = pub.delta
        point = self._full_point(v)
        self._drop([k for k, p in self.blobs.items()
                    if k[:1] == "d" and p.manifest.version <= point])
        self._evict()

    def _drop(self, keys: list[str]) -> None:
        for k in keys:
            del self.blobs[k]
        if keys and self.on_drop is not None:
            self.on_drop(keys)

    def _evict(self) -> None:
        """Drop every full version but the newest that no peer is fetching."""
        now = time.monotonic()
        for key in [key for key, f in self.fetches.items() if now - f.last > self.hold_s]:
            del self.fetches[key]
        fetched = {k for _, k in self.fetches}
        self._drop([k for k, p in self.blobs.items()
                    if _is_full(k) and p is not self.latest and k not in fetched])

    def _fetching(self, peer: str, key: str, index: int | None = None) -> None:
        """Note `peer`'s interest in the full version `key` (an offer: index None; a bucket
        request: its index); a fetch that asked for every bucket is over."""
        packed = self.blobs.get(key)
        if packed is None or not _is_full(key):
            return
        f = self.fetches.setdefault((peer, key), _Fetch())
        f.last = time.monotonic()
        if index is not None:
            f.asked.add(index)
        if len(f.asked) == len(packed.buckets):
            del self.fetches[(peer, key)]
            self._evict()

    def _full_point(self, v: int) -> int:
        return v - v % self.full_every if self.full_every else v

    def offer(self, have: int, held: int, need_base: bool,
              peer: str = "") -> list[m.WeightManifest]:
        """The manifests a peer whose engine has version `have`, and which keeps the decoded
        buckets of version `held` (-1: none), fetches to reach the newest version (empty: it
        has it, or nothing is published yet). A new request ends the peer's earlier fetches."""
        for key in [key for key in self.fetches if key[0] == peer]:
            del self.fetches[key]
        self._evict()
        latest = self.latest
        if latest is None or have >= latest.manifest.version:
            return []
        out = [self.base.manifest] if need_base and self.base is not None else []
        v = latest.manifest.version
        chain = [self.blobs.get(f"d{u}") for u in range(held + 1, v + 1)]
        if (held >= 0 and held >= self._full_point(v) and chain and None not in chain
                and sum(p.manifest.total_bytes for p in chain) < latest.manifest.total_bytes):
            return out + [p.manifest for p in chain]
        self._fetching(peer, latest.manifest.key)
        return out + [latest.manifest]

    def bucket(self, key: str, index: int, requester: str, peer: str = ""):
        """Bucket `index` of `key` (zero-copy; a ShardRef: another rank's), or None if not
        held. `requester`: the peer's kind, for the byte counts."""
        packed = self.blobs.get(key)
        if packed is None or not 0 <= index < len(packed.buckets):
            self.missing += 1
            return None
        data = packed.buckets[index]
        self.sent_bytes[requester] += data.nbytes if isinstance(data, ShardRef) else len(data)
        self._fetching(peer, key, index)
        return data


@dataclass
class _Relay:
    info: m.RelayInfo
    last_seen: float
    order: int


@dataclass
class RelayTree:
    """Relays in a tree of fan-out `fanout` (1: a chain) in the order they joined: relay 0
    fetches from the learner, relay i from relay (i - 1) // fanout. The learner thus
    sends each bucket once (plus the fall-backs of peers whose relay failed), whatever the
    number of actors. A relay silent for `timeout_s` leaves; the tree is recomputed."""

    fanout: int
    timeout_s: float
    relays: dict[str, _Relay] = field(default_factory=dict)
    joined: int = 0

    def hello(self, msg: m.RelayHello) -> tuple[str, str]:
        """Register or refresh a relay; returns the endpoints of its upstream and of the
        upstream's upstream ("" = the learner)."""
        r = self.relays.get(msg.relay_id)
        info = m.RelayInfo(relay_id=msg.relay_id, endpoint=msg.endpoint, host=msg.host)
        if r is None or r.info != info:
            self.joined += 1
            self.relays[msg.relay_id] = r = _Relay(info, time.monotonic(), self.joined)
        r.last_seen = time.monotonic()
        order = self.ordered()
        up = self._parent(order.index(info))
        return ("" if up < 0 else order[up].endpoint,
                "" if up < 0 or self._parent(up) < 0 else order[self._parent(up)].endpoint)

    def _parent(self, i: int) -> int:
        return -1 if i == 0 else (i - 1) // self.fanout

    def ordered(self) -> list[m.RelayInfo]:
        """Live relays, root first (the order WeightOffer lists them in)."""
        now = time.monotonic()
        for rid in [rid for rid, r in self.relays.items() if now - r.last_seen > self.timeout_s]:
            del self.relays[rid]
        return [r.info for r in sorted(self.relays.values(), key=lambda r: r.order)]

    def is_relay(self, relay_id: str) -> bool:
        return relay_id in self.relays
