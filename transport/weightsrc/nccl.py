"""The GPU path (`transport.weights_via: nccl`): each version is broadcast by NCCL from the
learner (rank 0) into the engines' GPU memory, with vLLM's weight-transfer engine on the
receiving side. Not fault tolerant by nature: a broadcast is a collective over a fixed group
(the learner and `transport.nccl_engines` vLLM engines, each on a GPU of its own), so ZeroMQ and
relays stay the default for actors that come and go.

    actor (NcclSource.pull)                       learner I/O thread (WeightsService)
    WeightRequest(have) ────────────────────────▶ park it; once every engine's request is parked:
    ◀── WeightOffer(manifest codec "nccl",          offer the newest version to all of them and
        NcclPlan: group address, rank) ──────────── hand it to the broadcaster thread
    engine: join the group (first time), pause,   broadcaster: join the group (first time), put
    receive the tensors in manifest order,          the version's tensors on the GPU one at a time,
    resume on the new version                       broadcast them (vLLM's packed producer)

The version's tensors travel in the learner's published layout (the engine dtype); the
manifest lists names, dtypes and shapes in broadcast order. There are no digests on this path:
NCCL runs over the cluster's own fabric, not through relays. Needs CUDA, vLLM, and one GPU per
process (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading

import msgspec
import torch

from transport import messages as m
from transport.weights import PackedWeights, unpack
from transport.weightsrc.base import WeightSink
from transport.weightsrc.zmq_pull import ZmqSource


class BroadcastSink(WeightSink):
    """An engine client that can receive a broadcast (actors/engines/vllm/engine.py VLLMEngine)."""

    async def receive_broadcast(self, manifest: m.WeightManifest, plan: m.NcclPlan) -> None: ...

log = logging.getLogger(__name__)


def broadcast_manifest(full: m.WeightManifest) -> m.WeightManifest:
    """A published version's manifest as the NCCL path offers it: the tensors, no buckets."""
    return msgspec.structs.replace(full, key=f"n{full.version}", codec="nccl", num_buckets=0,
                                   digests=[], raw_digests=[], raw_sizes=[])


class NcclBroadcaster:
    """Learner side: the broadcast group's rank 0 and a thread that broadcasts each version
    handed to it (it blocks in NCCL until every engine receives)."""

    def __init__(self, address: str, engines: int, device: torch.device) -> None:
        with socket.socket() as s:  # a free port for the group's TCPStore rendezvous
            s.bind((address, 0))
            port = s.getsockname()[1]
        self.address, self.port, self.world = address, port, engines + 1
        self.device = device
        self._versions: queue.Queue[PackedWeights] = queue.Queue()
        self._group = None
        threading.Thread(target=self._run, name="learner-nccl", daemon=True).start()

    def plan(self, rank: int) -> m.NcclPlan:
        return m.NcclPlan(master_address=self.address, master_port=self.port,
                          world_size=self.world, rank_offset=rank)

    def broadcast(self, packed: PackedWeights) -> None:
        """Queue `packed` for broadcasting (never blocks)."""
        self._versions.put(packed)

    def _run(self) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        torch.cuda.set_device(self.device)
        while True:
            packed = self._versions.get()
            if self._group is None:  # blocks until every engine joined
                self._group = trainer_init({"master_address": self.address,
                                            "master_port": self.port, "world_size": self.world})
            tensors = unpack(packed.manifest, list(packed.buckets))
            packed_nccl_broadcast_producer(
                iterator=((k, t.to(self.device, non_blocking=True)) for k, t in tensors.items()),
                group=self._group, src=0, post_iter_func=lambda item: item[1])
            log.info("broadcast v%d to %d engine(s)", packed.manifest.version, self.world - 1)


class NcclSource(ZmqSource):
    """Actor side: the offer comes over ZeroMQ, the tensors by the learner's broadcast."""

    async def _load(self, sink: BroadcastSink, offer: m.WeightOffer) -> None:
        for man in offer.manifests:
            if man.codec != "nccl" or offer.nccl is None:
                raise ValueError(f"transport.weights_via=nccl got a {man.codec!r} manifest")
            await sink.receive_broadcast(man, offer.nccl)
            self.stale = False
            self.stats.versions += 1
            log.info("loaded weights v%d (%s, by NCCL broadcast)", man.version, man.kind)
