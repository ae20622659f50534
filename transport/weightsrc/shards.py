"""Every learner rank serves its own buckets of each version: no rank holds a whole one.

With several learner ranks (FSDP2) and weights over ZeroMQ (`transport.weights_via` zmq or
relay, full weights), bucket i of a version belongs to one rank (transport/weights.py `Layout`:
the rank with the fewest bytes so far, from the tensors' sizes alone, so every rank agrees).
Each rank fills and hashes only its own buckets; rank 0 still answers every peer.

    every rank's packer thread                  rank 0
      pack(keep=own buckets)                      packer thread: Collector.complete(v) waits
      rank r: RankServer.deliver ──ShardReady──▶    for each rank's ShardReady(v), merges the
        (keeps its buckets)        (digests)        digests into one manifest (other ranks'
                                                    buckets: ShardRef) ─▶ announce
      rank r: RankServer thread                   I/O thread (transport/weightsrc/service.py):
        ROUTER ◀────BucketRequest─────────────────  a peer asks for a ShardRef bucket:
               ─────WeightBucket + bytes─────────▶  Client.fetch, reply forwarded, zero-copy
               ◀────ShardDrop(keys)───────────────  the store offers a key no more

Peers see one learner: the manifests, digests and bucket bytes are those of one rank packing
everything, and nothing on the wire to actors or relays changes. Rank 0 holds its share of each
version plus the buckets in transit.

Endpoints (`link`, a collective at start-up): ipc:// sockets in a private temporary directory
when every rank is on one node; otherwise tcp on each node's host name, trusted like
torch.distributed's own traffic (no CURVE).

Blocking: `Collector.complete` blocks rank 0's packer thread until every rank's ShardReady(v)
is in, logging every 30 s while it waits and failing the run after learner.collective_timeout_s
(a rank whose packer failed also raises in its own trainer thread at its next publish). A RankServer thread blocks only in its poll; the Client
never blocks (sends to a rank that is gone are dropped at the high-water mark; the peer asks
again after its time-out).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import zmq

from transport import messages as m
from transport.weights import PackedWeights
from transport.weightsrc.store import Published, ShardRef

log = logging.getLogger(__name__)

WAIT_LOG_S = 30.0


def applies(weights_via: str, lora: bool, world: int) -> bool:
    """Do the learner's ranks serve their own buckets? Several ranks, full weights, over
    ZeroMQ (filesystem and NCCL read whole versions on rank 0; LoRA adapters are small)."""
    return world > 1 and weights_via in ("zmq", "relay") and not lora


@dataclass
class Link:
    """This rank's end of the ranks' channel, made by `link`."""

    rank: int
    world: int
    ctx: zmq.Context
    own: zmq.Socket
    """Rank 0: a PULL for ShardReady; rank r: a ROUTER for rank 0's requests (the Client's
    DEALERs connect to it)."""
    endpoints: list[str]
    """Every rank's `own` endpoint, in rank order."""


def link(rank: int, world: int, all_gather) -> Link:
    """Collective: bind this rank's socket and learn every rank's endpoint. `all_gather(s)`:
    the strings of every rank, in rank order (learner/distributed.py, over the process group)."""
    ctx = zmq.Context()
    own = ctx.socket(zmq.PULL if rank == 0 else zmq.ROUTER)
    own.setsockopt(zmq.LINGER, 0)
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:
        d = tempfile.mkdtemp(prefix="tether-ranks-")
        atexit.register(shutil.rmtree, d, True)
        endpoint = f"ipc://{d}/r{rank}"
        own.bind(endpoint)
    else:
        port = own.bind_to_random_port("tcp://*")
        endpoint = f"tcp://{socket.gethostname()}:{port}"
    return Link(rank, world, ctx, own, all_gather(endpoint))


def merge(own: Published, readies: list[m.ShardReady]) -> Published:
    """Rank 0's part of a version and the other ranks' ShardReady: the whole version, the
    other ranks' buckets as ShardRefs. Every bucket must have exactly one owner."""
    full, man = own.full, own.full.manifest
    buckets, digests = list(full.buckets), list(man.digests)
    dbuckets = list(own.delta.buckets) if own.delta is not None else None
    ddigests = list(own.delta.manifest.digests) if own.delta is not None else None
    delta_total = own.delta.manifest.total_bytes if own.delta is not None else 0
    for r in readies:
        if len(r.digests) != man.num_buckets or (r.delta_digests is None) != (dbuckets is None):
            raise RuntimeError(f"rank {r.rank}'s part of v{man.version} does not match rank 0's "
                               f"({len(r.digests)} buckets, delta {r.delta_digests is not None})")
        for i, d in enumerate(r.digests):
            if not d:
                continue
            if buckets[i] is not None:
                raise RuntimeError(f"v{man.version} bucket {i}: claimed by two ranks")
            buckets[i], digests[i] = ShardRef(r.rank, man.raw_sizes[i]), d
            if dbuckets is not None:
                dbuckets[i] = ShardRef(r.rank, r.delta_sizes[i])
                ddigests[i] = r.delta_digests[i]
                delta_total += r.delta_sizes[i]
    missing = [i for i, b in enumerate(buckets) if b is None]
    if missing:
        raise RuntimeError(f"v{man.version}: no rank packed buckets {missing}")
    whole = PackedWeights(msgspec.structs.replace(man, digests=digests, raw_digests=digests),
                          tuple(buckets))
    delta = None
    if dbuckets is not None:
        delta = PackedWeights(msgspec.structs.replace(
            own.delta.manifest, digests=ddigests, raw_digests=digests, total_bytes=delta_total),
            tuple(dbuckets))
    return Published(full=whole, delta=delta)


