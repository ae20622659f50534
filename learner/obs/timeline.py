"""Where the wall time goes: the learner's phases per step, the actors' states, and a
Chrome/Perfetto trace of a few steps across every process.

Learner (rank 0): each stretch of the train loop is one exclusive phase,

    wait_buffer          blocked in buffer.take (the learner's idle time)
    prox                 step-start no-grad passes: pi_prox, the reference, the critic's values
    forward              pi_theta's forward and the loss
    backward_optimizer   backend.step: backward, gradient sum over ranks, clipping, AdamW
    gather               the new version's full tensors packed into buckets (gather_weights)
    announce             the version announced to actors (weights handed to the server thread)
    checkpoint           a checkpoint (after the row is written: counted in the next step's)

Each metrics row has `time_frac_<phase>` = the phase's seconds / the step's wall time (from the
end of the previous step), `time_frac_other` for the rest (they sum to 1), and `idle_ratio` =
`time_frac_wait_buffer`.

Actors: their work loop is in one state at a time (actors/spans.py `SpanLog`): wait_grant
(asking for leases), wait_weights (a lease needs a newer version), generate, send (the learner's
backpressure). Weight pulls (pull_weights) run beside them. The spans ride on heartbeats; each row
has `actor_frac_<state>` over the spans of all actors that arrived since the previous row (the
work-loop states sum to 1; a row without new spans repeats the last values),
`actor_idle_ratio` = 1 - actor_frac_generate, and `actor_frac_pull_weights` (same denominator).

Scorers (the fleet of task.scorers' model scorers): each heartbeat says how many samples the
scorer scored and how long it was busy since the previous one; each row has
`scorer_samples_per_s` (samples scored by all scorers per second of the row's wall time) and
`scorer_busy_frac` (busy time / (wall time x scorers heard from)), both repeated while no
heartbeat arrives, like the actors' fractions.

Trace: with `learner.trace_steps` > 0, the spans of steps trace_from_step .. + trace_steps
(learner phases and every actor's spans in that wall-time window) are written to
run_dir/trace.json (open in https://ui.perfetto.dev or chrome://tracing). Timestamps are each
host's wall clock (time.time): on several hosts the rows are as aligned as their clocks.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

from transport.messages import SPAN_STATES, Span

LEARNER_PHASES = ("wait_buffer", "prox", "forward", "backward_optimizer", "gather", "announce",
                  "checkpoint")


class Timeline:
    def __init__(self, version: int = 0, trace_from_step: int = 0, trace_steps: int = 0) -> None:
        """Starting at policy `version`; trace the steps that make versions trace_from_step + 1
        .. trace_from_step + trace_steps (none if trace_steps is 0)."""
        self.window = range(trace_from_step + 1, trace_from_step + 1 + trace_steps)
        self.step_start = time.time()
        self.phases: dict[str, float] = {}
        """Seconds per phase in the current step."""
        self.lo = self.step_start if version + 1 in self.window else None
        """Wall time the first traced step began (None: not yet)."""
        self.hi: float | None = None
        """Wall time the last traced step ended (None: not yet)."""
        self.events: list[dict] = []
        """Trace events of the learner's traced steps (Chrome trace format)."""
        self._lock = threading.Lock()  # actor spans arrive on the server's thread
        self._actor_totals: dict[str, float] = {}
        self._actor_spans: list[tuple[str, Span]] = []
        self._actor_last: dict[str, float] = {}
        """The actors' fractions of the last row that had new spans (repeated until more come)."""
        self._scored = 0
        self._scorer_busy_s = 0.0
        self._scorers_heard: set[str] = set()
        self._scorer_last: dict[str, float] = {}

    @contextlib.contextmanager
    def span(self, phase: str):
        t0 = time.time()
        yield
        t1 = time.time()
        self.phases[phase] = self.phases.get(phase, 0.0) + (t1 - t0)
        if self.lo is not None and self.hi is None:
            self.events.append(_event(0, 0, phase, t0, t1 - t0))

    def end_step(self, version: int) -> dict[str, float]:
        """Close the step that made `version`: its phase fractions, and the actors' since the
        previous call."""
        now = time.time()
        wall = max(now - self.step_start, 1e-9)
        out = {f"time_frac_{p}": self.phases.get(p, 0.0) / wall for p in LEARNER_PHASES}
        out["time_frac_other"] = max(0.0, 1.0 - sum(out.values()))
        out["idle_ratio"] = out["time_frac_wait_buffer"]
        out.update(self._actor_fractions())
        out.update(self._scorer_rates(wall))
        if self.window and version + 1 == self.window.start:
            self.lo = now
        if self.window and version + 1 == self.window.stop:
            self.hi = now
        self.phases = {}
        self.step_start = now
        return out

    def actor_spans(self, actor_id: str, spans: list[Span]) -> None:
        """From the server's thread: the spans an actor sent with a heartbeat."""
        with self._lock:
            for s in spans:
                self._actor_totals[s.state] = self._actor_totals.get(s.state, 0.0) + s.dur_us / 1e6
                if self.lo is not None and s.start_us >= self.lo * 1e6 and (
                        self.hi is None or s.start_us <= self.hi * 1e6):
                    self._actor_spans.append((actor_id, s))

    def scorer_beat(self, scorer_id: str, scored: int, busy_us: int) -> None:
        """From the server's thread: a scorer's heartbeat (samples scored, busy microseconds)."""
        with self._lock:
            self._scored += scored
            self._scorer_busy_s += busy_us / 1e6
            self._scorers_heard.add(scorer_id)

    def _scorer_rates(self, wall: float) -> dict[str, float]:
        with self._lock:
            scored, busy, heard = self._scored, self._scorer_busy_s, len(self._scorers_heard)
            self._scored, self._scorer_busy_s, self._scorers_heard = 0, 0.0, set()
        if heard:
            self._scorer_last = {"scorer_samples_per_s": scored / wall,
                                 "scorer_busy_frac": min(1.0, busy / (wall * heard))}
        return self._scorer_last

    def _actor_fractions(self) -> dict[str, float]:
        with self._lock:
            totals, self._actor_totals = self._actor_totals, {}
        work = sum(v for k, v in totals.items() if k != "pull_weights")
        if work > 0:
            out = {f"actor_frac_{s}": totals.get(s, 0.0) / work for s in SPAN_STATES}
            out["actor_idle_ratio"] = 1.0 - out["actor_frac_generate"]
            self._actor_last = out
        return self._actor_last

    def write_trace(self, path: Path) -> bool:
        """run_dir/trace.json of the traced steps; False (nothing written) if none began."""
        if self.lo is None:
            return False
        with self._lock:
            spans = list(self._actor_spans)
        actors = sorted({a for a, _ in spans})
        meta = [_name("process_name", 0, None, "learner"), _name("thread_name", 0, 0, "train loop")]
        events = list(self.events)
        for pid, actor_id in enumerate(actors, start=1):
            meta += [_name("process_name", pid, None, f"actor {actor_id}"),
                     _name("thread_name", pid, 0, "work loop"),
                     _name("thread_name", pid, 1, "weight pulls")]
        for actor_id, s in spans:
            events.append(_event(actors.index(actor_id) + 1, int(s.state == "pull_weights"),
                                 s.state, s.start_us / 1e6, s.dur_us / 1e6))
        hi = self.hi if self.hi is not None else time.time()
        window = [round(self.lo * 1e6), round(hi * 1e6)]
        path.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms",
                                    "otherData": {"window_us": window}}))
        return True


def _event(pid: int, tid: int, name: str, start_s: float, dur_s: float) -> dict:
    """One complete event ("ph": "X"), microseconds."""
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": round(start_s * 1e6),
            "dur": round(dur_s * 1e6)}


def _name(kind: str, pid: int, tid: int | None, name: str) -> dict:
    """A metadata event naming a process or a thread."""
    e = {"name": kind, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e
