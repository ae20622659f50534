"""learner/obs/timeline.py: per-step fractions, the traced window, and the spans heartbeats carry."""

from __future__ import annotations

import json
import time

import pytest

from learner.server import _bad_spans
from learner.obs.timeline import LEARNER_PHASES, Timeline
from transport import messages as m


def _span(state: str, start_s: float, dur_s: float) -> m.Span:
    return m.Span(state=state, start_us=int(start_s * 1e6), dur_us=int(dur_s * 1e6))


def test_fractions_sum_to_one_and_idle_is_the_wait():
    tl = Timeline()
    with tl.span("wait_buffer"):
        pass
    with tl.span("forward"):
        sum(range(100_000))
    row = tl.end_step(1)
    parts = [row[f"time_frac_{p}"] for p in LEARNER_PHASES] + [row["time_frac_other"]]
    assert min(parts) >= 0 and sum(parts) == pytest.approx(1.0)
    assert row["idle_ratio"] == row["time_frac_wait_buffer"]
    assert row["time_frac_forward"] > 0
    assert tl.phases == {}  # the next step starts from nothing


def test_actor_fractions_over_the_spans_since_the_last_row():
    tl = Timeline()
    now = time.time()
    tl.actor_spans("a", [_span("wait_grant", now, 1.0), _span("generate", now + 1, 3.0),
                         _span("pull_weights", now + 1.5, 0.5)])
    row = tl.end_step(1)
    assert row["actor_frac_wait_grant"] == pytest.approx(0.25)
    assert row["actor_frac_generate"] == pytest.approx(0.75)
    assert row["actor_frac_pull_weights"] == pytest.approx(0.125)  # beside the work loop
    assert row["actor_idle_ratio"] == pytest.approx(0.25)
    assert tl.end_step(2)["actor_frac_generate"] == pytest.approx(0.75)  # no news: repeated
    tl.actor_spans("b", [_span("send", now + 5, 1.0)])
    assert tl.end_step(3)["actor_frac_send"] == pytest.approx(1.0)


def test_trace_holds_only_the_window(tmp_path):
    tl = Timeline(version=0, trace_from_step=1, trace_steps=2)  # the steps making v2 and v3
    with tl.span("forward"):
        pass
    tl.actor_spans("a", [_span("generate", time.time(), 0.01)])  # before the window: dropped
    tl.end_step(1)
    for v in (2, 3):
        with tl.span("forward"):
            pass
        tl.actor_spans("a", [_span("generate", time.time(), 0.01)])
        tl.end_step(v)
    with tl.span("forward"):
        pass
    tl.actor_spans("a", [_span("generate", time.time() + 1, 0.01)])  # after: dropped
    tl.end_step(4)
    assert tl.write_trace(tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"]) for e in spans] == [(0, "forward")] * 2 + [(1, "generate")] * 2
    lo, hi = trace["otherData"]["window_us"]
    assert all(lo <= e["ts"] <= hi for e in spans)


def test_no_trace_unless_asked(tmp_path):
    tl = Timeline()
    tl.end_step(1)
    assert not tl.write_trace(tmp_path / "trace.json")
    assert not (tmp_path / "trace.json").exists()


def test_heartbeat_spans_round_trip_and_bad_ones_are_named():
    hb = m.Heartbeat(actor_id="a", weight_version=3, spans=[_span("generate", 1.0, 0.5)])
    back = m.Decoders().from_actor.decode(m.encoder().encode(hb))
    assert back == hb
    assert _bad_spans(hb.spans) == ""
    assert "state one of" in _bad_spans([m.Span(state="napping", start_us=0, dur_us=1)])
    assert "state one of" in _bad_spans([m.Span(state="generate", start_us=0, dur_us=-1)])
    too_many = [m.Span(state="send", start_us=0, dur_us=0)] * (m.MAX_SPANS + 1)
    assert f"at most {m.MAX_SPANS}" in _bad_spans(too_many)