class Collector:
    """Rank 0, in its packer thread: completes each version with the other ranks' parts."""

    def __init__(self, link: Link, timeout_s: float) -> None:
        """`timeout_s`: how long a version may wait for a rank's part before the run fails
        (learner.collective_timeout_s, the bound on every collective)."""
        self.link = link
        self.timeout_s = timeout_s
        self.dec = msgspec.msgpack.Decoder(m.ShardReady)
        self.early: dict[tuple[int, int], m.ShardReady] = {}
        """(version, rank) -> a ShardReady that came before rank 0 finished that version."""

    def complete(self, own: Published) -> Published:
        v = own.full.manifest.version
        for key in [k for k in self.early if k[0] < v]:  # versions rank 0 did not publish
            del self.early[key]
        waited = 0.0
        while len([k for k in self.early if k[0] == v]) < self.link.world - 1:
            if not self.link.own.poll(int(WAIT_LOG_S * 1000)):
                waited += WAIT_LOG_S
                late = sorted(set(range(1, self.link.world)) - {r for ver, r in self.early
                                                                  if ver == v})
                if waited >= self.timeout_s:
                    raise RuntimeError(f"v{v}: learner ranks {late} did not pack their buckets "
                                       f"within {self.timeout_s:g} s")
                log.warning("v%d: waiting %.0f s for learner ranks %s to pack their buckets",
                            v, waited, late)
                continue
            r = self.dec.decode(self.link.own.recv())
            self.early[(r.version, r.rank)] = r
        readies = [self.early.pop((v, r)) for r in range(1, self.link.world)]
        return merge(own, readies)


class RankServer:
    """Rank r (> 0): keeps its buckets of each version until rank 0 drops their key, serves
    them to rank 0 (a thread of its own), and tells rank 0 when a version's part is ready."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.push = link.ctx.socket(zmq.PUSH)  # the packer thread's
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(link.endpoints[0])
        self.held: dict[str, PackedWeights] = {}
        self._lock = threading.Lock()
        self._enc = m.encoder()
        self._thread = threading.Thread(target=self._serve, name="rank-buckets", daemon=True)
        self._thread.start()

    def deliver(self, pub: Published) -> None:
        """The packer thread's hand-off of this rank's part of a version."""
        full = pub.full
        with self._lock:
            self.held[full.manifest.key] = full
            if pub.delta is not None:
                self.held[pub.delta.manifest.key] = pub.delta
        d = pub.delta
        self.push.send(self._enc.encode(m.ShardReady(
            rank=self.link.rank, version=full.manifest.version, digests=full.manifest.digests,
            delta_digests=None if d is None else d.manifest.digests,
            delta_sizes=None if d is None else [0 if b is None else len(b) for b in d.buckets])))

    def _serve(self) -> None:
        sock, dec = self.link.own, msgspec.msgpack.Decoder(m.ToRank)
        while True:
            identity, payload = sock.recv_multipart()
            match dec.decode(payload):
                case m.ShardDrop(keys=keys):
                    with self._lock:
                        for k in keys:
                            self.held.pop(k, None)
                case m.BucketRequest() as req:
                    with self._lock:
                        packed = self.held.get(req.key)
                    data = (packed.buckets[req.index] if packed is not None
                            and 0 <= req.index < len(packed.buckets) else None)
                    head = m.WeightBucket(version=-1 if packed is None else packed.manifest.version,
                                          index=req.index, nbytes=0 if data is None else len(data),
                                          key=req.key, request_id=req.request_id,
                                          found=data is not None)
                    frames = [identity, self._enc.encode(head)] + ([] if data is None else [data])
                    sock.send_multipart(frames, copy=False)


class Client:
    """Rank 0's I/O thread: fetches ShardRef buckets from their ranks for the peers that asked.
    Never blocks."""

    def __init__(self, link: Link, hold_s: float) -> None:
        self.hold_s = hold_s
        self.socks: dict[int, zmq.Socket] = {}
        for r in range(1, link.world):
            s = link.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)  # requests are small; a rank answers each one
            s.connect(link.endpoints[r])
            self.socks[r] = s
        self.waiting: OrderedDict[int, tuple[bytes, int, float]] = OrderedDict()
        """Forwarding tag -> (the peer's identity, its request id, when it asked)."""
        self._tag = 0
        self._enc = m.encoder()
        self._dec = msgspec.msgpack.Decoder(m.WeightBucket)

    def sockets(self) -> list[zmq.Socket]:
        return list(self.socks.values())

    def fetch(self, ref: ShardRef, identity: bytes, req: m.BucketRequest, now: float) -> None:
        while self.waiting and now - next(iter(self.waiting.values()))[2] > self.hold_s:
            self.waiting.popitem(last=False)  # a peer that asked long ago has asked again
        self._tag += 1
        self.waiting[self._tag] = (identity, req.request_id, now)
        fwd = msgspec.structs.replace(req, request_id=self._tag)
        self.socks[ref.rank].send(self._enc.encode(fwd), zmq.NOBLOCK)

    def reply(self, frames: list) -> tuple[bytes, m.WeightBucket, zmq.Frame | None] | None:
        """A rank's answer (frames received with copy=False) -> the peer's identity, the
        header as the peer's request id names it, and the bytes (None: the rank does not hold
        the bucket); None if nobody waits for it any more."""
        head = self._dec.decode(frames[0].bytes)
        peer = self.waiting.pop(head.request_id, None)
        if peer is None:
            return None
        head = msgspec.structs.replace(head, request_id=peer[1])
        return peer[0], head, frames[1] if head.found else None

    def drop(self, keys: list[str]) -> None:
        msg = self._enc.encode(m.ShardDrop(keys=keys))
        for s in self.socks.values():
            s.send(msg, zmq.NOBLOCK)
