"""Rewards by import path (tasks/rewards.py) in a real process pool: sync, async and dict
rewards, a reward that hangs and one that raises (scored 0, counted exactly, the pool goes on),
the built-in rewards, and math-verify on known-equal and known-different answers."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys

import pytest

from tasks import builtin_rewards as br
from tasks.rewards import RewardPool, load_function, normalize

USER_REWARDS = '''
import asyncio, os, time

def sync_reward(completion, completion_ids, label, metadata, bonus=0.0):
    return float(completion == str(label)) + bonus

async def async_reward(completion, completion_ids, label, metadata):
    await asyncio.sleep(0)
    return {"score": float(len(completion_ids)), "length": float(len(completion_ids)),
            "level": float(metadata["level"])}

def moody(completion, completion_ids, label, metadata):
    """hang on 'hang', raise on 'raise', die on 'die', a non-number on 'text', else 1."""
    if completion == "hang":
        time.sleep(3600)
    if completion == "raise":
        raise ZeroDivisionError("the reward fell over")
    if completion == "die":
        os._exit(7)
    if completion == "text":
        return "one"
    return 1.0
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def _run(pool: RewardPool, calls: list[tuple]):
    async def go():
        return await asyncio.gather(*(pool.score(*c) for c in calls))
    return asyncio.run(go())


def test_sync_reward_from_a_file_with_kwargs(user_file):
    pool = RewardPool(f"{user_file}:sync_reward", {"bonus": 0.5}, workers=2, timeout_s=30)
    try:
        out = _run(pool, [("7", [1, 2], 7, {}), ("8", [1], 7, {})])
        # two event loops in turn (the learner evaluates at the start and at the end)
        out += _run(pool, [("7", [1], 7, {})])
    finally:
        pool.close()
    assert [r.reward for r in out] == [1.5, 0.5, 1.5]
    assert out[0].scores == {"reward_timeout": 0.0, "reward_error": 0.0}
    assert pool.counts == {"ok": 3}


def test_async_reward_by_module_path_returns_named_scores(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    monkeypatch.setenv("PYTHONPATH", f"{user_file.parent}:{os.environ.get('PYTHONPATH', '')}")
    pool = RewardPool("user_rewards:async_reward", {}, workers=1, timeout_s=30)
    try:
        (r,) = _run(pool, [("abc", [5, 6, 7], None, {"level": 2})])
    finally:
        pool.close()
    assert r.reward == 3.0
    assert r.scores == {"score": 3.0, "length": 3.0, "level": 2.0, "reward_timeout": 0.0,
                        "reward_error": 0.0}


def test_hanging_raising_and_dying_rewards_score_zero_and_are_counted(user_file):
    """24 calls on 2 workers: 3 hang, 4 raise, 2 kill their worker, 2 return a non-number,
    13 are fine. Every call gets a result, in order, and the counts are exact; the pool
    replaces the workers it lost and keeps serving."""
    kinds = (["ok"] * 13 + ["hang"] * 3 + ["raise"] * 4 + ["die"] * 2 + ["text"] * 2)
    order = [kinds[(i * 7) % len(kinds)] for i in range(len(kinds))]  # interleaved
    assert sorted(order) == sorted(kinds)
    pool = RewardPool(f"{user_file}:moody", {}, workers=2, timeout_s=1.5)
    try:
        out = _run(pool, [(k, [1], 0, {}) for k in order])
        after = _run(pool, [("ok", [1], 0, {}) for _ in range(4)])  # replaced workers serve
    finally:
        pool.close()
    assert len(out) == len(order)
    for k, r in zip(order, out):
        assert r.reward == (1.0 if k == "ok" else 0.0), k
        assert r.scores["reward_timeout"] == float(k == "hang"), k
        assert r.scores["reward_error"] == float(k in ("raise", "die", "text")), k
    assert pool.counts == {"ok": 13 + 4, "timeout": 3, "error": 8}
    assert [r.reward for r in after] == [1.0] * 4


@pytest.mark.parametrize("spec, message", [
    ("no_colon", r"task.reward 'no_colon' must look like package.module:function"),
    ("/nope/r.py:f", r"file /nope/r.py does not exist"),
    ("no_such_mod_xyz:f", r"no module named 'no_such_mod_xyz'"),
    ("tasks.builtin_rewards:nothing_here", r"has no function 'nothing_here'"),
])
def test_bad_reward_paths_name_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        load_function(spec, "task.reward")


@pytest.mark.parametrize("value, message", [
    ({"correct": 1.0}, r"needs a 'score' entry"), (float("nan"), r"finite number"),
    ("1", r"finite number"), ({"score": 1.0, "x": None}, r"score 'x' must be a finite"),
])
def test_malformed_return_values(value, message):
    with pytest.raises(ValueError, match=message):
        normalize(value)


@pytest.mark.parametrize("gold, answer, equal", [
    ("\\frac{1}{2}", "The answer is $\\boxed{\\frac{2}{4}}$.", True),
    ("0.5", "So we get $\\frac{1}{2}$", True),
    ("$\\frac{3}{4}$", "$\\boxed{0.75}$", True),
    ("$\\sqrt{2}$", "$\\boxed{\\frac{2}{\\sqrt{2}}}$", True),
    ("$x^2+2x+1$", "$\\boxed{(x+1)^2}$", True),
    (12, "The total is $\\boxed{12}$", True),
    ("\\frac{1}{2}", "$\\boxed{\\frac{1}{3}}$", False),
    ("$\\sqrt{2}$", "$\\boxed{2}$", False),
    (12, "The total is $\\boxed{13}$", False),
    ("$x^2+1$", "$\\boxed{(x+1)^2}$", False),
])
def test_math_verify_on_known_answers(gold, answer, equal):
    assert br.math_verify(answer, [], gold, {}) == float(equal)


def test_builtin_rewards():
    assert br.gsm8k("so 3 + 4 = 7\n#### 7", [], "#### 7", {}) == 1.0
    assert br.gsm8k("#### 1,234.", [], 1234, {}) == 1.0
    assert br.gsm8k("I think 8", [], 7, {}) == 0.0
    assert br.exact_match(" Paris\n", [], "Paris", {}) == 1.0
    assert br.exact_match("paris", [], "Paris", {}) == 0.0
    assert br.regex_format("... #### 12", [], None, {}) == 1.0
    assert br.regex_format("12", [], None, {}, pattern=r"^\d+$") == 1.0
    assert br.regex_format("twelve", [], None, {}, pattern=r"^\d+$") == 0.0
    assert br.length_penalty("", [0] * 16, None, {}, max_tokens=64) == 0.75
    assert br.length_penalty("", [0] * 100, None, {}, max_tokens=64) == 0.0
    short = br.correct_and_short("3 + 5 = 8", [0] * 6, 8, {}, max_tokens=24)
    long = br.correct_and_short("3 + 5 = 8", [0] * 30, 8, {}, max_tokens=24)
    wrong = br.correct_and_short("3 + 5 = 9", [0] * 6, 8, {}, max_tokens=24)
    assert short == {"score": 0.875, "correct": 1.0, "tokens": 6.0}
    assert long["score"] == 0.5 and wrong["score"] == 0.0


RUN_REWARD = '''
import time

def reward(completion, completion_ids, label, metadata):
    """Each prompt's fate is fixed by its label: hang, raise, or score the reversal."""
    if int(label) % 7 == 0:
        time.sleep(3600)
    if int(label) % 7 == 1:
        raise RuntimeError("broken reward")
    got = completion.split()
    right = sum(a == b for a, b in zip(got, label))
    return {"score": right / 4, "ok": 1.0}
