"""The GPU path (`transport.weights_via: nccl`): each version is broadcast from the learner
(rank 0) into the engines' memory by a collective, received by the engine's own API: vLLM's
weight-transfer engine (packed tensors over NCCL) or SGLang's update_weights_from_distributed
(one torch.distributed broadcast per tensor; NCCL on GPUs, gloo where the learner runs on CPU,
which is how the CPU test lane runs this path). Not fault tolerant by nature: a broadcast is
a collective over a fixed group (the learner and `transport.nccl_engines` engines, each on a
GPU of its own), so ZeroMQ and relays stay the default for actors that come and go.

    actor (NcclSource.pull)                       learner I/O thread (WeightsService)
    WeightRequest(have) ────────────────────────▶ park it; once every engine's request is parked:
    ◀── WeightOffer(manifest codec "nccl",          offer the newest version to all of them and
        NcclPlan: group address, rank, backend) ─── hand it to the broadcaster thread
    engine: join the group (first time), pause,   broadcaster: join the group (first time), put
    receive the tensors in manifest order,          the version's tensors on the device one at a
    resume on the new version                       time, broadcast them (PRODUCERS, by engine)

The version's tensors travel in the learner's published layout (the engine dtype); the
manifest lists names, dtypes and shapes in broadcast order. There are no digests on this path:
the collective runs over the cluster's own fabric, not through relays. NCCL needs one GPU per
process (it refuses two ranks on one device).
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
    """An engine client that can receive a broadcast (actors/engines/vllm/engine.py VLLMEngine,
    actors/engines/sglang/engine.py SGLangEngine)."""

    async def receive_broadcast(self, manifest: m.WeightManifest, plan: m.NcclPlan) -> None: ...

log = logging.getLogger(__name__)


def broadcast_manifest(full: m.WeightManifest) -> m.WeightManifest:
    """A published version's manifest as the NCCL path offers it: the tensors, no buckets."""
    return msgspec.structs.replace(full, key=f"n{full.version}", codec="nccl", num_buckets=0,
                                   digests=[], raw_digests=[], raw_sizes=[])


GROUP = "tether-weights"
"""The broadcast group's name (a prefix of its rendezvous keys; SGLang's group_name)."""


class _VllmProducer:
    """vLLM's weight-transfer engine: a StatelessProcessGroup + PyNccl, tensors packed."""

    backends = ("nccl",)

    def __init__(self, address: str, port: int, world: int, backend: str) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({"master_address": address, "master_port": port,
                                   "world_size": world})

    def send(self, tensors) -> None:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(iterator=tensors, group=self.group, src=0,
                                       post_iter_func=lambda item: item[1])


class _TorchProducer:
    """A torch.distributed group of its own (not the learner's FSDP2 world), made the way
    SGLang's init_weights_update_group makes the engines' side: TCP rendezvous at the
    learner's address, a store prefixed with GROUP; one broadcast per tensor, in order."""

    backends = ("nccl", "gloo")

    def __init__(self, address: str, port: int, world: int, backend: str) -> None:
        from torch.distributed import distributed_c10d as c10d

        timeout = c10d.default_pg_timeout
        store, _, _ = next(c10d.rendezvous(f"tcp://{address}:{port}", 0, world,
                                           timeout=timeout))
        store.set_timeout(timeout)
        self.group, _ = c10d._new_process_group_helper(
            world, 0, [], c10d.Backend(backend), c10d.PrefixStore(GROUP, store),
            group_name=GROUP, timeout=timeout)
        c10d._world.pg_group_ranks[self.group] = {i: i for i in range(world)}

    def send(self, tensors) -> None:
        for _, t in tensors:
            torch.distributed.broadcast(t, src=0, group=self.group)


PRODUCERS = {"vllm": _VllmProducer, "torch": _TorchProducer}
"""The learner's side of each engine kind's receiver (configs/engines.py weight_broadcast)."""


class NcclBroadcaster:
    """Learner side: the broadcast group's rank 0 and a thread that broadcasts each version
    handed to it (it blocks in the collective until every engine receives)."""

    def __init__(self, address: str, engines: int, device: torch.device, protocol: str,
                 ranks_per_engine: int = 1) -> None:
        """`protocol`: a key of PRODUCERS (the engines' weight_broadcast()).
        `ranks_per_engine`: each engine's workers in the group (its tensor-parallel size,
        actors.engine.gpus()): engine i's workers are ranks 1 + (i - 1) * that, and up."""
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.producer = PRODUCERS[protocol]
        if self.backend not in self.producer.backends:
            raise ValueError(f"transport.weights_via=nccl: the engines' receiver ({protocol}) "
                             f"speaks {' or '.join(self.producer.backends)}, and a learner on "
                             f"{device.type} would broadcast by {self.backend}")
        with socket.socket() as s:  # a free port for the group's TCPStore rendezvous
            s.bind((address, 0))
            port = s.getsockname()[1]
        self.engines, self.ranks_per_engine = engines, ranks_per_engine
        self.address, self.port, self.world = address, port, 1 + engines * ranks_per_engine
        self.device = device
        self._versions: queue.Queue[PackedWeights] = queue.Queue()
        self._group = None
        threading.Thread(target=self._run, name="learner-nccl", daemon=True).start()

    def plan(self, engine: int) -> m.NcclPlan:
        """Engine `engine`'s (1, 2, ...) place in the group: its first worker's rank (each
        engine adds its worker's own rank to it)."""
        return m.NcclPlan(master_address=self.address, master_port=self.port,
                          world_size=self.world,
                          rank_offset=1 + (engine - 1) * self.ranks_per_engine,
                          backend=self.backend)

    def broadcast(self, packed: PackedWeights) -> None:
        """Queue `packed` for broadcasting (never blocks)."""
        self._versions.put(packed)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            packed = self._versions.get()
            if self._group is None:  # blocks until every engine joined
                self._group = self.producer(self.address, self.port, self.world, self.backend)
            tensors = unpack(packed.manifest, list(packed.buckets))
            self._group.send((k, t.to(self.device, non_blocking=True))
                             for k, t in tensors.items())
            log.info("broadcast v%d to %d engine(s)", packed.manifest.version, self.engines)


class NcclSource(ZmqSource):
    """Actor side: the offer comes over ZeroMQ, the tensors by the learner's broadcast."""

    async def _load(self, sink: BroadcastSink, offer: m.WeightOffer) -> None:
        for man in offer.manifests:
            if man.codec != "nccl" or offer.nccl is None:
                raise ValueError(f"transport.weights_via=nccl got a {man.codec!r} manifest")
            await sink.receive_broadcast(man, offer.nccl)
            self.stale = False
            self.stats.versions += 1
            log.info("loaded weights v%d (%s, by %s broadcast)", man.version, man.kind,
                     offer.nccl.backend)
