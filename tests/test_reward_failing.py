"""A reward that keeps failing stops the run with one line naming it (its failures logged at a
limited rate), and a start-up error is one line, its traceback only at debug level."""

from __future__ import annotations

import json
import subprocess
import sys

import procs
from conftest import ROOT

RAISING = "def reward(completion, completion_ids, label, metadata):\n    raise KeyError('label')\n"


def _run_with_reward(tmp_path, model_dir, source: str, *overrides: str):
    """The learner with one local actor on a small data task scored by a reward written from
    `source`; returns the reward's spec and the finished learner process."""
    (tmp_path / "reward.py").write_text(source)
    data = tmp_path / "rev.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"rev {i} {i} =", "label": f"{i} {i}"}) + "\n"
                            for i in range(10)) * 4)
    spec = f"{tmp_path / 'reward.py'}:reward"
    r = subprocess.run([sys.executable, "-m", "learner", "-c", str(procs.PRESET),
                        f"run_dir={tmp_path / 'run'}", f"model.path={model_dir}",
                        "task.name=data", f"task.data_path={data}", f"task.reward={spec}",
                        "actors.num_local=1", *overrides],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    return spec, r


def test_a_reward_that_always_raises_stops_the_run_with_one_line(tmp_path, tiny_model_dir):
    """It used to be logged once per call, forever, while the run trained on zeros."""
    spec, r = _run_with_reward(tmp_path, tiny_model_dir, RAISING, "task.eval_prompts=8",
                               "task.reward_workers=1")
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"tether-learner: task.reward {spec} failed on 8 of 8 calls in the held-out "
                    "evaluation at v0 (errors and timeouts; more than "
                    "task.reward_max_error_frac=0.5): fix the reward, or see the warnings above "
                    "for its error"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    # the evaluation runs on the actor (#40), whose reward calls log at a limited rate
    actor_log = (tmp_path / "run" / "logs" / "actor-0.log").read_text()
    failed = [ln for ln in actor_log.splitlines() if f"WARNING reward {spec} failed" in ln]
    assert len(failed) == 3 and "KeyError: 'label'" in failed[0], actor_log[-3000:]
    assert "logging every 100th from now" in failed[2], actor_log[-3000:]


HANGING = "import time\ndef reward(completion, completion_ids, label, metadata):\n    time.sleep(3600)\n"


def _stamp(stderr: str, text: str) -> float:
    """The time of the first log line holding `text` (seconds of the day)."""
    line = next(ln for ln in stderr.splitlines() if text in ln)
    h, m, s = line.split()[1].replace(",", ".").split(":")
    return 3600 * int(h) + 60 * int(m) + float(s)


def test_a_reward_that_always_hangs_costs_the_evaluation_its_timeouts_side_by_side(
        tmp_path, tiny_model_dir):
    """Evaluation's reward calls ran one after another, each to its timeout (40 prompts x 10 s
    on the SmolLM2 preset: the first evaluation took about 5 minutes), then the run trained on
    zeros. 12 calls hanging (and up to 4 of the training samples') on 6 workers with a 5 s
    timeout: about 3 x 5 s side by side, where one after another is at least 60 s; then the run
    stops with one line."""
    spec, r = _run_with_reward(
        tmp_path, tiny_model_dir, HANGING, "task.eval_prompts=12", "task.reward_workers=6",
        "task.reward_timeout_s=5",
        # little training work: its calls share the workers with evaluation's
        "learner.prompts_per_step=1", "learner.group_size=2")
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"tether-learner: task.reward {spec} failed on 12 of 12 calls in the held-out "
        "evaluation at v0 (errors and timeouts;"), r.stderr[-3000:]
    took = (_stamp(r.stderr, "shut down: failed")
            - _stamp(r.stderr, "held-out evaluation of v0 queued"))  # the actor's start included
    assert took < 45, (took, r.stderr[-3000:])


def test_a_start_up_error_is_one_line_without_a_traceback(tmp_path, tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "learner", "-c", str(procs.PRESET),
                        f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}",
                        "task.name=data", f"task.data_path={tmp_path / 'none.jsonl'}",
                        "task.reward=tasks.builtin_rewards:correct_and_short",
                        "actors.num_local=0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].startswith(
        "tether-learner: "), r.stderr[-3000:]
    assert "none.jsonl" in r.stderr.strip().splitlines()[-1], r.stderr[-3000:]
