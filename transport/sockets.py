"""ZeroMQ socket set-up shared by the learner and the actors.

Every socket gets a high-water mark (so no queue grows without bound: a full PUSH blocks its
sender, a full ROUTER drops to that peer), LINGER 0 (closing never hangs on unsent data), and the
learner's receiving sockets get ZMQ_MAXMSGSIZE (a peer sending a larger frame is disconnected).

Two transports, one code path (`transport.kind`):

* `zmq`: TCP endpoints; learner and actors are separate processes, on any nodes.
* `inproc`: ZeroMQ's in-process transport. The learner runs its local actors as threads of its
  own process; every socket lives in the process-wide context (`context()`), endpoints are
  `inproc://tether-RUN-NAME`, and messages are the same bytes through the same sockets, just
  without TCP or process start-up. For debugging and for tests of protocol and accounting.
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from configs.schema import TransportConfig


def context(tcfg: TransportConfig) -> zmq.Context:
    """The learner's context: its own for `zmq`, the process-wide one for `inproc` (shared
    with the actor threads; never terminated while the process lives)."""
    return zmq.Context.instance() if tcfg.kind == "inproc" else zmq.Context()


def actor_context(tcfg: TransportConfig) -> zmq.asyncio.Context:
    """An actor's asyncio context: its own for `zmq`, a shadow of the process-wide one for
    `inproc` (inproc endpoints only connect within one libzmq context)."""
    if tcfg.kind == "inproc":
        return zmq.asyncio.Context.shadow(zmq.Context.instance().underlying)
    return zmq.asyncio.Context()


def close(ctx: zmq.Context, tcfg: TransportConfig, sockets) -> None:
    """Close `sockets`, and the context too when it is this role's own (`zmq`)."""
    for sock in sockets:
        sock.close(linger=0)
    if tcfg.kind != "inproc":
        ctx.destroy(linger=0)


def configure(sock: zmq.Socket, tcfg: TransportConfig, *, limit_size: bool) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, tcfg.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, tcfg.high_water_mark)
    if limit_size:
        sock.setsockopt(zmq.MAXMSGSIZE, tcfg.max_message_bytes)
    return sock


def bind(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind to host:port (port 0 = any free port) and return the port actually bound."""
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{host}")
    sock.bind(f"tcp://{host}:{port}")
    return port


def bind_inproc(sock: zmq.Socket, run_id: str, name: str) -> str:
    """Bind to this run's in-process endpoint `name`; returns the endpoint."""
    endpoint = f"inproc://tether-{run_id}-{name}"
    sock.bind(endpoint)
    return endpoint
