"""The weight-source room (transport/weightsrc/): buckets in the engine dtype with digests,
lossless deltas, offers, relays, and corrupt bytes refused. Real ZeroMQ sockets on loopback;
the learner's side is its real WeightsService on a ROUTER served by a thread; the engine is a
named fake sink that records what it loads."""

from __future__ import annotations

import asyncio
import re
import threading

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

import procs
from configs.schema import TransportConfig
from learner.publisher import Publisher
from transport import messages as m
from transport.weights import ALIGN, Layout, digest, pack, unpack
from transport.weightsrc import delta, shards
from transport.weightsrc.base import SourceContext
from transport.weightsrc.relay import Relay
from transport.weightsrc.service import WeightsService
from transport.weightsrc.store import Published, RelayTree, ShardRef, VersionStore
from transport.weightsrc.zmq_pull import RelaySource, ZmqSource


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(300, 64, generator=g) * 0.02,
            "norm": torch.ones(64), "steps": torch.arange(7, dtype=torch.int64),
            "mlp": torch.randn(64, 200, generator=g) * 0.02, "head": torch.randn(5, 3, generator=g)}


def _step(state: dict, seed: int) -> dict:
    """An optimizer-like step: every float weight moves by ~1e-5 relative (most bf16 bits stay)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return {k: v + v.abs() * 2e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point()
            else v for k, v in state.items()}


def test_pack_casts_to_the_engine_dtype_into_aligned_views_with_digests():
    state = _state()
    packed = pack(state, 3, 16 * 1024, dtype=torch.bfloat16)
    man = packed.manifest
    assert man.num_buckets > 1 and man.key == "f3" and man.codec == "raw"
    assert man.digests == [digest(b) for b in packed.buckets] == man.raw_digests
    assert all(t.offset % ALIGN == 0 for t in man.tensors)
    assert all(len(b) % ALIGN == 0 for b in packed.buckets)
    got = unpack(man, list(packed.buckets))
    for name, t in state.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    # views of the buckets, not copies
    bucket = packed.buckets[man.tensors[0].bucket]
    base = np.frombuffer(bucket, np.uint8).ctypes.data
    assert base <= got["embed"].data_ptr() < base + len(bucket)
    assert man.total_bytes == sum(len(b) for b in packed.buckets) == sum(man.raw_sizes)


def test_deltas_rebuild_every_version_bit_for_bit():
    states = [_state()]
    for i in range(5):
        states.append(_step(states[-1], i))
    versions = [pack(s, v, 16 * 1024, dtype=torch.bfloat16) for v, s in enumerate(states)]
    held = [bytearray(b) for b in versions[0].buckets]
    for v in range(1, 6):
        d = delta.make(versions[v], versions[v - 1])
        assert d.manifest.key == f"d{v}" and d.manifest.base_version == v - 1
        assert d.manifest.total_bytes < versions[v].manifest.total_bytes / 2
        for i, (h, b) in enumerate(zip(held, d.buckets)):
            assert digest(b) == d.manifest.digests[i]
            delta.apply(h, b)
            assert digest(h) == d.manifest.raw_digests[i]
    assert [bytes(h) for h in held] == [bytes(b) for b in versions[5].buckets]
    frac = delta.changed_fraction(versions[5], versions[4])
    assert 0 < frac < 0.5
    # a delta applied to the wrong base gives other bytes, which the raw digest exposes
    wrong = [bytearray(b) for b in versions[0].buckets]
    delta.apply(wrong[0], delta.make(versions[2], versions[1]).buckets[0])
    assert digest(wrong[0]) != versions[2].manifest.raw_digests[0]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_packing_their_own_buckets_merge_into_the_whole_version(world):
    """Each learner rank packs the buckets `Layout` gives it (the others' tensors as meta
    tensors, unfilled, unhashed); rank 0's merge of every rank's digests is the manifest of the
    version packed whole, for the full version and its delta, and each rank's bytes are the
    whole version's (transport/weightsrc/shards.py)."""
    g = torch.Generator().manual_seed(7)
    sizes = [10, 3000, 700, 20000, 5, 9000, 400] * 5
    v1 = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    v2 = _step(v1, 0)
    bucket = 24 * 1024
    whole1, whole2 = (pack(s, v, bucket, dtype=torch.bfloat16) for v, s in ((1, v1), (2, v2)))
    parts = []
    for rank in range(world):
        layout = Layout(bucket, world)
        owners = [layout.place(t.numel() * 2) for t in v2.values()]
        assert owners == [layout.owners[t.bucket] for t in whole2.manifest.tensors]
        keep = lambda i: layout.owners[i] == rank  # noqa: E731

        def mine(state):
            return {k: t if o == rank else torch.empty(t.shape, device="meta")
                    for (k, t), o in zip(state.items(), owners)}
        p1, p2 = (pack(mine(s), v, bucket, dtype=torch.bfloat16, keep=keep)
                  for v, s in ((1, v1), (2, v2)))
        parts.append(Published(full=p2, delta=delta.make(p2, p1)))
    assert sorted(set(layout.owners)) == list(range(world))
    readies = [m.ShardReady(rank=r, version=2, digests=p.full.manifest.digests,
                            delta_digests=p.delta.manifest.digests,
                            delta_sizes=[len(b or b"") for b in p.delta.buckets])
               for r, p in enumerate(parts) if r]
    merged = shards.merge(parts[0], readies)
    want = delta.make(whole2, whole1)
    assert merged.full.manifest == whole2.manifest and merged.delta.manifest == want.manifest
    for got, whole in ((merged.full, whole2), (merged.delta, want)):
        for i, b in enumerate(got.buckets):
            owner = b.rank if isinstance(b, ShardRef) else 0
            ref = (parts[owner].full if got is merged.full else parts[owner].delta).buckets[i]
            assert bytes(ref) == bytes(whole.buckets[i]), i
    with pytest.raises(RuntimeError, match="claimed by two ranks"):
        shards.merge(parts[0], readies + readies[:1])
    with pytest.raises(RuntimeError, match="no rank packed buckets"):
        shards.merge(parts[0], readies[1:])


