"""Where actors fetch a published version's weights (`transport.weights_via`): the one module
that knows every weight source.

    zmq          the version's byte buckets travel over the weights socket (transport/weights.py)
    filesystem   the version is a safetensors file in a directory every actor sees at the same
                 path (kept for max_staleness + 3 versions, so a slow actor still finds the one
                 it was told about); the socket carries only the notice naming the file

The actor side needs no choice: a notice with a `path` is read from that file
(actors/weight_pull.py). A new source is a function here and its name in the config's choice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import msgspec

from configs.schema import TetherConfig
from transport.weights import PackedWeights, unpack, write_file


def _zmq(cfg: TetherConfig, packed: PackedWeights) -> PackedWeights:
    return packed


def _filesystem(cfg: TetherConfig, packed: PackedWeights) -> PackedWeights:
    """A LoRA version's file holds its adapter (the base goes over ZeroMQ, once per actor), and
    the notice keeps the manifest's kind and LoRA spec."""
    directory = Path(cfg.transport.weights_dir or Path(cfg.run_dir) / "weights")
    state = unpack(packed.manifest, list(packed.buckets))
    out = write_file(state, packed.manifest.version, directory, keep=cfg.max_staleness + 3)
    notice = msgspec.structs.replace(out.manifest, kind=packed.manifest.kind,
                                     lora=packed.manifest.lora)
    return PackedWeights(manifest=notice, buckets=())


SOURCES: dict[str, Callable[[TetherConfig, PackedWeights], PackedWeights]] = {
    "zmq": _zmq, "filesystem": _filesystem,
}
"""`transport.weights_via` -> what a published version becomes on its way to the actors."""


def for_actors(cfg: TetherConfig, packed: PackedWeights) -> PackedWeights:
    """Version `packed` as actors will fetch it, through the source `transport.weights_via`
    names: the byte buckets themselves, or a notice of a file on shared storage."""
    return SOURCES[cfg.transport.weights_via](cfg, packed)
