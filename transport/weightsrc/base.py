"""The weight-source seam: how an actor gets each new version into its engine.

A source is made once per actor (`registry.make_source`, by `transport.weights_via`) and
`pull`ed by the actor's weights loop whenever the learner announces a newer version; it loads
into a `WeightSink` (the actor's engine client) and reports the newest version when the actor
has it already. Every source checks what it loads against the learner's manifest digests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import zmq.asyncio

from configs.schema import TransportConfig


class WeightSink(Protocol):
    """What a source loads into: the actor's engine client (actors/engines/base.py LLMClient).

    A full version arrives whole (`load_packed`, `transport.weight_load: staged`) or bucket by
    bucket as each one's digest checks (`streamed`): `begin_load`, `load_bucket` for i = 0, 1,
    ... in order, `end_load`. From `begin_load` on the engine holds no whole version: it
    generates nothing and its `version` is -1 until an `end_load` (or a whole `load_packed` /
    `load_file`) completes a version. A stream that stops early (the source could not fetch a
    bucket) leaves the sink so, and the next load starts over with a whole version."""

    version: int

    async def load_packed(self, manifest, buckets: list) -> None: ...

    async def load_file(self, path: str, version: int) -> None: ...

    async def begin_load(self, manifest) -> None: ...

    async def load_bucket(self, manifest, index: int, bucket) -> None: ...

    async def end_load(self, manifest) -> None: ...


@dataclass
class SourceContext:
    """What every source gets from the actor."""

    actor_id: str
    learner: zmq.asyncio.Socket
    """A DEALER connected to the learner's weights endpoint (RCVHWM 0)."""
    learner_endpoint: str
    connect: Callable[[str], zmq.asyncio.Socket]
    """A new DEALER connected to an endpoint (CURVE and limits as the actor's own sockets)."""
    transport: TransportConfig
    host: str
    """This actor's node: relays on it are preferred."""


@dataclass
class PullStats:
    """Counters of one source, for the actor's status line and tests."""

    corrupt_buckets: int = 0
    """Buckets refused because their digest differed from the learner's (then fetched again)."""
    source_failures: int = 0
    """Bucket requests that timed out or were not found at a relay (then asked elsewhere)."""
    bytes_from: dict[str, int] = field(default_factory=dict)
    """Bucket bytes received, by endpoint."""
    versions: int = 0
    """Versions loaded."""
    broken_streams: int = 0
    """Streamed versions that stopped part-way (the engine then waits for a whole version)."""


class WeightSource(Protocol):
    stats: PullStats
    stale: bool
    """True after joining a different learner process: reload weights before generating."""

    def new_run(self) -> None:
        """A different learner process: neither the weights nor a LoRA base can be trusted."""

    async def pull(self, sink: WeightSink) -> int | None:
        """Load the learner's newest weights into `sink` (no-op if it has them). Returns the
        learner's newest version when the sink already has it, else None (loaded, or failed:
        the caller asks again)."""

    def close(self) -> None: ...
