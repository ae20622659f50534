"""Held-out evaluation counts the rollouts that failed instead of ending the run."""

from __future__ import annotations

import procs


def test_a_raising_rollout_in_the_learners_evaluation_is_counted_not_fatal(tmp_path,
                                                                           tiny_model_dir):
    """One raising agent rollout during the held-out evaluation used to kill the run at step 0
    (a 379-line traceback); in actors the same error only drops that sample."""
    run = tmp_path / "run"
    s, _ = procs.run_inproc(run, tiny_model_dir, "learner.max_steps=1", "task.eval_prompts=8",
                            "actors.agent=openai", "actors.agent.function=flaky_agent:agent",
                            "actors.num_local=1", "learner.prompts_per_step=4",
                            "buffer.capacity_groups=4")
    assert s["steps"] == 1
    assert s["eval_errors_start"] == 2  # calls 3 and 7 of the first 8
    assert 0 <= s["eval_reward_start"] <= 1 and "eval_errors_end" in s
