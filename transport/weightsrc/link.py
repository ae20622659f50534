"""One DEALER to a weights server (the learner or a relay) shared by concurrent requests.

A reader task takes every reply off the socket and hands it to the request waiting for its
`request_id`; a reply nobody waits for (its request timed out, or was sent before a learner
restart and answered by the next run) is dropped, bytes and all. Requests never block on each
other: a window of bucket requests is simply that many `ask`s in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import msgspec
import zmq
import zmq.asyncio

from transport import messages as m

log = logging.getLogger(__name__)


class PeerLink:
    def __init__(self, sock: zmq.asyncio.Socket, endpoint: str, timeout_s: float) -> None:
        """`sock`: a connected DEALER (RCVHWM 0: buckets are never dropped on receive)."""
        self.sock = sock
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future] = {}
        self.dec = m.Decoders()
        self.enc = m.encoder()
        self.skipped = 0
        """Replies that answered no waiting request (late, or to an earlier learner run)."""
        self._reader: asyncio.Task | None = None

    def next_id(self) -> int:
        return next(self.ids)

    async def ask(self, msg, request_id: int,
                  timeout_s: float | None = None) -> tuple[object, zmq.Frame | None]:
        """Send `msg` (whose request_id is `request_id`) and wait for its reply: (message,
        the bytes frame that followed it or None). Raises TimeoutError after `timeout_s`
        (default: the link's)."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        fut = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = fut
        try:
            await self.sock.send(self.enc.encode(msg))
            return await asyncio.wait_for(fut, timeout_s or self.timeout_s)
        finally:
            self.waiting.pop(request_id, None)

    async def _read(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = self.dec.weights.decode(frames[0].buffer)
            except msgspec.DecodeError as e:  # ValidationError included
                log.warning("undecodable reply from %s dropped: %s", self.endpoint, e)
                continue
            if isinstance(msg, m.Reject):
                log.warning("%s refused a weights request: %s", self.endpoint, msg.reason)
                continue
            fut = self.waiting.get(msg.request_id)
            if fut is None or fut.done():
                self.skipped += 1
                continue
            fut.set_result((msg, frames[1] if len(frames) > 1 else None))

    def close(self, socket_too: bool = True) -> None:
        """Stop reading; close the socket too unless someone else owns it."""
        if self._reader is not None:
            self._reader.cancel()
        if socket_too:
            self.sock.close(linger=0)
