"""Weight sources by `transport.weights_via`: the one place that maps a kind to what it is on
each side. The actor side is a WeightSource class (imported only when chosen); the learner side
says what a published version becomes on its way to the actors (its buckets as they are, or a
safetensors file on shared storage whose notice the offer carries)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from configs.schema import TetherConfig
from transport.weightsrc.base import SourceContext, WeightSource
from transport.weightsrc.store import Published


def _zmq():
    from transport.weightsrc.zmq_pull import ZmqSource
    return ZmqSource


def _relay():
    from transport.weightsrc.zmq_pull import RelaySource
    return RelaySource


def _filesystem():
    from transport.weightsrc.zmq_pull import FilesystemSource
    return FilesystemSource


def _nccl():
    from transport.weightsrc.nccl import NcclSource
    return NcclSource


def _as_is(cfg: TetherConfig, pub: Published) -> Published:
    return pub


def _to_file(cfg: TetherConfig, pub: Published) -> Published:
    """The version as a file in transport.weights_dir, kept for max_staleness + 3 versions (a
    slow actor still finds the one it was told about). A LoRA version's file holds its adapter
    (the base goes over ZeroMQ, once per actor); the notice keeps the manifest's kind and LoRA
    spec. Runs in the learner's packer thread."""
    import msgspec

    from transport.weights import PackedWeights, unpack, write_file

    packed = pub.full
    directory = Path(cfg.transport.weights_dir or Path(cfg.run_dir) / "weights")
    state = unpack(packed.manifest, list(packed.buckets))
    out = write_file(state, packed.manifest.version, directory, keep=cfg.max_staleness + 3)
    notice = msgspec.structs.replace(out.manifest, kind=packed.manifest.kind,
                                     lora=packed.manifest.lora)
    return Published(full=PackedWeights(manifest=notice, buckets=()))


@dataclass(frozen=True)
class SourceKind:
    source: Callable[[], type]
    """The actor side: returns the WeightSource class."""
    publish: Callable[[TetherConfig, Published], Published]
    """The learner side: what a published version becomes on its way to the actors."""
    rank_shards: bool = False
    """Peers fetch buckets from the learner: with several learner ranks each serves its own
    (transport/weightsrc/shards.py); the others need whole versions on rank 0."""


SOURCES = {"zmq": SourceKind(_zmq, _as_is, True), "relay": SourceKind(_relay, _as_is, True),
           "filesystem": SourceKind(_filesystem, _to_file), "nccl": SourceKind(_nccl, _as_is)}
"""`transport.weights_via` -> its kind."""


def make_source(kind: str, ctx: SourceContext) -> WeightSource:
    if kind not in SOURCES:
        raise ValueError(f"transport.weights_via must be one of {tuple(SOURCES)}, got {kind!r}")
    return SOURCES[kind].source()(ctx)


def ranks_serve_shards(cfg: TetherConfig, lora: bool, world: int) -> bool:
    """Do the learner's `world` ranks each serve their own buckets of every version? Several
    ranks, full weights (LoRA adapters are small, its base goes once), a source that fetches
    buckets from the learner."""
    return world > 1 and not lora and SOURCES[cfg.transport.weights_via].rank_shards


def for_actors(cfg: TetherConfig, pub: Published) -> Published:
    """Version `pub` as actors will fetch it, through the source `transport.weights_via` names."""
    return SOURCES[cfg.transport.weights_via].publish(cfg, pub)
