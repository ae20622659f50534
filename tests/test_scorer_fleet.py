"""The scorer fleet end to end: a toy run whose only reward is a tiny sequence classifier,
scored by two scorer processes over the control socket, one SIGKILLed mid-run."""

from __future__ import annotations

import signal

import pytest

import procs
from scorer_models import build_seven_classifier


@pytest.fixture(scope="module")
def seven_classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm") / "seven"
    acc = build_seven_classifier(path, steps=80)
    assert acc >= 0.97, acc
    return path


@pytest.mark.slow
def test_classifier_reward_learns_with_a_scorer_killed_mid_run(tmp_path, tiny_model_dir,
                                                                seven_classifier):
    """Learning to the classifier's taste: held-out classifier score >= 0.8 from its start,
    with two scorer processes. After step 1 scorer A freezes (SIGSTOP) while it holds batches
    (the learner picks the less loaded scorer, A before B on a tie), is declared dead, its
    batches go to scorer B, and A is SIGKILLed. The run finishes,
    the accounting balances, and every sample that reached the learner is scored exactly once
    (scored + failed + live = samples, where live are the samples of the groups still being
    scored when the run ended, counted as `groups.scoring`; the learner's score sums agree)."""
    run = tmp_path / "run"
    lp = procs.learner(
        run, tiny_model_dir, "actors.num_local=1", "scoring.num_local=0",
        f"task.scorers=[{{kind: classifier, name: seven, path: {seven_classifier}, "
        "output: has7}]", "scoring.batch_size=32", "scoring.max_wait_s=0.02",
        "scoring.deadline_s=120", "learner.max_steps=40", "learner.prompts_per_step=8",
        "learner.log_every=1", "learner.checkpoint_every=0", "task.eval_prompts=64",
        "transport.heartbeat_s=0.25", "transport.peer_timeout_s=3", "max_staleness=1")
    a = b = None
    try:
        lp.wait_for(r"learner listening", timeout=120)
        a = procs.Proc(["-m", "actors.scorer", "-c", str(run / "config.yaml"), "--scorer-id",
                        "A", str(run / "endpoints.json")], tmp_path / "scorer-A.log")
        b = procs.Proc(["-m", "actors.scorer", "-c", str(run / "config.yaml"), "--scorer-id",
                        "B", str(run / "endpoints.json")], tmp_path / "scorer-B.log")
        a.wait_for(r"scorer A ready", timeout=120)
        b.wait_for(r"scorer B ready", timeout=120)
        lp.wait_for(r"step 1/40", timeout=300)
        a.p.send_signal(signal.SIGSTOP)
        lp.wait_for(r"scorer A silent .* declared dead", timeout=60)
        lp.wait_for(r"scorer A dead: its \d+ batch\(es\) go to other scorers", timeout=10)
        a.p.send_signal(signal.SIGKILL)
        s = procs.finish_clean(lp, run, 40, timeout=400)
        assert b.finish(timeout=60) == 0, b.tail()
    finally:
        for p in (a, b, lp):
            if p is not None:
                p.kill()
    print(f"classifier reward: held-out {s['eval_reward_start']:.3f} -> "
          f"{s['eval_reward_end']:.3f} in {s['steps']} steps, {s['wall_seconds']:.0f} s; "
          f"scoring {s['scoring']}")
    assert s["eval_reward_end"] >= 0.8 and s["eval_reward_end"] > s["eval_reward_start"] + 0.2, \
        procs.learning_curve(run, every=1)
    sc, g = s["scoring"], s["groups"]
    assert sc["samples"] == sc["scored"] + sc["failed"] + sc["live"], sc
    assert sc["failed"] == 0 and sc["scored"] > 0, sc  # B took over A's batches in time
    assert sc["reassigned"] >= 1, sc
    assert g["scoring"] * 8 == sc["live"] and s["accounting_ok"]
    trained_or_buffered = (g["consumed"] + g["in_buffer"] + sum(g["dropped"].values())
                           - g["dropped"].get("expired", 0) - g["dropped"].get("stale", 0))
    assert sc["samples"] >= trained_or_buffered * 8
    # the learner's sums of the samples' scores: each sample scored once, flag 0
    rs = s["reward_scores"]
    assert rs["samples"] == sc["samples"] - 8 * g["scoring"] and rs.get("reward_failed", 0) == 0, rs
    rows = procs.metrics(run)
    assert any(r.get("scorer_samples_per_s", 0) > 0 for r in rows)
    assert all(0 <= r.get("scorer_busy_frac", 0) <= 1 for r in rows)
