"""A named fake for tests/test_security.py: the real actor (`python -m actors`), whose first
Hello is built only once its control socket can no longer queue one, the state a failed CURVE
handshake leaves (libzmq drops the connection's pipe and does not reconnect). On a loaded
machine the first Hello can come that late; the actor must still say why it cannot join and
exit 5 (a blocking send hung it instead)."""

from __future__ import annotations

import sys
import time

import zmq

from actors import actor as actor_mod
from actors.__main__ import main
from configs.loader import exit_now

hello = actor_mod.Actor._hello


def late_hello(self) -> bytes:
    sock = zmq.Socket.shadow(self.control.underlying)
    deadline = time.monotonic() + 30
    while sock.poll(0, zmq.POLLOUT) and time.monotonic() < deadline:
        time.sleep(0.02)  # polls a condition: libzmq has no event for "cannot queue"
    actor_mod.Actor._hello = hello
    return hello(self)


actor_mod.Actor._hello = late_hello

if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
