"""A run directory holds one run: a new run into it stops with one line, and resume takes only
that run's checkpoints (each checkpoint and summary.json carry the run's id)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import procs
from conftest import ROOT


def _learner_cli(run, model, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "learner", "-c", str(procs.PRESET),
                           f"run_dir={run}", f"model.path={model}", "learner.max_steps=2",
                           "actors.num_local=1", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_new_run_into_a_directory_that_holds_a_run_stops_with_one_line(tmp_path, tiny_model_dir):
    """It used to truncate metrics.jsonl and overwrite summary.json and the final model."""
    run = tmp_path / "run"
    first, _ = procs.run_inproc(run, tiny_model_dir, "learner.max_steps=2")
    rows = (run / "metrics.jsonl").read_text()
    r = _learner_cli(run, tiny_model_dir)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip() == (
        f"tether-learner: run_dir {run} holds a run ({first['run_id']}: metrics.jsonl, "
        "summary.json, checkpoints/step_2, final_model): continue it with learner.resume=true, "
        "or give a new run_dir, or replace it with learner.overwrite=true"), r.stderr[-3000:]
    assert (run / "metrics.jsonl").read_text() == rows and procs.summary(run) == first
    assert json.loads((run / "checkpoints" / "step_2" / "state.json").read_text())["run_id"] \
        == first["run_id"]


def test_overwrite_replaces_the_run_and_resume_refuses_another_runs_checkpoint(tmp_path,
                                                                              tiny_model_dir):
    a, b = tmp_path / "a", tmp_path / "b"
    sa, _ = procs.run_inproc(a, tiny_model_dir, "learner.max_steps=2")
    sb, _ = procs.run_inproc(b, tiny_model_dir, "learner.max_steps=2")
    assert sa["run_id"] != sb["run_id"]
    # run a's checkpoint copied into b, newer than b's own: resume must not take it
    shutil.copytree(a / "checkpoints" / "step_2", b / "checkpoints" / "step_3")
    r = _learner_cli(b, tiny_model_dir, "learner.resume=true", "learner.max_steps=4")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip() == (
        f"tether-learner: learner.resume: {b}/checkpoints/step_3 belongs to run {sa['run_id']}, "
        f"but run_dir {b} holds run {sb['run_id']}"), r.stderr[-3000:]
    # learner.overwrite=true starts a new run there: the old one's files are gone
    s, _ = procs.run_inproc(a, tiny_model_dir, "learner.max_steps=1", "learner.overwrite=true")
    assert s["run_id"] != sa["run_id"] and s["steps"] == 1
    assert [r["step"] for r in procs.metrics(a)] == [1]
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["step_1"]


@pytest.mark.parametrize("files", [["config.yaml", "endpoints.json"], []])
def test_a_directory_without_a_run_in_it_takes_a_new_run(tmp_path, files):
    """What a learner that failed at start-up leaves (its config, its endpoints) is no run."""
    from configs.loader import load_config
    from learner.run_dir import begin

    run = tmp_path / "run"
    run.mkdir()
    for name in files:
        (run / name).write_text("{}")
    cfg = load_config(procs.PRESET, [f"run_dir={run}"])
    run_id = begin(cfg)
    assert json.loads((run / "run.json").read_text())["run_id"] == run_id
