"""The scorer fleet end to end: a toy run whose only reward is a tiny sequence classifier,
scored by two scorer processes over the control socket, one SIGKILLed mid-run."""

from __future__ import annotations

import signal

import pytest

import procs
from scorer_models import FakeOpenAIJudge, build_seven_classifier


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
    (the actor streams each sample as it ends: samples = scored + failed + live + discarded, and
    scored + failed = delivered + held + wasted, where live and held are the samples still at the
    scoring desk when the run ended; the learner's score sums cover exactly the delivered ones)."""
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
    assert sc["samples"] == sc["scored"] + sc["failed"] + sc["live"] + sc["discarded"], sc
    assert sc["scored"] + sc["failed"] == sc["delivered"] + sc["held"] + sc["wasted"], sc
    assert sc["failed"] == 0 and sc["scored"] > 0, sc  # B took over A's batches in time
    assert sc["reassigned"] >= 1, sc
    assert sc["discarded"] == sc["wasted"] == 0, sc  # no lease ended without its group
    assert sc["streamed"] > 0 and sc["streamed"] <= sc["samples"], sc  # samples came as they ended
    assert s["accounting_ok"]
    # groups that left the desk: trained, buffered, or dropped from the buffer (stale, uniform)
    delivered = (g["consumed"] + g["in_buffer"] + g["dropped"].get("stale", 0)
                 + g["dropped"].get("uniform", 0))
    assert sc["delivered"] == delivered * 8 and g["scoring"] * 8 <= sc["live"] + sc["held"], (sc, g)
    # the learner's sums of the samples' scores: each delivered sample scored once, flag 0
    rs = s["reward_scores"]
    assert rs["samples"] == sc["delivered"] and rs.get("reward_failed", 0) == 0, rs
    rows = procs.metrics(run)
    assert any(r.get("scorer_samples_per_s", 0) > 0 for r in rows)
    assert all(0 <= r.get("scorer_busy_frac", 0) <= 1 for r in rows)


def test_remote_judge_scores_a_training_run_with_bounded_concurrency(tmp_path, tiny_model_dir):
    """A `kind: remote` judge (the named fake OpenAI-compatible server, tests/scorer_models.py,
    which answers 5 x the number of 7s of the answer, out of 10) is the only reward of a short
    run, in one process (transport.kind=inproc: learner, actor and scorer threads). Its requests
    never exceed max_concurrency, every sample is scored once, and each step's reward is the
    judge's mean score."""
    run = tmp_path / "run"
    with FakeOpenAIJudge(delay_s=0.02) as judge:
        s, _ = procs.run_inproc(
            run, tiny_model_dir, "actors.num_local=1", "scoring.num_local=1",
            f"task.scorers=[{{kind: remote, name: gpt, base_url: '{judge.base_url}', "
            "max_concurrency: 2, weight: 2.0}]", "scoring.max_wait_s=0.01",
            "learner.max_steps=3", "learner.prompts_per_step=4", "learner.group_size=4",
            "task.eval_prompts=0", "max_staleness=0", "learner.log_every=1",
            "learner.checkpoint_every=0")
    sc, rs = s["scoring"], s["reward_scores"]
    print(f"remote judge: {sc}, {judge.requests} requests, at most {judge.max_active} at once")
    assert s["steps"] == 3 and s["accounting_ok"] and s["rejected_messages"] == {}, s
    assert judge.max_active == 2  # the limit was reached (16 samples a batch), never passed
    assert sc["failed"] == sc["discarded"] == sc["wasted"] == sc["reassigned"] == 0, sc
    assert sc["delivered"] >= 3 * 16 and rs["samples"] == sc["delivered"], (sc, rs)
    # one request per scored sample (no evaluation: the scorer is the judge's only client); a
    # batch still at the scorer when the run ended may have asked for some of its live samples
    assert sc["scored"] <= judge.requests <= sc["scored"] + sc["live"], sc
    for row in procs.metrics(run):  # eta = 0: each step trains on the groups it logged
        assert row["reward_mean"] == pytest.approx(2.0 * row["score_gpt"], abs=1e-6), row
