"""ZeroMQ socket set-up shared by the learner and the actors.

Every socket gets a high-water mark (so no queue grows without bound: a full PUSH blocks its
sender, a full ROUTER drops to that peer), LINGER 0 (closing never hangs on unsent data), and the
learner's receiving sockets get ZMQ_MAXMSGSIZE (a peer sending a larger frame is disconnected).
"""

from __future__ import annotations

import zmq

from configs.schema import TransportConfig


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
