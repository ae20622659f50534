"""Weight sources by `transport.weights_via`: the one place that maps a kind to its class."""

from __future__ import annotations

from transport.weightsrc.base import SourceContext, WeightSource


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


SOURCES = {"zmq": _zmq, "relay": _relay, "filesystem": _filesystem, "nccl": _nccl}
"""Kind -> a function returning the source class (imported only when chosen)."""


def make_source(kind: str, ctx: SourceContext) -> WeightSource:
    if kind not in SOURCES:
        raise ValueError(f"transport.weights_via must be one of {tuple(SOURCES)}, got {kind!r}")
    return SOURCES[kind]()(ctx)
