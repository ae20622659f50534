"""A verifiers environment (tests/verifiers_toy.py, verifiers' own Taskset / Task / @vf.reward /
Harness) runs as the agent of a real actor process (actors/agents/verifiers.py), and its rubric's
reward is what the learner receives and trains on."""

from __future__ import annotations

import json

import pytest

import procs
from tasks.data import split_rows

pytest.importorskip("verifiers.v1", reason="needs verifiers (pip install -e '.[verifiers]')")

TESTS = procs.ROOT / "tests"


def test_a_verifiers_environment_runs_as_an_actor_and_its_rubric_reaches_the_learner(
        tmp_path, monkeypatch):
    log = tmp_path / "scores.jsonl"
    monkeypatch.setenv("PYTHONPATH", f"{procs.ROOT}:{TESTS}")
    monkeypatch.setenv("VF_TOY_LOG", str(log))
    run, steps, eval_prompts = tmp_path / "run", 2, 4
    # max_staleness=0: leases are granted only as fast as steps need them, so every episode
    # the actor scores reaches the learner before it stops
    lp = procs.learner(run, tmp_path / "model", f"learner.max_steps={steps}",
                       "learner.prompts_per_step=4", "learner.group_size=4", "learner.log_every=1",
                       "max_staleness=0", f"task.eval_prompts={eval_prompts}",
                       "model.warmstart_steps=0", "actors.num_local=1", "task.name=verifiers",
                       "task.verifiers_env=verifiers_toy:ENV", "actors.agent=verifiers")
    s = procs.finish_clean(lp, run, steps, timeout=300)

    traces: dict[str, dict] = {}  # what verifiers' rubric computed in the actor, per trace
    for line in log.read_text().splitlines():
        row = json.loads(line)
        traces.setdefault(row.pop("trace"), {}).update(row)
    held_idx = {r["idx"] for r in split_rows([{"idx": i} for i in range(64)], 0.1, "")[1]}
    train = [t for t in traces.values() if t["task"] not in held_idx]
    held = [t for t in traces.values() if t["task"] in held_idx]
    assert (len(train), len(held)) == (steps * 4 * 4, 2 * eval_prompts)

    def reward(t: dict) -> float:
        return 0.5 * t["reversed_digits"] + 0.125 * t["answered"]

    # every training sample's named scores reached the learner (Sample.scores, summed there)
    got = s["reward_scores"]
    assert got["samples"] == len(train), got
    for name in ("reversed_digits", "answered"):
        assert got.get(name, 0.0) == pytest.approx(sum(t[name] for t in train)), name
    # and the rewards it trained on, and evaluated with, are the rubric's weighted sums
    trained = sum(r["reward_mean"] * 16 for r in procs.metrics(run))
    assert trained == pytest.approx(sum(map(reward, train)), abs=1e-4)
    held_out = (s["eval_reward_start"] + s["eval_reward_end"]) * eval_prompts
    assert held_out == pytest.approx(sum(map(reward, held)), abs=1e-4)
    assert any(t["answered"] for t in traces.values())  # the replies reached the rubric
    assert set(s["rollout_ends"]) <= {"answer", "max_tokens"}, s["rollout_ends"]


def test_bad_verifiers_env_specs_are_named(monkeypatch):
    from tasks.verifiers import load_verifiers_env

    monkeypatch.syspath_prepend(str(TESTS))
    with pytest.raises(ValueError, match=r"cannot import 'no_such_module'"):
        load_verifiers_env("no_such_module:ENV")
    with pytest.raises(ValueError, match=r"module 'verifiers_toy' has no attribute 'NOPE'"):
        load_verifiers_env("verifiers_toy:NOPE")
    with pytest.raises(ValueError, match=r"is a str: expected a verifiers.v1 Env or EnvConfig"):
        load_verifiers_env("verifiers_toy:__doc__")


def test_the_config_names_what_a_verifiers_run_needs():
    from configs.loader import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"task.verifiers_env must be"):
        load_config(procs.PRESET, ["task.name=verifiers", "actors.agent=verifiers"])
    with pytest.raises(ConfigError, match=r"actors.agent must be verifiers exactly when"):
        load_config(procs.PRESET, ["task.name=verifiers", "task.verifiers_env=verifiers_toy:ENV"])
    with pytest.raises(ConfigError, match=r"actors.agent must be verifiers exactly when"):
        load_config(procs.PRESET, ["actors.agent=verifiers"])
