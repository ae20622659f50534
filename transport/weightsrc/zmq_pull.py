"""Weights over ZeroMQ: the offer from the learner, the buckets from the learner or relays.

    WeightRequest(have, held) ──▶ learner ──▶ WeightOffer(manifests with digests, relays)
    for each manifest, at most WINDOW buckets in flight:
        BucketRequest(key, i, digest) ──▶ candidate 1 (a relay) ─┐ timeout / not found /
                                          candidate 2 ...       ─┤ digest differs:
                                          the learner           ─┘ the next candidate
        digest checked (off the event loop) ─▶ kept: raw, or a delta XORed into the held copy
    one load into the engine once every manifest is complete                     (staged)
    or each bucket into the engine as soon as its turn comes, in order           (streamed)

A bucket whose digest differs from the learner's manifest is refused, counted
(`stats.corrupt_buckets`) and fetched again from the next candidate; a relay thus cannot make
an actor load bytes the learner did not publish. Deltas (`WeightOffer.deltas`): the actor keeps
the decoded buckets of its version (`held`, one host copy of the model) and applies each
delta in place; each decoded bucket is checked against `raw_digests`, and a broken chain
drops the held copy (the next offer is then a full version).

`transport.weight_load: streamed` (`_stream`): a full version's buckets go into the engine as
they arrive, at most WINDOW held by the actor at once, instead of the whole version; the engine
is paused from the first bucket to the last (an in-place load cannot leave it generating on a
half-loaded model). A stream that stops part-way leaves the engine paused and holding no whole
version (`version` -1, so the next offer is a full version). Deltas and LoRA stay staged: a
delta needs the held copy of the previous version anyway, a base comes once per learner run
and an adapter is small.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import deque
from pathlib import Path

import msgspec
import zmq

from transport import messages as m
from transport.weightsrc.integrity import digest
from transport.weightsrc import delta
from transport.weightsrc.base import PullStats, SourceContext, WeightSink
from transport.weightsrc.link import PeerLink

log = logging.getLogger(__name__)

WINDOW = 4
"""Buckets an actor has in flight: enough to keep a link busy (a bucket is ~32 MB), few
enough that a version never sits whole in the queues."""
SHUN_S = 30.0
"""A relay that failed us is skipped by later pulls for this long."""


class Gone(Exception):
    """The learner no longer holds what the offer named (a newer version replaced it)."""


class Unreachable(Exception):
    """No candidate delivered a bucket."""


class ZmqSource:
    """Buckets from the learner only (`transport.weights_via: zmq`)."""

    use_relays = False

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self.stats = PullStats()
        self.stale = False
        self.has_base = False
        """LoRA runs: the engine holds this learner run's frozen base (asked for until then)."""
        self.learner = PeerLink(ctx.learner, ctx.learner_endpoint, ctx.transport.peer_timeout_s)
        self.links: dict[str, PeerLink] = {}
        self.shunned: dict[str, float] = {}
        self.held: list[bytearray] | None = None
        """Deltas on: the decoded buckets of `held_version` (the engine's version)."""
        self.held_version = -1

    def new_run(self) -> None:
        self.stale = True
        self.has_base = False
        self.held, self.held_version = None, -1

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.learner.close(socket_too=False)  # the socket is the actor's

    async def pull(self, sink: WeightSink) -> int | None:
        rid = self.learner.next_id()
        req = m.WeightRequest(actor_id=self.ctx.actor_id, have_version=-1 if self.stale
                              else sink.version, need_base=not self.has_base, request_id=rid,
                              held_version=-1 if self.stale else self.held_version)
        try:
            offer, _ = await self.learner.ask(req, rid)
        except TimeoutError:
            return None
        if not isinstance(offer, m.WeightOffer):
            return None
        if not offer.manifests:
            return offer.latest_version
        if not offer.deltas:
            self.held, self.held_version = None, -1
        try:
            await self._load(sink, offer)
        except (Gone, Unreachable) as e:
            log.warning("weights v%d not loaded (%s); asking again",
                        offer.manifests[-1].version, e)
            return None
        return None

    async def _load(self, sink: WeightSink, offer: m.WeightOffer) -> None:
        chain = []
        for man in offer.manifests:
            if man.kind == "base":
                buckets = await self._fetch(man, offer, keep=False)
                await sink.load_packed(man, buckets)
                self.has_base = True
                log.info("loaded the base weights (%.2f MB)", man.total_bytes / 1e6)
            elif man.codec == "xor-zstd":
                chain.append(man)
            elif (self.ctx.transport.weight_load == "streamed" and man.kind == "full"
                  and not offer.deltas):
                await self._stream(sink, man, offer)
                self._loaded(man)
            else:
                keep = offer.deltas and man.kind == "full"
                buckets = await self._fetch(man, offer, keep=keep)
                await self._finish(sink, man, buckets, keep)
        if chain:
            if self.held is None or self.held_version != chain[0].base_version:
                raise Gone(f"a delta from v{chain[0].base_version}, we hold "
                           f"v{self.held_version}")
            try:
                for man in chain:
                    await self._fetch(man, offer, keep=True)
                    self.held_version = man.version
            except BaseException:
                self.held, self.held_version = None, -1  # half-applied: useless
                raise
            await self._finish(sink, decoded(chain[-1]), self.held, True,
                               sum(x.total_bytes for x in chain), len(chain))

    async def _finish(self, sink: WeightSink, man: m.WeightManifest, buckets: list,
                      keep: bool, received: int | None = None, deltas: int = 0) -> None:
        await sink.load_packed(man, buckets)
        if keep:
            self.held, self.held_version = buckets, man.version
        self._loaded(man, received, deltas)

    def _loaded(self, man: m.WeightManifest, received: int | None = None,
                deltas: int = 0) -> None:
        self.stale = False
        self.stats.versions += 1
        log.info("loaded weights v%d (%s, %.2f MB%s)", man.version, man.kind,
                 (man.total_bytes if received is None else received) / 1e6,
                 f" in {deltas} delta(s)" if deltas else "")

    async def _stream(self, sink: WeightSink, man: m.WeightManifest,
                      offer: m.WeightOffer) -> None:
        """Full version `man` into `sink` bucket by bucket, in index order, each as soon as its
        digest checks. Bucket i + WINDOW is asked for only once bucket i is in the engine, so
        the actor holds at most WINDOW buckets (in flight, or arrived and waiting for their
        turn). `begin_load` (which pauses the engine) waits for bucket 0 to arrive, so the
        engine generates through the offer and the first bucket's trip. If a bucket cannot be
        had (Gone, Unreachable) the stream stops there: the engine stays paused, holding no
        whole version, until a later pull loads one."""
        cands, dead = self.candidates(offer), set()
        ahead: deque[asyncio.Task] = deque()
        asked, begun = 0, False
        try:
            for i in range(man.num_buckets):
                while asked < man.num_buckets and len(ahead) < WINDOW:
                    ahead.append(asyncio.create_task(self._bucket(man, asked, cands, dead)))
                    asked += 1
                data = await ahead.popleft()
                if not begun:
                    await sink.begin_load(man)
                    begun = True
                await sink.load_bucket(man, i, data.buffer)
                del data  # (the sink keeps it if it must)
            await sink.end_load(man)
        except Exception:  # Gone, Unreachable, or the engine's own failure: counted, raised
            if begun:
                self.stats.broken_streams += 1
                log.warning("weights v%d stopped part-way: the engine stays paused until a "
                            "whole version is loaded", man.version)
            raise
        finally:
            for t in ahead:
                t.cancel()
            await asyncio.gather(*ahead, return_exceptions=True)

    # ------------------------------------------------------------ buckets
    def candidates(self, offer: m.WeightOffer) -> list[PeerLink]:
        """Where to ask for buckets, in order; the learner is always last."""
        return [self.learner]

    async def _fetch(self, man: m.WeightManifest, offer: m.WeightOffer, keep: bool) -> list:
        """Every bucket of `man`, checked. Raw: the bytes (bytearrays if `keep`); a delta:
        applied to `self.held` in place (returns it)."""
        out: list = [None] * man.num_buckets
        window = asyncio.Semaphore(WINDOW)
        cands = self.candidates(offer)
        dead: set[str] = set()

        async def one(i: int) -> None:
            async with window:
                data = await self._bucket(man, i, cands, dead)
                out[i] = await asyncio.to_thread(self._decode, man, i, data, keep)

        tasks = [asyncio.create_task(one(i)) for i in range(man.num_buckets)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return out

    async def _bucket(self, man: m.WeightManifest, i: int, cands: list[PeerLink],
                      dead: set[str]):
        """Bucket i's bytes with the learner's digest, from the first candidate that has them."""
        tries = [c for c in cands if c.endpoint not in dead] + [self.learner]  # learner twice
        for link in tries:
            rid = link.next_id()
            req = m.BucketRequest(peer_id=self.ctx.actor_id, key=man.key, index=i,
                                  digest=man.digests[i], request_id=rid)
            try:
                head, data = await link.ask(req, rid)
            except TimeoutError:
                self._failed(link, dead, "timed out")
                continue
            if not (isinstance(head, m.WeightBucket) and head.found and data is not None):
                if link is self.learner:
                    raise Gone(f"the learner no longer holds {man.key}")
                self._failed(link, dead, f"does not hold {man.key}")
                continue
            if await asyncio.to_thread(digest, data.buffer) != man.digests[i]:
                self.stats.corrupt_buckets += 1
                log.warning("bucket %d of %s from %s differs from the learner's digest: "
                            "refused, asking again", i, man.key, link.endpoint)
                self._failed(link, dead, "sent a corrupt bucket")
                continue
            self.stats.bytes_from[link.endpoint] = (self.stats.bytes_from.get(link.endpoint, 0)
                                                    + len(data.buffer))
            return data
        raise Unreachable(f"bucket {i} of {man.key}: no relay nor the learner delivered it")

    def _failed(self, link: PeerLink, dead: set[str], why: str) -> None:
        self.stats.source_failures += 1
        if link is not self.learner:
            dead.add(link.endpoint)
            self.shunned[link.endpoint] = asyncio.get_running_loop().time() + SHUN_S
            log.warning("relay %s %s: skipping it", link.endpoint, why)

    def _decode(self, man: m.WeightManifest, i: int, frame: zmq.Frame, keep: bool):
        """A checked bucket as what `_fetch` returns (runs in a worker thread)."""
        if man.codec == "raw":
            return bytearray(frame.buffer) if keep else frame.buffer
        held = self.held[i]
        delta.apply(held, frame.buffer)
        if digest(held) != man.raw_digests[i]:
            raise Gone(f"bucket {i} of {man.key} decodes to other bytes than the learner's")
        return held


class RelaySource(ZmqSource):
    """Buckets from a relay (`transport.weights_via: relay`): one on this host if any, else
    one picked by the actor's id; then the root relay; then the learner."""

    use_relays = True

    def candidates(self, offer: m.WeightOffer) -> list[PeerLink]:
        now = asyncio.get_running_loop().time()
        live = [r for r in offer.relays if self.shunned.get(r.endpoint, 0) < now]
        if not live:
            return [self.learner]
        local = [r for r in live if r.host == self.ctx.host]
        pick = (local or live)[zlib.crc32(self.ctx.actor_id.encode()) % len(local or live)]
        order = [pick] + ([live[0]] if live[0] != pick else [])
        return [self._link(r.endpoint) for r in order] + [self.learner]

    def _link(self, endpoint: str) -> PeerLink:
        if endpoint not in self.links:
            self.links[endpoint] = PeerLink(self.ctx.connect(endpoint), endpoint,
                                            self.ctx.transport.peer_timeout_s)
        return self.links[endpoint]


class FilesystemSource(ZmqSource):
    """Weights from files on shared storage (`transport.weights_via: filesystem`): the offer
    names each version's safetensors file (written by the learner), the socket carries only
    that notice. A LoRA run's base still comes as buckets."""

    async def _load(self, sink: WeightSink, offer: m.WeightOffer) -> None:
        for man in offer.manifests:
            if not man.path:
                await super()._load(sink, msgspec.structs.replace(offer, manifests=[man]))
                continue
            if not Path(man.path).is_file():
                raise Gone(f"{man.path} is not readable here (is transport.weights_dir on "
                           "storage this node shares?)")
            if man.kind == "adapter":  # small: loaded like buckets received
                await sink.load_packed(*await asyncio.to_thread(_packed_file, man))
            else:
                await sink.load_file(man.path, man.version)
            self.stale = False
            self.stats.versions += 1
            log.info("loaded weights v%d (%s) from %s", man.version, man.kind, man.path)


def decoded(man: m.WeightManifest) -> m.WeightManifest:
    """The manifest of a delta's decoded buckets (what an engine loads)."""
    return msgspec.structs.replace(man, codec="raw", key=f"f{man.version}", base_version=-1,
                                   digests=man.raw_digests, total_bytes=sum(man.raw_sizes))


def _packed_file(man: m.WeightManifest) -> tuple[m.WeightManifest, list]:
    """A LoRA adapter written to shared storage, as the manifest + buckets of one bucket."""
    from safetensors.torch import load_file

    from transport.weights import pack

    packed = pack(load_file(man.path), man.version, 2**62, kind=man.kind, lora=man.lora)
    return packed.manifest, list(packed.buckets)
