"""DAPO dynamic sampling through the whole learner: uniform groups are dropped as their own
accounting term and refilled by more leases, with staleness still bounded by the capacity
rule; and the critic's checkpoint errors."""

from __future__ import annotations

import numpy as np
import pytest

import procs
from helpers import make_group
from learner.algo.advantages import is_uniform


def test_uniform_groups_dropped_refilled_and_accounted(tmp_path, tiny_model_dir):
    """Groups of 2 samples: many are uniform (both right or both wrong). Every batch is
    still full, `granted = consumed + dropped + outstanding + in_buffer` holds with
    dropped{uniform} > 0, and no batch trains on a token more than max_staleness old."""
    run = tmp_path / "run"
    s, _ = procs.run_inproc(run, tiny_model_dir, "learner.max_steps=6", "max_staleness=2",
                            "learner.group_size=2", "learner.prompts_per_step=8",
                            "learner.drop_uniform_groups=true", "learner.checkpoint_every=0")
    g = s["groups"]
    assert s["steps"] == 6 and s["accounting_ok"], g
    uniform = g["dropped"].get("uniform", 0)
    assert uniform >= 6, g  # "many": at least one per step on average
    assert g["consumed"] == 6 * 8
    assert g["granted"] == g["consumed"] + sum(g["dropped"].values()) + g["outstanding"] + g["in_buffer"]
    rows = procs.metrics(run)
    assert all(r["staleness_max"] <= 2 for r in rows)
    assert all(r["reward_std"] > 0 for r in rows)  # no batch is all-uniform


def test_is_uniform():
    assert is_uniform(np.array([0.5, 0.5, 0.5], np.float32))
    assert not is_uniform(np.array([0.5, 0.25], np.float32))


def test_resume_without_critic_names_the_setting(tmp_path, tiny_model_dir):
    import torch

    from configs.loader import load_config
    from learner.backends.single import SingleProcessBackend
    from learner.distributed import Ranks, make_models
    from learner.algo.trainer import Trainer

    cfg = load_config(procs.PRESET, [f"model.path={tiny_model_dir}", "learner.advantage=gae"])
    L = cfg.learner
    backend = SingleProcessBackend(cfg.model.path, L.lr, L.weight_decay, L.seed)
    trainer = Trainer(cfg, backend, 0, models=make_models(cfg, Ranks(0, 1, torch.device("cpu"))))
    backend.save_checkpoint(tmp_path / "plain", {"version": 0})
    with pytest.raises(FileNotFoundError, match="no critic/ but learner.advantage"):
        trainer.models.load(tmp_path / "plain")
    trainer.step([make_group(k, 0) for k in range(16)], 0)
    trainer.models.save(tmp_path / "plain")
    before = {k: v.clone() for k, v in trainer.models.critic.state_dict().items()}
    fresh = make_models(cfg, Ranks(0, 1, torch.device("cpu")))
    fresh.load(tmp_path / "plain")
    after = fresh.critic.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert any(not torch.equal(before[k], torch.zeros_like(before[k])) for k in before
               if "value_head" in k)  # the head trained away from its zero start


def test_trainer_without_the_models_it_needs_says_so(tiny_model_dir):
    from configs.loader import load_config
    from learner.backends.single import SingleProcessBackend
    from learner.algo.trainer import Trainer

    cfg = load_config(procs.PRESET, [f"model.path={tiny_model_dir}", "learner.kl_coef=0.1"])
    backend = SingleProcessBackend(cfg.model.path, 1e-3, 0.0, 0)
    with pytest.raises(ValueError, match="kl_coef > 0 needs a reference"):
        Trainer(cfg, backend, 0)
