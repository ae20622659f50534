"""The learner's side of the weights channel: answers offers, buckets and relay hellos.

Runs in the learner's I/O thread (learner/server.py hands it every frame of the weights
ROUTER, and of the sockets to the other learner ranks); non-blocking. Owns the VersionStore and
the RelayTree. A bucket another rank holds (a ShardRef) is fetched from it and forwarded
(transport/weightsrc/shards.py).
"""

from __future__ import annotations

import time
from typing import Callable

import msgspec
import zmq

from configs.schema import TransportConfig
from transport import messages as m
from transport.weights import PackedWeights
from transport.weightsrc.shards import Client
from transport.weightsrc.store import Published, RelayTree, ShardRef, VersionStore


class WeightsService:
    def __init__(self, sock: zmq.Socket, t: TransportConfig, is_actor: Callable[[str], bool],
                 reject: Callable[[str, str], None], base: PackedWeights | None = None,
                 nccl=None, shards: Client | None = None) -> None:
        """`sock`: the weights ROUTER (SNDHWM 0). `is_actor`: has this actor joined?
        `reject(reason, detail)`: count and log a refused message. `nccl`: the learner's
        transport/weightsrc/nccl.py NcclBroadcaster (weights_via=nccl), else None. `shards`:
        the other learner ranks' buckets (several ranks serving their own), else None."""
        self.sock = sock
        self.t = t
        self.is_actor = is_actor
        self.reject = reject
        self.shards = shards
        self.store = VersionStore(t.weight_full_every, base, hold_s=t.peer_timeout_s,
                                  on_drop=None if shards is None else shards.drop)
        self.relays = RelayTree(t.relay_fanout, t.peer_timeout_s)
        self.version = -1
        self.enc = m.encoder()
        self.dec = msgspec.msgpack.Decoder(m.WeightsFromPeer)
        self.nccl = nccl
        self.ranks: dict[str, int] = {}
        """weights_via=nccl: actor -> its engine's number in the broadcast group (1, 2, ...)."""
        self.parked: dict[str, tuple[bytes, int]] = {}
        """weights_via=nccl: actor -> (identity, request id) of its request for a newer version,
        answered when every engine of the group asked (a broadcast needs them all)."""

    def add(self, version: int, pub: Published) -> None:
        self.version = version
        self.store.add(pub)

    def handle(self, frames: list) -> None:
        if len(frames) != 2:
            self.reject("malformed", f"weight request with {len(frames)} frames")
            return
        identity, payload = frames
        try:
            req = self.dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.reject("malformed", f"weights: {e}")
            return
        match req:
            case m.RelayHello() if req.protocol_version != m.PROTOCOL_VERSION:
                self.reject("protocol_version", f"relay {req.relay_id!r} speaks "
                            f"v{req.protocol_version}, learner speaks v{m.PROTOCOL_VERSION}")
            case m.RelayHello():
                upstream, fallback = self.relays.hello(req)
                self._send(identity, m.RelayWelcome(upstream=upstream,
                                                    latest_version=self.version,
                                                    request_id=req.request_id,
                                                    fallback=fallback))
            case m.WeightRequest() if not self.is_actor(req.actor_id):
                self.reject("not_registered", f"weights: actor {req.actor_id!r} must send "
                            "Hello first")
            case m.WeightRequest() if self.nccl is not None:
                self._park(identity, req)
            case m.WeightRequest():
                manifests = self.store.offer(req.have_version, req.held_version, req.need_base,
                                             req.actor_id)
                relays = self.relays.ordered() if self.t.weights_via == "relay" else []
                self._send(identity, m.WeightOffer(
                    request_id=req.request_id, latest_version=self.version, manifests=manifests,
                    relays=relays, deltas=self.t.weight_full_every > 0))
            case m.BucketRequest():
                kind = ("actor" if self.is_actor(req.peer_id) else
                        "relay" if self.relays.is_relay(req.peer_id) else None)
                if kind is None:
                    self.reject("not_registered", f"weights: peer {req.peer_id!r} is neither a "
                                "joined actor nor a relay")
                    return
                data = self.store.bucket(req.key, req.index, kind, req.peer_id)
                if isinstance(data, ShardRef):  # another rank's: its answer is forwarded
                    self.shards.fetch(data, identity, req, time.monotonic())
                    return
                head = m.WeightBucket(version=self.version, index=req.index,
                                      nbytes=0 if data is None else len(data), key=req.key,
                                      request_id=req.request_id, found=data is not None)
                if data is None:
                    self._send(identity, head)
                else:
                    self.sock.send_multipart([identity, self.enc.encode(head), data], copy=False)

    def handle_shard(self, sock: zmq.Socket, limit: int = 256) -> None:
        """Forward the answers waiting on `sock` (one of `shards.sockets()`) to their peers."""
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            for identity, head, data in self.shards.reply(frames):
                if data is None:  # counted like a bucket not held here
                    self.store.missing += 1
                head = msgspec.structs.replace(head, version=self.version)
                self.sock.send_multipart([identity, self.enc.encode(head)]
                                         + ([] if data is None else [data]), copy=False)

    def _park(self, identity: bytes, req: m.WeightRequest) -> None:
        """NCCL: park a request for a newer version until every engine asked, then offer the
        newest version to all of them and broadcast it."""
        latest = self.store.latest
        if latest is None or req.have_version >= latest.manifest.version:
            self._send(identity, m.WeightOffer(request_id=req.request_id,
                                               latest_version=self.version, manifests=[]))
            return
        if req.actor_id not in self.ranks:
            if len(self.ranks) == self.nccl.engines:
                self.reject("nccl_group_full", f"weights: actor {req.actor_id!r} is one more "
                            f"than the {self.nccl.engines} engines of the NCCL group")
                return
            self.ranks[req.actor_id] = len(self.ranks) + 1
        self.parked[req.actor_id] = (identity, req.request_id)
        if len(self.parked) < self.nccl.engines:
            return
        from transport.weightsrc.nccl import broadcast_manifest

        manifest = broadcast_manifest(latest.manifest)
        for aid, (ident, rid) in self.parked.items():
            self._send(ident, m.WeightOffer(request_id=rid, latest_version=self.version,
                                            manifests=[manifest],
                                            nccl=self.nccl.plan(self.ranks[aid])))
        self.parked.clear()
        self.nccl.broadcast(latest)

    def _send(self, identity: bytes, msg) -> None:
        self.sock.send_multipart([identity, self.enc.encode(msg)])