'''


@pytest.mark.slow
def test_learner_run_goes_on_with_hanging_and_raising_rewards(tmp_path, tiny_model_dir):
    """A data task on the tiny model whose reward hangs on some prompts and raises on others:
    the run trains every step, no group is lost, and every rollout is accounted for exactly
    once as ok, timed out or failed (in the actors and in the learner's evaluation)."""
    import json

    import numpy as np

    import procs

    rng = np.random.default_rng(0)
    numbers = [str(n).zfill(4) for n in rng.choice(10_000, 200, replace=False)]
    data = tmp_path / "rev.jsonl"
    data.write_text("".join(json.dumps({"prompt": "rev " + " ".join(n) + " =",
                                        "label": n[::-1]}) + "\n" for n in numbers))
    (tmp_path / "run_reward.py").write_text(RUN_REWARD)
    run = tmp_path / "run"
    steps = 12
    lp = procs.learner(run, tiny_model_dir, "task.name=data", f"task.data_path={data}",
                       f"task.reward={tmp_path / 'run_reward.py'}:reward",
                       "task.reward_timeout_s=1.0", "task.eval_prompts=16",
                       f"learner.max_steps={steps}", "learner.prompts_per_step=4",
                       "learner.group_size=4", "learner.checkpoint_every=0")
    s = procs.finish_clean(lp, run, steps, timeout=600)
    sc = s["reward_scores"]
    assert sc["samples"] == sum(s["rollout_ends"].values())
    assert sc["ok"] + sc["reward_timeout"] + sc["reward_error"] == sc["samples"]
    assert sc["reward_timeout"] >= 4 and sc["reward_error"] >= 4, sc  # whole groups of 4
    assert s["groups"]["consumed"] == steps * 4


STUCK_REWARD = '''
import os, time

def stuck(completion, completion_ids, label, metadata):
    """Tell the test this worker's pid (at the FIFO in metadata), then hang."""
    with open(metadata["fifo"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)
'''

OWNER = '''
import asyncio, sys
from tasks.rewards import RewardPool
pool = RewardPool(sys.argv[1] + ":stuck", {}, workers=1, timeout_s=3600)
asyncio.run(pool.score("x", [1], 0, {"fifo": sys.argv[2]}))
'''


def test_a_worker_stuck_in_a_reward_ends_when_its_owner_is_sigkilled(tmp_path):
    """The process that owns the pool (an actor, or the learner) is SIGKILLed while its worker
    hangs in a reward: the worker ends too, instead of hanging on as an orphan."""
    import procs

    (tmp_path / "stuck.py").write_text(STUCK_REWARD)
    fifo = tmp_path / "worker-pid"
    os.mkfifo(fifo)
    rd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # before the owner starts: no writer blocks
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "stuck.py"), str(fifo)],
                             cwd=procs.ROOT)
    worker = None
    try:
        assert select.select([rd], [], [], 120)[0], "the reward never started"
        worker = int(os.read(rd, 64))
        owner.kill()
        owner.wait()
        assert procs.wait_pid_exit(worker, timeout=30), f"reward worker {worker} outlived its owner"
    finally:
        owner.kill()
        os.close(rd)
        if worker is not None and not procs.wait_pid_exit(worker, timeout=0):
            os.kill(worker, signal.SIGKILL)
