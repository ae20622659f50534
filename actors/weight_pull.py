"""An actor's weight pulls: one WeightRequest, the reply's manifest(s) and buckets, one load.

    WeightRequest(have_version, need_base, request_id) --> learner's weights ROUTER
    <-- [base manifest + buckets]  (LoRA, once per learner run: need_base)
    <-- manifest + buckets | manifest naming a shared file | empty manifest (you have the newest)

Every manifest repeats the request's id. A reply to an earlier request is skipped whole,
buckets included: one abandoned after peer_timeout_s, or queued by ZeroMQ while the learner was
away and answered by its next run. A reply that does not come within peer_timeout_s is
abandoned; the caller asks again.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import zmq.asyncio

from actors.engines.base import LLMClient
from transport import messages as m

log = logging.getLogger(__name__)


class WeightPuller:
    def __init__(self, sock: zmq.asyncio.Socket, actor_id: str, timeout_s: float) -> None:
        """`sock`: a DEALER connected to the learner's weights endpoint (RCVHWM 0)."""
        self.sock = sock
        self.actor_id = actor_id
        self.timeout_ms = timeout_s * 1000
        self.enc = m.encoder()
        self.dec = m.Decoders()
        self.stale = False
        """True after joining a different learner process: reload weights before generating."""
        self.has_base = False
        """LoRA runs: the engine holds this learner run's frozen base (asked for until then)."""
        self.requests = 0
        """WeightRequests sent: the id of the newest, which the manifests of its reply repeat."""

    def new_run(self) -> None:
        """A different learner process: neither the weights nor the base can be trusted."""
        self.stale = True
        self.has_base = False

    async def pull(self, client: LLMClient) -> int | None:
        """Load the learner's newest weights into `client` (no-op if it has them). Returns the
        learner's newest version when the reply says the client already has it, else None."""
        self.requests += 1
        rid = self.requests
        have = -1 if self.stale else client.version
        await self.sock.send(self.enc.encode(m.WeightRequest(
            actor_id=self.actor_id, have_version=have, need_base=not self.has_base,
            request_id=rid)))
        manifest = await self._next_manifest(rid)
        if manifest is not None and manifest.kind == "base":
            buckets = await self._buckets(manifest)
            if buckets is None:
                return None
            await client.load_packed(manifest, buckets)
            self.has_base = True
            log.info("loaded the base weights (%.2f MB)", manifest.total_bytes / 1e6)
            manifest = await self._next_manifest(rid)
        if manifest is None:
            return None
        if manifest.path:  # shared-filesystem weights: the notice names the file
            if not Path(manifest.path).is_file():
                log.warning("weights v%d: %s is not readable here (is transport.weights_dir on "
                            "storage this node shares?); asking again", manifest.version,
                            manifest.path)
                return None
            if manifest.kind == "adapter":  # small: loaded like buckets received
                await client.load_packed(*await asyncio.to_thread(_packed_file, manifest))
            else:
                await client.load_file(manifest.path, manifest.version)
            self.stale = False
            log.info("loaded weights v%d (%s) from %s", manifest.version, manifest.kind,
                     manifest.path)
            return None
        if manifest.num_buckets == 0:  # we have the learner's newest version
            return manifest.version
        buckets = await self._buckets(manifest)
        if buckets is None:
            return None
        await client.load_packed(manifest, buckets)
        self.stale = False
        log.info("loaded weights v%d (%s, %.2f MB)", manifest.version, manifest.kind,
                 manifest.total_bytes / 1e6)
        return None

    async def _next_manifest(self, request_id: int) -> m.WeightManifest | None:
        """The next manifest answering request `request_id` (None: none within
        peer_timeout_s); anything else is skipped whole."""
        while True:
            if not await self.sock.poll(self.timeout_ms):
                return None
            frames = await self.sock.recv_multipart()
            msg = self.dec.weights.decode(frames[0])
            if isinstance(msg, m.WeightManifest) and msg.request_id == request_id:
                return msg

    async def _buckets(self, manifest: m.WeightManifest) -> list | None:
        """The manifest's buckets, or None if they do not come in time or in order."""
        buckets = []
        for i in range(manifest.num_buckets):
            if not await self.sock.poll(self.timeout_ms):
                return None
            header_raw, data = await self.sock.recv_multipart(copy=False)
            header = self.dec.weights.decode(header_raw.bytes)
            if not (isinstance(header, m.WeightBucket) and header.index == i
                    and header.version == manifest.version):
                return None  # not this reply's next bucket: ask again
            buckets.append(data.buffer)
        return buckets


def _packed_file(manifest: m.WeightManifest) -> tuple[m.WeightManifest, list]:
    """A LoRA adapter written to shared storage, as the manifest + buckets of one bucket."""
    from safetensors.torch import load_file

    from transport.weights import pack

    packed = pack(load_file(manifest.path), manifest.version, 2**62, kind=manifest.kind,
                  lora=manifest.lora)
    return packed.manifest, list(packed.buckets)
