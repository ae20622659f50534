"""What the connection to the learner's address shows while an actor joins, from the control
socket's ZeroMQ monitor: so that an actor that cannot join says why, and stops where waiting
would not help.

    connection refused, again and again       NOTHING_LISTENS   keep saying Hello (the learner
                                                                may start later) until
                                                                actors.join_timeout_s: exit 4
    TCP connected, no ZeroMQ handshake within NOT_ZEROMQ        exit 3 (another service, e.g.
    transport.peer_timeout_s                                    HTTP, listens there)
    handshake failed, CURVE on                CURVE_KEY         exit 5 (the learner's public key
                                                                is not the one configured)
    CURVE handshake refused by the learner    CURVE_REFUSED     exit 5 (this actor's public key is
                                                                not in its curve_allowed_dir)
    handshake failed, CURVE off               CURVE_NEEDED      exit 5 (the learner uses CURVE)
    handshake done, no Welcome yet            SILENT            keep saying Hello
    nothing yet                               WAITING           keep saying Hello

Exit codes (the actor's): 0 stopped or the run ended, 2 bad config, 3 refused by the learner or
not a Tether learner, 4 actors.join_timeout_s passed, 5 CURVE handshake failed.
"""

from __future__ import annotations

import enum
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

EXIT_NOT_TETHER = 3
EXIT_JOIN_TIMEOUT = 4
EXIT_CURVE = 5


class JoinState(enum.Enum):
    WAITING = "waiting"
    NOTHING_LISTENS = "nothing_listens"
    NOT_ZEROMQ = "not_zeromq"
    CURVE_KEY = "curve_key"
    CURVE_REFUSED = "curve_refused"
    CURVE_NEEDED = "curve_needed"
    SILENT = "silent"


FATAL = {JoinState.NOT_ZEROMQ: EXIT_NOT_TETHER, JoinState.CURVE_KEY: EXIT_CURVE,
         JoinState.CURVE_REFUSED: EXIT_CURVE, JoinState.CURVE_NEEDED: EXIT_CURVE}
"""The states where saying Hello again cannot help, and the actor's exit code in each."""

_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
           zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class JoinWatch:
    """Reads the monitor of the actor's control socket (made before it connects) while the
    actor joins; `state()` says what the connection shows, `message()` says it in one line."""

    def __init__(self, sock: zmq.asyncio.Socket, endpoint: str, handshake_s: float,
                 curve_server_public: str = "") -> None:
        self.monitor = sock.get_monitor_socket()
        self.sock = sock
        self.endpoint = endpoint
        self.handshake_s = handshake_s
        self.curve_server_public = curve_server_public
        self.refused = 0
        self.connected_at: float | None = None
        """When TCP connected and no handshake has completed or failed since."""
        self.handshaken = False
        self.failed: int | None = None
        """The event of a failed handshake, if one failed."""

    async def read(self) -> None:
        """Take every monitor event queued (never waits)."""
        while True:
            try:
                frames = await self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_CONNECT_RETRIED:
                self.refused += 1
            elif event == zmq.EVENT_CONNECTED:
                self.connected_at = time.monotonic()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshaken, self.connected_at = True, None
            elif event in _FAILED:
                self.failed, self.connected_at = event, None

    def state(self) -> JoinState:
        if self.failed == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return JoinState.CURVE_REFUSED
        if self.failed is not None:
            return JoinState.CURVE_KEY if self.curve_server_public else JoinState.CURVE_NEEDED
        if self.connected_at is not None and not self.handshaken and \
                time.monotonic() - self.connected_at > self.handshake_s:
            return JoinState.NOT_ZEROMQ
        if self.handshaken:
            return JoinState.SILENT
        if self.refused:
            return JoinState.NOTHING_LISTENS
        return JoinState.WAITING

    def message(self, state: JoinState) -> str:
        at = self.endpoint
        match state:
            case JoinState.NOTHING_LISTENS:
                return (f"nothing listens at {at} (connection refused): is the learner up, and "
                        "is the address right?")
            case JoinState.NOT_ZEROMQ:
                return (f"{at} is not a Tether learner: it accepted the connection but did not "
                        f"complete the ZeroMQ handshake within {self.handshake_s:g}s (another "
                        "kind of service, e.g. HTTP, listens there)")
            case JoinState.CURVE_KEY:
                return ("the learner did not answer the CURVE handshake: check its public key "
                        f"(transport.curve_server_public={self.curve_server_public})")
            case JoinState.CURVE_REFUSED:
                return ("the learner refused this actor's CURVE key: put its public key file in "
                        "the learner's transport.curve_allowed_dir")
            case JoinState.CURVE_NEEDED:
                return (f"the ZeroMQ handshake with {at} failed: the learner there uses CURVE; "
                        "set transport.curve_client_secret and transport.curve_server_public")
            case JoinState.SILENT:
                return f"the learner at {at} has not answered Hello yet"
        return f"no answer from the learner at {at} yet (connecting)"

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
