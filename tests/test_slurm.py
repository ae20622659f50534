"""scripts/slurm/tether.sbatch against a real one-node Slurm (munged + slurmctld + slurmd
started here): a CPU toy run to the end, and a scancel that checkpoints before it stops."""

from __future__ import annotations

import json
import re
import sys

import pytest

import procs
from slurm_cluster import TERMINAL, Cluster, Unavailable, free_ports, until

SBATCH = procs.ROOT / "scripts" / "slurm" / "tether.sbatch"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        c = Cluster.start(tmp_path_factory.mktemp("slurm"))
    except Unavailable as e:
        pytest.skip(f"cannot start Slurm: {e}")
    try:
        yield c
    finally:
        c.stop()


def _submit(cluster, tmp_path, tiny_model_dir, *overrides: str, actors_per_node: int = 1):
    run = tmp_path / "run"
    job = cluster.submit(
        "--nodes=1", f"--output={tmp_path}/slurm-%j.out", f"--chdir={procs.ROOT}", str(SBATCH),
        str(procs.PRESET), f"run_dir={run}", f"model.path={tiny_model_dir}",
        "task.eval_prompts=16", "learner.log_every=1", "transport.heartbeat_s=0.25", *overrides,
        env={"TETHER_PYTHON": sys.executable, "TETHER_ACTORS_PER_NODE": str(actors_per_node),
             "TETHER_PORT": str(free_ports(3))})
    return run, job


def _job_output(tmp_path, job: str) -> str:
    out = tmp_path / f"slurm-{job}.out"
    return out.read_text() if out.exists() else f"(job {job} has written no output yet)"


def _until_steps(cluster, job: str, run, tmp_path, n: int, timeout: float) -> None:
    """Block until the run has logged `n` training steps; fail at once, with the job's record
    and output, if the job ends first (it did not wait the whole timeout for a dead job)."""
    metrics = run / "metrics.jsonl"

    def steps_or_end():
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return "steps"
        rec = cluster.job(job)
        return rec["JobState"] in TERMINAL and rec

    got = until(steps_or_end, timeout, f"{n} training steps in metrics.jsonl", interval=0.5,
                explain=lambda: f"{cluster.job(job)}\n{_job_output(tmp_path, job)[-3000:]}")
    assert got == "steps", (f"job {job} ended before {n} steps", got,
                            _job_output(tmp_path, job)[-3000:])


@pytest.mark.slow
def test_sbatch_runs_learner_and_actors_to_the_end(cluster, tmp_path, tiny_model_dir):
    run, job = _submit(cluster, tmp_path, tiny_model_dir, "learner.max_steps=4",
                       actors_per_node=2)
    rec = cluster.wait(job, timeout=300)
    out = _job_output(tmp_path, job)
    logs = run / "logs" / "slurm"
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", (rec, out)
    s = procs.summary(run)
    assert s["steps"] == 4 and s["accounting_ok"] and s["rejected_messages"] == {}, s
    assert s["end_reason"] == "finished"
    node = cluster.node
    assert (logs / f"learner-{node}.log").exists(), out
    port = re.search(r"127\.0\.0\.1:(\d+)", out).group(1)
    for t in (0, 1):
        text = (logs / f"actor-{node}-{t}.log").read_text()
        assert re.search(rf"joined learner run \S+ at tcp://127\.0\.0\.1:{port}", text), text[-2000:]
        assert "learner says shut down" in text, text[-2000:]
    print(f"sbatch job {job}: {s['steps']} steps, learner wall {s['wall_seconds']}s")


@pytest.mark.slow
def test_scancel_checkpoints_before_the_job_stops(cluster, tmp_path, tiny_model_dir):
    run, job = _submit(cluster, tmp_path, tiny_model_dir, "learner.max_steps=100000",
                       "learner.checkpoint_every=0")
    _until_steps(cluster, job, run, tmp_path, 3, timeout=240)
    cluster.run("scancel", job)
    rec = cluster.wait(job, timeout=120)
    out = _job_output(tmp_path, job)
    assert rec["JobState"] == "CANCELLED", (rec, out)
    s = procs.summary(run)
    assert s["end_reason"] == "interrupted" and s["accounting_ok"], s
    state = json.loads((run / "checkpoints" / f"step_{s['steps']}" / "state.json").read_text())
    assert state["version"] == s["steps"] >= 3
    assert (run / "final_model" / "model.safetensors").exists()
    print(f"scancel after {s['steps']} steps: checkpoint step_{s['steps']} and summary written")
