"""The actor's weight pull (actors/weight_pull.py) takes only the reply to its own request: a
learner run that comes back answers every request ZeroMQ queued while it was away, and those earlier replies (with
their buckets) are skipped, not loaded twice. Real ZeroMQ sockets; the engine client is a named
fake that records what it loads."""

from __future__ import annotations

import asyncio

import msgspec
import torch
import zmq
import zmq.asyncio

from actors.weight_pull import WeightPuller
from transport import messages as m
from transport.weights import pack


class RecordingClient:
    """A named fake LLMClient: holds a version, records each load_packed."""

    def __init__(self) -> None:
        self.version = 0
        self.loaded: list[tuple[str, int]] = []

    async def load_packed(self, manifest: m.WeightManifest, buckets: list) -> None:
        self.loaded.append((manifest.kind, manifest.version))
        if manifest.kind != "base":
            self.version = manifest.version


def _reply(router, identity: bytes, packed, request_id: int) -> None:
    enc = m.encoder()
    router.send_multipart([identity, enc.encode(
        msgspec.structs.replace(packed.manifest, request_id=request_id))])
    for i, data in enumerate(packed.buckets):
        router.send_multipart([identity, enc.encode(m.WeightBucket(
            version=packed.manifest.version, index=i, nbytes=len(data))), data])


def test_replies_to_earlier_requests_are_skipped_with_their_buckets():
    state = {f"w{i}": torch.full((3, 4), float(i)) for i in range(3)}
    old, new = pack(state, 3, 16), pack(state, 5, 16)  # a tensor a bucket: three per version
    assert old.manifest.num_buckets > 1

    async def scenario():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        puller = WeightPuller(dealer, "a0", timeout_s=10)
        puller.requests = 6  # six requests went out before, the last unanswered
        puller.has_base = True  # a full-weights run would ignore need_base anyway
        client = RecordingClient()

        async def learner():
            identity, payload = await router.recv_multipart()
            req = m.Decoders().weight_request.decode(payload)
            _reply(router, identity, old, request_id=req.request_id - 1)  # answers request 6
            _reply(router, identity, new, request_id=req.request_id)
            return req

        req, newest = await asyncio.gather(learner(), puller.pull(client))
        for s in (router, dealer):
            s.close(linger=0)
        ctx.term()
        return req, newest, puller, client

    req, newest, puller, client = asyncio.run(scenario())
    assert req.request_id == 7 and req.have_version == 0 and not req.need_base
    assert client.loaded == [("full", 5)]  # not v3, and v5 once
    assert newest is None and client.version == 5 and not puller.stale
