"""The learner owns the run's task, agent, reward and sampling settings: it sends them in the
Welcome, and an actor started with another preset runs the learner's (saying which differed)."""

from __future__ import annotations

import procs


def test_an_actor_started_with_another_preset_runs_the_learners_task_and_agent(
        tmp_path, calculator_model_dir):
    """A toy_reverse actor against a toy_calculator learner used to be accepted and to train
    on wrong rollouts (single-turn reversal scored against calculator prompts)."""
    run = tmp_path / "run"
    lp = procs.learner(run, calculator_model_dir, "actors.num_local=0", "learner.max_steps=2",
                       "learner.prompts_per_step=4", "task.eval_prompts=4",
                       preset=procs.ROOT / "configs" / "toy_calculator.yaml")
    ap = None
    try:
        lp.wait_for(r"learner listening", timeout=180)
        ap = procs.Proc(["-m", "actors", "-c", str(procs.PRESET), "--actor-id", "reverse-actor",
                         f"run_dir={run}", str(run / "endpoints.json")], tmp_path / "actor.log")
        line = ap.wait_for(r"the learner's run settings replace this actor's: (.*)",
                           timeout=180).group(1)
        assert "task.name='calculator' (this actor's: 'reverse')" in line, line
        assert "actors.agent.kind='tools' (this actor's: 'single_turn')" in line, line
        assert "task.max_new_tokens=12 (this actor's: 5)" in line, line
        s = procs.finish_clean(lp, run, 2, timeout=300)
        assert ap.finish(timeout=60) == 0, ap.tail()
    finally:
        for p in (ap, lp):
            if p is not None:
                p.kill()
    assert s["groups"]["consumed"] == 2 * 4
    # the tools agent ran: its samples end by answer or turn limit, never one plain turn cut
    assert s["rollout_ends"], s