def _thread_all_gather(world: int):
    """A named fake of the process group's all_gather of strings (learner/distributed.py
    all_gather_strings) for `world` threads standing in for the ranks."""
    slots, barrier = [None] * world, threading.Barrier(world)

    def for_rank(rank: int):
        def gather(s: str) -> list[str]:
            slots[rank] = s
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return gather
    return for_rank


def test_ranks_on_several_nodes_link_over_curve_and_admit_only_the_learner(tmp_path,
                                                                        monkeypatch):
    """Ranks on different nodes (LOCAL_WORLD_SIZE < world): tcp on the address towards
    MASTER_ADDR with the learner's CURVE keys. Real Publishers on two ranks give rank 0 the
    whole version's manifest; a bucket of rank 1 comes back through the Client; a client with
    another key gets nothing; ShardStop ends rank 1's server."""
    import zmq.auth

    from transport.weightsrc.shards import Client, Collector, RankServer, link

    public, secret = zmq.auth.create_certificates(str(tmp_path), "learner")
    t = TransportConfig(curve_server_secret=secret, curve_server_public=public,
                        curve_allowed_dir=str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    links, gather = [None, None], _thread_all_gather(2)
    threads = [threading.Thread(target=lambda r=r: links.__setitem__(r, link(r, 2, t, gather(r))))
               for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert links[0].endpoints == links[1].endpoints
    assert all(e.startswith("tcp://127.0.0.1:") for e in links[0].endpoints)
    state, got = _state(), []
    collector = Collector(links[0], timeout_s=30)
    rank0 = Publisher(4096, 0, lambda p: got.append(collector.complete(p)), world=2)
    server = RankServer(links[1])
    rank1 = Publisher(4096, 0, server.deliver, rank=1, world=2)
    for pub in (rank1, rank0):
        pub.publish(1, state.items(), dtype=torch.bfloat16)
    rank0.wait()
    whole = pack(state, 1, 4096, dtype=torch.bfloat16)
    assert got[0].full.manifest == whole.manifest
    i = next(i for i, b in enumerate(got[0].full.buckets) if isinstance(b, ShardRef))
    req = m.BucketRequest(peer_id="p", key="f1", index=i, digest=b"", request_id=5)
    client = Client(links[0], hold_s=30)
    client.fetch(got[0].full.buckets[i], b"peer", req, 0.0)
    (peer, head, data), = client.reply(client.socks[1].recv_multipart(copy=False))
    assert peer == b"peer" and head.request_id == 5 and data.bytes == bytes(whole.buckets[i])
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rpublic, rsecret = zmq.auth.load_certificate(zmq.auth.create_certificates(
        str(tmp_path), "rogue")[1])
    rogue.curve_publickey, rogue.curve_secretkey = rpublic, rsecret
    rogue.curve_serverkey = zmq.auth.load_certificate(public)[0]
    rogue.connect(links[1].endpoints[1])
    rogue.send(m.encoder().encode(req))
    assert not rogue.poll(1000)  # refused at the handshake: no answer
    rogue.close(linger=0)
    client.stop()
    assert server.done.wait(10)


def _published(states: list[dict], full_every: int) -> list[Published]:
    out, prev = [], None
    for v, s in enumerate(states):
        p = pack(s, v, 16 * 1024, dtype=torch.bfloat16)
        out.append(Published(full=p, delta=delta.make(p, prev) if prev and full_every else None))
        prev = p
    return out


def test_offers_chain_deltas_resync_at_full_points_and_evict():
    states = [_state()]
    for i in range(8):
        states.append(_step(states[-1], i))
    pubs = _published(states, full_every=4)
    store = VersionStore(full_every=4)
    for p in pubs[:7]:  # v0..v6
        store.add(p)
    keys = lambda offer: [x.key for x in offer]  # noqa: E731
    assert keys(store.offer(4, 4, False)) == ["d5", "d6"]
    assert keys(store.offer(5, 5, False)) == ["d6"]
    assert keys(store.offer(4, -1, False)) == ["f6"]  # keeps no decoded copy: full
    assert keys(store.offer(3, 3, False)) == ["f6"]  # from before the full point v4
    assert store.offer(6, 6, False) == []
    store.add(pubs[7])
    store.add(pubs[8])  # v8 is a full point: everyone resynchronises
    assert keys(store.offer(7, 7, False)) == ["f8"]
    assert sorted(k for k in store.blobs if k[0] == "f") == ["f8"]  # nobody fetches f7
    assert not [k for k in store.blobs if k[0] == "d"]
    assert store.bucket("f3", 0, "actor") is None and store.missing == 1


def test_an_older_version_is_kept_exactly_while_a_peer_fetches_it():
    pubs = _published([_state(), _step(_state(), 0), _step(_step(_state(), 0), 1)], 0)
    store = VersionStore(full_every=0, hold_s=60.0)
    store.add(pubs[0])
    n = len(pubs[0].full.buckets)
    assert n > 2
    assert [x.key for x in store.offer(-1, -1, False, "a1")] == ["f0"]
    store.bucket("f0", 0, "actor", "a1")
    store.bucket("f0", 1, "relay", "r1")  # a relay's fetch begins with a bucket request
    store.add(pubs[1])
    assert sorted(store.blobs) == ["f0", "f1"]  # a1 and r1 are mid-fetch
    for i in range(n):  # r1 asks for every bucket: its fetch is over, a1's is not
        store.bucket("f0", i, "relay", "r1")
    assert sorted(store.blobs) == ["f0", "f1"]
    store.fetches[("a1", "f0")].last -= 61  # a1 went silent past hold_s
    store.add(pubs[2])
    assert sorted(store.blobs) == ["f2"] and not store.fetches
    assert store.bucket("f0", 2, "actor", "a1") is None  # a1 will ask for the newest
    # a new request ends the peer's earlier fetch, even one that asked for no bucket yet
    store.offer(-1, -1, False, "a2")
    store.add(Published(full=pack(_state(), 3, 16 * 1024, dtype=torch.bfloat16)))
    assert sorted(store.blobs) == ["f2", "f3"]
    assert [x.key for x in store.offer(2, -1, False, "a2")] == ["f3"]
    assert sorted(store.blobs) == ["f3"]


def test_relays_form_a_chain_or_a_tree_with_a_fallback_each():
    hello = lambda i: m.RelayHello(relay_id=f"r{i}", endpoint=f"tcp://h{i}:1", host=f"h{i}")  # noqa: E731
    chain = RelayTree(fanout=1, timeout_s=60)
    assert [chain.hello(hello(i)) for i in range(4)] == [
        ("", ""), ("tcp://h0:1", ""), ("tcp://h1:1", "tcp://h0:1"), ("tcp://h2:1", "tcp://h1:1")]
    tree = RelayTree(fanout=2, timeout_s=60)
    assert [tree.hello(hello(i))[0] for i in range(5)] == [
        "", "tcp://h0:1", "tcp://h0:1", "tcp://h1:1", "tcp://h1:1"]
    chain.relays["r1"].last_seen -= 61  # silent past the timeout: out, the chain closes up
    assert chain.hello(hello(2)) == ("tcp://h0:1", "")
    assert [r.relay_id for r in chain.ordered()] == ["r0", "r2", "r3"]


# ---------------------------------------------------------------- over sockets

class RecordingSink:
    """A named fake engine client: keeps a copy of every version it loads (streamed ones
    bucket by bucket, in order)."""

    def __init__(self) -> None:
        self.version = -1
        self.loaded: list[tuple[int, list[bytes]]] = []
        self.streaming: list[bytes] = []

    async def begin_load(self, manifest: m.WeightManifest) -> None:
        self.streaming, self.version = [], -1

    async def load_bucket(self, manifest: m.WeightManifest, index: int, bucket) -> None:
        assert index == len(self.streaming)
        self.streaming.append(bytes(bucket))

    async def end_load(self, manifest: m.WeightManifest) -> None:
        await self.load_packed(manifest, self.streaming)

    async def load_packed(self, manifest: m.WeightManifest, buckets: list) -> None:
        assert manifest.codec == "raw"
        assert [digest(b) for b in buckets] == manifest.digests
        unpack(manifest, list(buckets))  # the layout holds
        self.loaded.append((manifest.version, [bytes(b) for b in buckets]))
        self.version = manifest.version


class LearnerSide:
    """The learner's real WeightsService on a ROUTER, served by a thread (as its I/O thread
    does); `add` publishes under the same lock."""

    def __init__(self, t: TransportConfig) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.rejected: list[str] = []
        self.service = WeightsService(self.sock, t, is_actor=lambda aid: aid.startswith("a"),
                                      reject=lambda reason, detail: self.rejected.append(reason))
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(20):
                with self.lock:
                    self.service.handle(self.sock.recv_multipart())

    def add(self, pub: Published) -> None:
        with self.lock:
            self.service.add(pub.full.manifest.version, pub)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


def _source(cls, actx: zmq.asyncio.Context, learner: LearnerSide, t: TransportConfig,
            actor_id: str = "a0"):
    def connect(endpoint: str):
        s = actx.socket(zmq.DEALER)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        return s
    return cls(SourceContext(actor_id=actor_id, learner=connect(learner.endpoint),
                             learner_endpoint=learner.endpoint, connect=connect, transport=t,
                             host="node-a"))


class ByteFlippingRelay(Relay):
    """A named fake relay: a real Relay that flips one byte of the first bucket it serves."""

    flipped = 0

    async def bucket(self, key, index, want):
        data = await super().bucket(key, index, want)
        if data is not None and not self.flipped:
            self.flipped += 1
            bad = bytearray(data)
            bad[len(bad) // 2] ^= 0x40
            return bytes(bad)
        return data


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@pytest.mark.parametrize("weight_load", ["staged", "streamed"])
def test_a_corrupt_bucket_from_a_relay_is_refused_fetched_again_and_counted(weight_load):
    t = TransportConfig(weights_via="relay", peer_timeout_s=5, heartbeat_s=0.2,
                        weight_load=weight_load)
    learner = LearnerSide(t)
    pub = _published([_state()], full_every=0)[0]
    learner.add(pub)

    async def scenario():
        stopped = asyncio.Event()
        relay = ByteFlippingRelay(t, learner.endpoint, "relay-0", "127.0.0.1", "127.0.0.1")
        running = asyncio.create_task(relay.run(stopped))
        await relay.joined.wait()
        actx = zmq.asyncio.Context()
        src = _source(RelaySource, actx, learner, t)
        sink = RecordingSink()
        assert await src.pull(sink) is None
        stopped.set()
        await running
        src.close()
        actx.destroy(linger=0)
        return src, sink, relay

    try:
        src, sink, relay = _run(scenario())
    finally:
        learner.close()
    assert relay.flipped == 1
    assert src.stats.corrupt_buckets == 1  # refused and counted ...
    assert sink.loaded == [(0, [bytes(b) for b in pub.full.buckets])]  # ... and fetched again
    assert src.stats.bytes_from[learner.endpoint] > 0  # from the learner, after the relay
    assert learner.rejected == []


def test_a_relay_refuses_a_corrupt_bucket_from_its_upstream_relay_and_hashes_none_from_the_learner(
        monkeypatch):
    t = TransportConfig(weights_via="relay", peer_timeout_s=5, heartbeat_s=0.2)
    learner = LearnerSide(t)
    pub = _published([_state()], full_every=0)[0]
    learner.add(pub)
    man = pub.full.manifest
    import transport.weightsrc.relay as relay_module
    hashed: list[int] = []
    monkeypatch.setattr(relay_module, "digest", lambda b: hashed.append(len(b)) or digest(b))

    async def scenario():
        stopped = asyncio.Event()
        root = ByteFlippingRelay(t, learner.endpoint, "relay-0", "127.0.0.1", "127.0.0.1")
        tasks = [asyncio.create_task(root.run(stopped))]
        await root.joined.wait()  # the root first: the second relay's upstream is the root
        below = Relay(t, learner.endpoint, "relay-1", "127.0.0.1", "127.0.0.1")
        tasks.append(asyncio.create_task(below.run(stopped)))
        await below.joined.wait()
        assert below.upstream.endpoint == root.endpoint
        first = await below.bucket(man.key, 0, man.digests[0])  # flipped by the root
        again = await below.bucket(man.key, 0, man.digests[0])  # from the cache
        stopped.set()
        await asyncio.gather(*tasks)
        return root, below, bytes(first), bytes(again)

    try:
        root, below, first, again = _run(scenario())
    finally:
        learner.close()
    assert root.flipped == 1 and below.counts["corrupt"] == 1  # refused ...
    assert first == again == bytes(pub.full.buckets[0])  # ... fetched again, cached good
    assert below.counts["hits"] == 1 and below.counts["bytes_in"] == len(first)
    size = len(first)
    assert learner.service.store.sent_bytes == {"relay": 2 * size}  # root's fetch, then below's
    assert hashed == [size]  # the root's (flipped) bytes only: nothing from the learner


def test_deltas_over_sockets_catch_up_bit_identical_and_resync_at_full_points():
    t = TransportConfig(weight_full_every=3, peer_timeout_s=5, weight_bucket_bytes=16 * 1024)
    learner = LearnerSide(t)
    publisher = Publisher(t.weight_bucket_bytes, t.weight_full_every, learner.add)
    states = [_state()]
    for i in range(3):
        states.append(_step(states[-1], i))

    async def scenario():
        actx = zmq.asyncio.Context()
        src = _source(ZmqSource, actx, learner, t)
        sink = RecordingSink()
        sizes = []
        for versions in ([0], [1, 2], [3]):
            for v in versions:  # the packer thread packs and "announces"
                publisher.publish(v, states[v].items(), dtype=torch.bfloat16)
            publisher.wait()
            before = sum(src.stats.bytes_from.values())
            assert await src.pull(sink) is None
            sizes.append(sum(src.stats.bytes_from.values()) - before)
        assert await src.pull(sink) == 3  # has the newest
        src.close()
        actx.destroy(linger=0)
        return sink, sizes

    try:
        sink, sizes = _run(scenario())
    finally:
        learner.close()
    full = [pack(s, v, t.weight_bucket_bytes, dtype=torch.bfloat16) for v, s in enumerate(states)]
    assert [v for v, _ in sink.loaded] == [0, 2, 3]
    for v, buckets in sink.loaded:  # bit for bit what a full transfer would give
        assert buckets == [bytes(b) for b in full[v].buckets]
    total = full[0].manifest.total_bytes
    assert sizes[0] == total and sizes[1] < total / 2 and sizes[2] == total  # v3: full point


@pytest.mark.parametrize("weight_load", ["staged", "streamed"])
def test_a_relay_fetches_each_bucket_once_for_all_its_actors(weight_load):
    t = TransportConfig(weights_via="relay", peer_timeout_s=5, heartbeat_s=0.2,
                        weight_load=weight_load)
    learner = LearnerSide(t)
    pub = _published([_state()], full_every=0)[0]
    learner.add(pub)

    async def scenario():
        stopped = asyncio.Event()
        relay = Relay(t, learner.endpoint, "relay-0", "127.0.0.1", "127.0.0.1")
        running = asyncio.create_task(relay.run(stopped))
        await relay.joined.wait()
        actx = zmq.asyncio.Context()
        srcs = [_source(RelaySource, actx, learner, t, actor_id=f"a{i}") for i in range(4)]
        sinks = [RecordingSink() for _ in srcs]
        await asyncio.gather(*(s.pull(k) for s, k in zip(srcs, sinks)))
        stopped.set()
        await running
        for s in srcs:
            s.close()
        actx.destroy(linger=0)
        return sinks, relay

    try:
        sinks, relay = _run(scenario())
    finally:
        learner.close()
    total = pub.full.manifest.total_bytes
    for sink in sinks:
        assert sink.loaded == [(0, [bytes(b) for b in pub.full.buckets])]
    sent = learner.service.store.sent_bytes
    assert sent == {"relay": total}  # the learner sent the version once, to the relay
    assert relay.counts["bytes_out"] == 4 * total


def test_a_reply_to_an_earlier_request_is_skipped_with_its_bytes():
    """A learner run that comes back answers every request ZeroMQ queued while it was away;
    the earlier answers (and their buckets) are skipped, not loaded."""
    t = TransportConfig(peer_timeout_s=5)
    pubs = _published([_state(), _step(_state(), 0)], full_every=0)

    async def scenario():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        learner = type("L", (), {"endpoint": endpoint})
        src = _source(ZmqSource, ctx, learner, t)
        src.learner.ids = iter(range(7, 100))  # six requests went out before
        sink = RecordingSink()
        enc = m.encoder()
        dec = m.Decoders().weight_request

        async def serve():
            identity, payload = await router.recv_multipart()
            req = dec.decode(payload)
            assert req.request_id == 7
            for rid, p in ((6, pubs[0]), (7, pubs[1])):  # request 6's late answer first
                await router.send_multipart([identity, enc.encode(m.WeightOffer(
                    request_id=rid, latest_version=p.full.manifest.version,
                    manifests=[p.full.manifest]))])
            for _ in range(pubs[1].full.manifest.num_buckets):
                identity, payload = await router.recv_multipart()
                b = dec.decode(payload)
                data = pubs[1].full.buckets[b.index]
                await router.send_multipart([identity, enc.encode(m.WeightBucket(
                    version=1, index=b.index, nbytes=len(data), key=b.key,
                    request_id=b.request_id - 1)), data])  # a stale bucket reply first
                await router.send_multipart([identity, enc.encode(m.WeightBucket(
                    version=1, index=b.index, nbytes=len(data), key=b.key,
                    request_id=b.request_id)), data])

        await asyncio.gather(serve(), src.pull(sink))
        src.close()
        router.close(linger=0)
        ctx.destroy(linger=0)
        return src, sink

    src, sink = _run(scenario())
    assert [v for v, _ in sink.loaded] == [1]  # not v0, and v1 once
    assert src.learner.skipped >= 1 + pubs[1].full.manifest.num_buckets


def test_a_run_with_bf16_deltas_trains_and_accounts(tmp_path, tiny_model_dir):
    """Learner and two actors in one process (transport.kind=inproc), the engines in bf16, every
    version after the first offered as deltas until the next full point (K = 3)."""
    run = tmp_path / "run"
    default = torch.get_default_dtype()
    try:
        s, logs = procs.run_inproc(run, tiny_model_dir, "learner.max_steps=7", "max_staleness=1",
                                   "model.dtype=bfloat16", "transport.weight_full_every=3")
    finally:
        # building bf16 models in several threads at once (transformers sets and restores the
        # process-wide default dtype around each) can leave it bf16: later tests need float32
        torch.set_default_dtype(default)
    assert s["steps"] == 7 and s["accounting_ok"] and s["rejected_messages"] == {}
    text = "\n".join(line for name in ("actor-local-0", "actor-local-1")
                     for line in logs.lines[name])
    by_delta = re.findall(r"loaded weights v(\d+) \(full, [\d.]+ MB in \d delta", text)
    assert by_delta and all(int(v) % 3 for v in by_delta), by_delta  # never at a full point
    assert s["weights_sent_bytes"]["actor"] > 0


class RecordingBroadcaster:
    """A named fake of the learner's NcclBroadcaster: records what it is asked to broadcast."""

    engines = 2

    def __init__(self) -> None:
        self.sent: list[int] = []

    def plan(self, engine: int) -> m.NcclPlan:
        return m.NcclPlan(master_address="h", master_port=1, world_size=3, rank_offset=engine)

    def broadcast(self, packed) -> None:
        self.sent.append(packed.manifest.version)


def test_nccl_offers_wait_for_every_engine_then_broadcast_once():
    """weights_via=nccl: a broadcast needs the whole group, so the learner answers the
    engines' requests together, each with its rank, and broadcasts the newest version once."""
    t = TransportConfig(weights_via="nccl", nccl_engines=2, peer_timeout_s=5)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    rejected: list[str] = []
    fake = RecordingBroadcaster()
    service = WeightsService(router, t, is_actor=lambda aid: True,
                             reject=lambda reason, detail: rejected.append(reason), nccl=fake)
    service.add(0, _published([_state()], full_every=0)[0])
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = [ctx.socket(zmq.DEALER) for _ in range(3)]
    enc, dec = m.encoder(), m.Decoders().weights
    for i, d in enumerate(dealers):
        d.connect(f"tcp://127.0.0.1:{port}")
        d.send(enc.encode(m.WeightRequest(actor_id=f"a{i}", have_version=-1, request_id=i + 1)))
        service.handle(router.recv_multipart())
        if i == 0:
            assert not dealers[0].poll(100) and fake.sent == []  # parked: one engine of two
    offers = [dec.decode(d.recv()) for d in dealers[:2]]
    assert fake.sent == [0]
    assert [(o.request_id, o.nccl.rank_offset, o.manifests[0].codec) for o in offers] == [
        (1, 1, "nccl"), (2, 2, "nccl")]
    assert offers[0].manifests[0].tensors == _published([_state()], 0)[0].full.manifest.tensors
    assert rejected == ["nccl_group_full"] and not dealers[2].poll(100)  # a third engine
    for s in (*dealers, router):
        s.close(linger=0)
    ctx.term()


def test_nccl_group_counts_every_worker_of_tensor_parallel_engines():
    """Engines of TP 2 in the broadcast group: the group has 1 + 2 x 2 ranks and engine i's
    workers start at rank 1 + 2 (i - 1), where each adds its own worker rank (vLLM's and
    SGLang's receivers); with TP 1 the engines are ranks 1 and 2."""
    from transport.weightsrc.nccl import NcclBroadcaster

    tp2 = NcclBroadcaster("127.0.0.1", 2, torch.device("cpu"), "torch", ranks_per_engine=2)
    assert [(p.world_size, p.rank_offset) for p in (tp2.plan(1), tp2.plan(2))] == [(5, 1), (5, 3)]
    tp1 = NcclBroadcaster("127.0.0.1", 2, torch.device("cpu"), "torch")
    assert [(p.world_size, p.rank_offset) for p in (tp1.plan(1), tp1.plan(2))] == [(3, 1), (3, 2)]


def test_an_interrupted_publish_is_not_announced_and_a_packer_error_reaches_the_trainer():
    announced = []
    pub = Publisher(1024, full_every=0, deliver=lambda p: announced.append(p.full.manifest.version))

    def interrupted():
        yield "a", torch.ones(4)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pub.publish(1, interrupted())
    pub.publish(2, _state().items())
    assert pub.wait().full.manifest.version == 2 and announced == [2]

    def fail(p):
        raise OSError("socket closed")

    broken = Publisher(1024, full_every=0, deliver=fail)
    broken.publish(1, _state().items())
    with pytest.raises(RuntimeError, match="packer thread failed"):
        broken.wait()
