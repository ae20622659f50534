"""A weight relay: one per node, it fetches each bucket once and serves it to every peer that asks.

    python -m transport.weightsrc.relay -c CONFIG [key=value ...] LEARNER [--relay-id ID]
        [--bind HOST] [--advertise HOST] [--port N]

LEARNER is the learner's weights endpoint (tcp://host:port), or its endpoints.json / run
directory. The relay says RelayHello to the learner every heartbeat_s; the learner places it in
a tree (transport/weightsrc/store.py RelayTree) and answers with its upstream: another relay,
or the learner itself.

    actors / child relays ──BucketRequest(key, i, digest)──▶ ROUTER ─▶ cache hit: send
                                                             miss ─▶ one fetch per bucket,
                                                                     however many peers wait
        upstream relay ─(timeout, not found, digest differs)─▶ its upstream ─▶ the learner

What blocks where: nothing; every request is a task. A bucket from an upstream relay is cached
only after its SHA-256 matched the digest the requester named (which it took from the learner's
manifest), so a bad upstream relay cannot poison the cache for honest peers; one from the
learner is cached unhashed (its bytes define the digest; every actor checks what it loads, so
the relay's check there only cost a hash of every version on the path to every host). The
cache keeps the buckets of the newest `keep_versions` versions (max_staleness + 3). A killed
relay loses nothing: its peers time out after peer_timeout_s and ask the next relay or the
learner, and the learner drops it from the tree after peer_timeout_s of silence.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections import Counter

import msgspec
import zmq
import zmq.asyncio

from configs.loader import ConfigError, load_config, resolve_endpoint, setup_process
from configs.schema import TransportConfig
from transport import messages as m
from transport import security
from transport.sockets import bind, configure
from transport.weightsrc.integrity import digest
from transport.weightsrc.link import PeerLink
from transport.weightsrc.relay_memory import reuse_receive_buffers

log = logging.getLogger(__name__)


def key_version(key: str) -> int:
    """The version a manifest key names (the LoRA base "b": -1, never evicted)."""
    return int(key[1:]) if key[1:].isdigit() else -1


class Relay:
    def __init__(self, t: TransportConfig, learner_endpoint: str, relay_id: str,
                 bind_host: str, advertise_host: str, port: int = 0,
                 keep_versions: int = 4) -> None:
        self.t = t
        self.keep_versions = keep_versions
        self.relay_id = relay_id
        self.ctx = zmq.asyncio.Context()
        # CURVE (transport.curve_*): peers are admitted as by the learner (its allowed keys),
        # and the relay dials its upstreams as an actor does (its client key)
        self._auth = security.start_authenticator(zmq.Context.shadow(self.ctx.underlying), t)
        self.server = configure(self.ctx.socket(zmq.ROUTER), t, limit_size=True)
        self.server.setsockopt(zmq.SNDHWM, 0)  # queued frames are references to cached buckets
        security.make_server(self.server, t)
        self.endpoint = f"tcp://{advertise_host}:{bind(self.server, bind_host, port)}"
        self.host = advertise_host
        self.learner = PeerLink(self._connect(learner_endpoint), learner_endpoint,
                                t.peer_timeout_s)
        self.upstream: PeerLink | None = None
        """The relay above us in the tree (None: we fetch from the learner)."""
        self.fallback: PeerLink | None = None
        """The relay above that one (None: the learner), asked when the upstream fails."""
        self.cache: dict[tuple[str, int], asyncio.Future] = {}
        """(key, index) -> the bucket's bytes (a future while its one fetch runs)."""
        self.newest = -1
        self.counts: Counter[str] = Counter()
        """bytes_in, bytes_out, requests, hits, corrupt, upstream_failures, not_found."""
        self.joined = asyncio.Event()
        self.answering: set[asyncio.Task] = set()

    def _connect(self, endpoint: str) -> zmq.asyncio.Socket:
        sock = configure(self.ctx.socket(zmq.DEALER), self.t, limit_size=False)
        sock.setsockopt(zmq.RCVHWM, 0)
        security.make_client(sock, self.t)
        sock.connect(endpoint)
        return sock

    async def run(self, stopped: asyncio.Event) -> None:
        tasks = [asyncio.create_task(c) for c in (self._hello_loop(), self._serve(),
                                                  stopped.wait())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception():
                    raise t.exception()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            log.info("relay %s done: %s", self.relay_id, dict(self.counts))
            for link in (self.learner, self.upstream, self.fallback):
                if link is not None:
                    link.close()
            self.server.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self.ctx.destroy(linger=0)

    async def _hello_loop(self) -> None:
        """RelayHello every heartbeat_s; the answer names our upstream."""
        while True:
            rid = self.learner.next_id()
            try:
                welcome, _ = await self.learner.ask(m.RelayHello(
                    relay_id=self.relay_id, endpoint=self.endpoint, host=self.host,
                    request_id=rid), rid)
            except TimeoutError:
                log.warning("no answer from the learner in %.0fs", self.t.peer_timeout_s)
                continue
            if isinstance(welcome, m.RelayWelcome):
                self.upstream = self._relink(self.upstream, welcome.upstream)
                self.fallback = self._relink(self.fallback, welcome.fallback)
                if not self.joined.is_set():
                    log.info("relay %s serving at %s (upstream: %s)", self.relay_id,
                             self.endpoint, welcome.upstream or "the learner")
                    self.joined.set()
            await asyncio.sleep(self.t.heartbeat_s)  # the beat's period, not synchronisation

    def _relink(self, link: PeerLink | None, endpoint: str) -> PeerLink | None:
        """`link` if it goes to `endpoint` already, else a new link to it (None for "")."""
        if (link.endpoint if link else "") == endpoint:
            return link
        if link is not None:
            link.close()
        return PeerLink(self._connect(endpoint), endpoint, self.t.peer_timeout_s) if endpoint else None

    async def _serve(self) -> None:
        dec = msgspec.msgpack.Decoder(m.BucketRequest)
        while True:
            identity, payload = await self.server.recv_multipart()
            try:
                req = dec.decode(payload)
            except msgspec.DecodeError as e:  # ValidationError included
                log.warning("malformed request dropped: %s", e)
                continue
            task = asyncio.create_task(self._answer(identity, req))
            self.answering.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(self.answering.discard)

    async def _answer(self, identity: bytes, req: m.BucketRequest) -> None:
        self.counts["requests"] += 1
        data = await self.bucket(req.key, req.index, req.digest)
        enc = m.encoder()
        head = m.WeightBucket(version=key_version(req.key), index=req.index,
                              nbytes=0 if data is None else len(data), key=req.key,
                              request_id=req.request_id, found=data is not None)
        if data is None:
            self.counts["not_found"] += 1
            await self.server.send_multipart([identity, enc.encode(head)])
            return
        self.counts["bytes_out"] += len(data)
        await self.server.send_multipart([identity, enc.encode(head), data], copy=False)

    async def bucket(self, key: str, index: int, want: bytes):
        """The bucket's bytes matching digest `want`, fetched once; None if nobody has them."""
        fut = self.cache.get((key, index))
        if fut is not None:
            self.counts["hits"] += 1
            got = await asyncio.shield(fut)  # done at once, or when its one fetch ends
            if got is None or got[1] == want:
                return None if got is None else got[0]
            self.counts["hits"] -= 1  # a different digest: fetched again below
        fut = asyncio.get_running_loop().create_future()
        self.cache[(key, index)] = fut
        data = await self._fetch(key, index, want)
        fut.set_result(None if data is None else (data, want))
        if data is None:
            del self.cache[(key, index)]
            return None
        self._evict(key_version(key))
        return data

    async def _fetch(self, key: str, index: int, want: bytes):
        """From the upstream relay, then the fallback relay, then the learner; each gets a
        quarter of peer_timeout_s, so a peer waiting on us (peer_timeout_s) gets the bucket
        before it gives up on us, also when our upstream died."""
        for link in [x for x in (self.upstream, self.fallback, self.learner) if x is not None]:
            rid = link.next_id()
            req = m.BucketRequest(peer_id=self.relay_id, key=key, index=index, digest=want,
                                  request_id=rid)
            try:
                head, data = await link.ask(req, rid, self.t.peer_timeout_s / 4)
            except TimeoutError:
                self.counts["upstream_failures"] += 1
                continue
            if not (isinstance(head, m.WeightBucket) and head.found and data is not None):
                self.counts["upstream_failures"] += 1
                continue
            # the learner's bytes are what it published (its digests were made from them):
            # checked by every actor, not here; a relay upstream's are checked before caching
            if link is not self.learner and await asyncio.to_thread(digest, data.buffer) != want:
                self.counts["corrupt"] += 1
                log.warning("bucket %d of %s from %s differs from its digest: refused", index,
                            key, link.endpoint)
                continue
            self.counts["bytes_in"] += len(data.buffer)
            return data.buffer
        return None

    def _evict(self, version: int) -> None:
        if version <= self.newest:
            return
        self.newest = version
        floor = version - self.keep_versions
        for k in [k for k in self.cache if -1 < key_version(k[0]) <= floor]:
            del self.cache[k]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tether-relay", description=__doc__.split("\n")[0])
    p.add_argument("-c", "--config", help="YAML preset (the run's config.yaml)")
    p.add_argument("--relay-id", default=f"relay-{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--bind", default="0.0.0.0", help="interface to serve on")
    p.add_argument("--advertise", default=socket.gethostname(),
                   help="host name peers dial (also: actors on this host prefer this relay)")
    p.add_argument("--port", type=int, default=0, help="port to serve on (0 = any free)")
    p.add_argument("args", nargs="*", help="LEARNER address and key=value overrides")
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in ns.args if "=" in a and not a.startswith("tcp://")]
    targets = [a for a in ns.args if a not in overrides]
    try:
        cfg = load_config(ns.config, overrides)
        if len(targets) != 1:
            raise ConfigError(f"give exactly one learner address, got {targets or 'none'}")
        endpoint = resolve_endpoint(targets[0], "weights")
    except ConfigError as e:
        print(f"tether-relay: {e}", file=sys.stderr)
        return 2
    setup_process(f"relay[{ns.relay_id}]")
    log.info("malloc: %s", reuse_receive_buffers())  # before the ZeroMQ context's I/O thread

    async def run() -> None:
        import signal

        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopped.set)
        relay = Relay(cfg.transport, endpoint, ns.relay_id, ns.bind, ns.advertise, ns.port,
                      keep_versions=cfg.max_staleness + 3)
        await relay.run(stopped)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
