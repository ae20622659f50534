"""Every learner rank serves its own buckets of each version: no rank holds a whole one.

With several learner ranks (FSDP2, Megatron) and whole versions over ZeroMQ (the weight
source's `rank_shards`, transport/weightsrc/registry.py), each bucket of a version belongs to
one rank (transport/weights.py `Layout`: the rank with the fewest bytes so far, from the
tensors' sizes alone, so every rank agrees). Each rank fills and hashes only its own buckets;
rank 0 still answers every peer.

    every rank's packer thread                  rank 0
      pack(keep=own buckets)                      packer thread: Collector.complete(v) waits
      rank r: RankServer.deliver ──ShardReady──▶    for each rank's ShardReady(v), merges the
        (keeps its buckets)        (digests)        digests into one manifest (other ranks'
                                                    buckets: ShardRef) ─▶ announce
      rank r: RankServer thread                   I/O thread (transport/weightsrc/service.py):
        ROUTER ◀────BucketRequest─────────────────  peers ask for a ShardRef bucket: one fetch
               ─────WeightBucket + bytes─────────▶  per bucket, its frame sent to every peer
               ◀────ShardDrop(keys)───────────────  waiting for it; the store drops a key
               ◀────ShardStop─────────────────────  the run is over (learner/server.py)

Peers see one learner: the manifests, digests and bucket bytes are those of one rank packing
everything, and nothing on the wire to actors or relays changes. Rank 0 holds its share of each
version plus the other ranks' buckets in transit (at most one copy of each, however many peers
ask). Ranks 1..N-1 keep serving after training until ShardStop (rank 0 evaluates the last
version on the actors after the process group is gone) or until rank 0's connection drops.

Endpoints (`link`, a collective at start-up): ipc:// sockets in a private (0700) temporary
directory when every rank is on one node; otherwise tcp on this node's address towards
MASTER_ADDR (the network torch.distributed uses), with CURVE when the learner has keys
(transport.curve_server_secret): the ranks admit only the learner's own key.

Blocking: `Collector.complete` blocks rank 0's packer thread until every rank's ShardReady(v)
is in, logging every 30 s and failing the run after learner.collective_timeout_s. A RankServer
thread blocks only in its poll. The Client never blocks (requests are small and unbounded in
number only by the peers' windows: one per bucket a peer waits for).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from configs.schema import TransportConfig
from transport import messages as m
from transport.sockets import configure
from transport.weights import PackedWeights
from transport.weightsrc.store import Published, ShardRef

log = logging.getLogger(__name__)

WAIT_LOG_S = 30.0


@dataclass
class Link:
    """This rank's end of the ranks' channel, made by `link`."""

    rank: int
    world: int
    ctx: zmq.Context
    t: TransportConfig
    own: zmq.Socket
    """Rank 0: a PULL for ShardReady; rank r: a ROUTER for rank 0's requests (the Client's
    DEALERs connect to it)."""
    endpoints: list[str]
    """Every rank's `own` endpoint, in rank order."""
    curve: bool = False
    """tcp with the learner's CURVE keys (`client` makes the connecting end)."""

    def client(self, kind: int) -> zmq.Socket:
        """A socket of `kind` that connects to another rank's `own`."""
        sock = configure(self.ctx.socket(kind), self.t, limit_size=False)
        if self.curve:
            public, secret = zmq.auth.load_certificate(self.t.curve_server_secret)
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.curve_serverkey = public
        return sock


class _LearnerKeyOnly:
    """ZAP credentials: admit only the learner's own public key (both Z85-encoded)."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def link(rank: int, world: int, t: TransportConfig, all_gather) -> Link:
    """Collective: bind this rank's socket and learn every rank's endpoint. `all_gather(s)`:
    the strings of every rank, in rank order (learner/distributed.py, over the process group)."""
    ctx = zmq.Context()
    own = configure(ctx.socket(zmq.PULL if rank == 0 else zmq.ROUTER), t, limit_size=True)
    curve = False
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:
        d = tempfile.mkdtemp(prefix="tether-ranks-")
        atexit.register(shutil.rmtree, d, True)
        endpoint = f"ipc://{d}/r{rank}"
        own.bind(endpoint)
    else:
        curve = bool(t.curve_server_secret)
        if curve:
            public, secret = zmq.auth.load_certificate(t.curve_server_secret)
            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve_callback("*", _LearnerKeyOnly(public))
            own.curve_publickey, own.curve_secretkey, own.curve_server = public, secret, True
        host = _towards(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")))
        endpoint = f"tcp://{host}:{own.bind_to_random_port(f'tcp://{host}')}"
    return Link(rank, world, ctx, t, own, all_gather(endpoint), curve)


def _towards(address: str, port: int) -> str:
    """This node's IP address on the route to `address` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, port))
        return s.getsockname()[0]


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
        start = time.monotonic()
        deadline, next_log = start + self.timeout_s, start + WAIT_LOG_S
        while len([k for k in self.early if k[0] == v]) < self.link.world - 1:
            now = time.monotonic()
            late = sorted(set(range(1, self.link.world)) - {r for ver, r in self.early
                                                              if ver == v})
            if now >= deadline:
                raise RuntimeError(f"v{v}: learner ranks {late} did not pack their buckets "
                                   f"within {self.timeout_s:g} s")
            if now >= next_log:
                log.warning("v%d: waiting %.0f s for learner ranks %s to pack their buckets",
                            v, now - start, late)
                next_log = now + WAIT_LOG_S
            if self.link.own.poll(int(1000 * max(0.0, min(deadline, next_log) - now)) + 1):
                r = self.dec.decode(self.link.own.recv())
                self.early[(r.version, r.rank)] = r
        readies = [self.early.pop((v, r)) for r in range(1, self.link.world)]
        return merge(own, readies)


