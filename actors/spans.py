"""Where an actor's time goes: its work loop's states and weight pulls as spans, sent to the
learner on heartbeats (learner/obs/timeline.py turns them into metrics and the trace)."""

from __future__ import annotations

import collections
import contextlib
import time

from transport import messages as m


class SpanLog:
    """This actor's time spans since its last heartbeat (learner/obs/timeline.py); the oldest go
    first past transport.messages.MAX_SPANS."""

    def __init__(self) -> None:
        self.spans: collections.deque[m.Span] = collections.deque(maxlen=m.MAX_SPANS)

    @contextlib.contextmanager
    def span(self, state: str):
        t0 = time.time()
        yield
        self.spans.append(m.Span(state=state, start_us=int(t0 * 1e6),
                                 dur_us=int((time.time() - t0) * 1e6)))

    def drain(self) -> list[m.Span]:
        out = list(self.spans)
        self.spans.clear()
        return out
