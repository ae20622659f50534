"""Held-out evaluation on the fleet (learner/evaluate.py): evaluation leases go first and
outside the capacity rule and the accounting; the actors serve them; the learner builds no
engine of its own; the trainer never gets an evaluation sample; each round is tagged with the
version it evaluates."""

from __future__ import annotations

import threading

import numpy as np

import procs
from buffer.accounting import Drops
from learner.leases import LeaseTable
from tasks.base import Prompt


class _Task:
    def train_prompt(self, index: int) -> Prompt:
        return Prompt(prompt_id=index, token_ids=np.array([1, 2], np.int32), meta={})


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt_id=-1 - i, token_ids=np.array([3], np.int32), meta={}) for i in range(n)]


def test_evaluation_leases_go_first_outside_capacity_and_accounting():
    t = LeaseTable(_Task(), prompts_per_step=2, group_size=4, max_staleness=0, drops=Drops())
    assert len(t.grant("a", "i", 8, version=0)) == 2  # capacity (0 + 0 + 1) * 2
    t.add_eval(0, _prompts(3))
    got = t.grant("a", "i", 2, version=0)  # no training capacity left: evaluation still flows
    assert [(r.eval_version, r.num_samples, r.min_version) for r in got] == [(0, 1, 0)] * 2
    assert t.counts()["granted"] == 2 and len(t.outstanding) == 2  # not in the accounting
    # an actor lost: its evaluation lease goes back to the front, nothing is dropped
    assert t.expire_actor("a") == 2 and t.drops.counts() == {"expired": 2}
    again = t.grant("b", "j", 3, version=0)
    assert [r.prompt.prompt_id for r in again[:3]] == [-1, -2, -3] and all(
        r.eval_version == 0 for r in again)
    done = t.complete(again[0].lease_id, "b")
    assert done.eval_version == 0 and t.is_closed(again[0].lease_id)
    assert t.held_by("b") == sorted(r.lease_id for r in again[1:])
    t.close_training()
    t.add_eval(5, _prompts(1))
    assert [r.eval_version for r in t.grant("b", "j", 8, version=5)] == [5]  # no training


def test_actors_evaluate_and_the_learner_trains_on_none_of_it(tmp_path, tiny_model_dir,
                                                              monkeypatch):
    from actors.engines import hf as hf_engine
    from learner.algo import trainer

    engines, trained = [], []
    real_engine, real_step = hf_engine.HFEngine.__init__, trainer.Trainer.step

    def engine_init(self, *args, **kwargs):
        engines.append(threading.current_thread().name)
        real_engine(self, *args, **kwargs)

    def step(self, groups, version):
        trained.extend(g.prompt_id for g in groups)
        return real_step(self, groups, version)

    monkeypatch.setattr(hf_engine.HFEngine, "__init__", engine_init)
    monkeypatch.setattr(trainer.Trainer, "step", step)
    run = tmp_path / "run"
    s, _ = procs.run_inproc(run, tiny_model_dir, "learner.max_steps=3", "task.eval_prompts=24")
    # one engine per actor (built in its worker thread), none in the learner's thread
    assert len(engines) == 2 and threading.main_thread().name not in engines, engines
    assert trained and min(trained) >= 0  # held-out prompts (ids < 0) never reach training
    ev = s["evaluations"]
    assert (ev["start"]["version"], ev["end"]["version"]) == (0, 3)
    assert ev["start"]["samples"] == ev["end"]["samples"] == 24
    assert ev["end"]["sampled_versions"] == [3, 3]  # nothing newer than the final version
    assert ev["start"]["sampled_versions"][0] == 0
    assert s["eval_reward_start"] == ev["start"]["reward"] and 0 <= s["eval_reward_end"] <= 1
    assert s["accounting_ok"] and s["groups"]["consumed"] == 3 * 16