class RankServer:
    """Rank r (> 0): keeps its buckets of each version until rank 0 drops their key, serves
    them to rank 0 (a thread of its own), and tells rank 0 when a version's part is ready."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.push = link.client(zmq.PUSH)  # the packer thread's
        self.push.connect(link.endpoints[0])
        self.held: dict[str, PackedWeights] = {}
        self.done = threading.Event()
        """Set once rank 0 says the run is over (ShardStop) or its connection drops: nobody
        asks for buckets any more."""
        self._monitor = link.own.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
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
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        connected = 0
        while True:
            events = dict(poller.poll())
            if self._monitor in events:
                event = recv_monitor_message(self._monitor)["event"]
                connected += 1 if event == zmq.EVENT_ACCEPTED else -1
                if connected == 0:
                    log.info("rank %d: rank 0 disconnected: no more bucket requests",
                             self.link.rank)
                    break
            if sock not in events:
                continue
            frames = sock.recv_multipart()
            try:
                msg = dec.decode(frames[-1]) if len(frames) == 2 else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                msg = None
            match msg:
                case None:
                    log.warning("rank %d: a malformed request on the ranks' channel (%d frames)",
                                self.link.rank, len(frames))
                case m.ShardStop():
                    break
                case m.ShardDrop(keys=keys):
                    with self._lock:
                        for k in keys:
                            self.held.pop(k, None)
                case m.BucketRequest() as req:
                    self._answer(frames[0], req)
        self.done.set()

    def _answer(self, identity: bytes, req: m.BucketRequest) -> None:
        with self._lock:
            packed = self.held.get(req.key)
        data = (packed.buckets[req.index] if packed is not None
                and 0 <= req.index < len(packed.buckets) else None)
        head = m.WeightBucket(version=-1 if packed is None else packed.manifest.version,
                              index=req.index, nbytes=0 if data is None else len(data),
                              key=req.key, found=data is not None)
        self.link.own.send_multipart([identity, self._enc.encode(head)]
                                     + ([] if data is None else [data]), copy=False)


@dataclass
class _Fetch:
    peers: list[tuple[bytes, int]] = field(default_factory=list)
    """(identity, request id) of each peer waiting for the bucket."""
    asked: float = 0.0


class Client:
    """Rank 0's I/O thread: fetches ShardRef buckets from their ranks for the peers that asked,
    one fetch per bucket however many peers wait for it. Never blocks."""

    def __init__(self, link: Link, hold_s: float) -> None:
        """`hold_s`: a fetch unanswered this long is asked again (transport.peer_timeout_s)."""
        self.hold_s = hold_s
        self.socks: dict[int, zmq.Socket] = {}
        for r in range(1, link.world):
            s = link.client(zmq.DEALER)
            s.setsockopt(zmq.SNDHWM, 0)  # requests are small; a rank answers each one
            s.connect(link.endpoints[r])
            self.socks[r] = s
        self.waiting: OrderedDict[tuple[str, int], _Fetch] = OrderedDict()
        """(key, index) -> the fetch of that bucket and its peers, oldest first."""
        self._enc = m.encoder()
        self._dec = msgspec.msgpack.Decoder(m.WeightBucket)

    def sockets(self) -> list[zmq.Socket]:
        return list(self.socks.values())

    def fetch(self, ref: ShardRef, identity: bytes, req: m.BucketRequest, now: float) -> None:
        while self.waiting and now - next(iter(self.waiting.values())).asked > self.hold_s:
            self.waiting.popitem(last=False)  # unanswered: its peers have asked again
        f = self.waiting.get((req.key, req.index))
        f = f or self.waiting.setdefault((req.key, req.index), _Fetch(asked=now))
        f.peers.append((identity, req.request_id))
        if len(f.peers) == 1:
            self.socks[ref.rank].send(self._enc.encode(req), zmq.NOBLOCK)

    def reply(self, frames: list) -> list[tuple[bytes, m.WeightBucket, zmq.Frame | None]]:
        """A rank's answer (frames received with copy=False) -> for every peer waiting for it:
        its identity, the header with its request id, and the bytes (one frame for all; None:
        the rank does not hold the bucket)."""
        head = self._dec.decode(frames[0].bytes)
        f = self.waiting.pop((head.key, head.index), None)
        if f is None:
            return []
        data = frames[1] if head.found else None
        return [(identity, msgspec.structs.replace(head, request_id=rid), data)
                for identity, rid in f.peers]

    def drop(self, keys: list[str]) -> None:
        msg = self._enc.encode(m.ShardDrop(keys=keys))
        for s in self.socks.values():
            s.send(msg, zmq.NOBLOCK)

    def stop(self) -> None:
        """The run is over: the ranks stop serving (learner/server.py, at shutdown)."""
        msg = self._enc.encode(m.ShardStop())
        for s in self.socks.values():
            s.send(msg, zmq.NOBLOCK)
