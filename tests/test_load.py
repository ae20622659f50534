"""64 simulated actors (real protocol, fake engine) at full speed: bounded memory, exact accounting."""

from __future__ import annotations

import json
import subprocess
import sys

import procs


def test_64_simulated_actors_bounded_memory_exact_accounting(tmp_path):
    out = tmp_path / "load"
    r = subprocess.run([sys.executable, "lab/load_test.py", "--actors", "64", "--seconds", "12",
                        "--min-steps", "25",
                        "--out", str(out), f"model.path={tmp_path / 'model'}", "model.warmstart_steps=0"],
                       cwd=procs.ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((out / "load.json").read_text())
    assert rep["accounting_ok"] and rep["actor_exit_codes"] == [0]
    assert rep["steps"] >= 25 and rep["rejected_messages"] == {}  # traffic, whatever the speed
    first, last, peak = rep["learner_rss_mb_first_last_max"]
    assert peak - first < 100, rep["memory_samples"]  # no growth with traffic: queues are bounded
    g = rep["groups"]
    assert g["granted"] == g["consumed"] + sum(g["dropped"].values()) + g["outstanding"] + g["in_buffer"]
