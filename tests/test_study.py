"""The staleness study trains a run once for every cell that is the same objective
(lab/staleness_study.py: objective); these tests check that the shared cells really are
bitwise the same training run, and that the others are not."""

from __future__ import annotations

import sys

import pytest
import torch

from configs.loader import load_config
from learner.sync_loop import run_sync

from procs import PRESET, ROOT

sys.path.insert(0, str(ROOT / "lab"))
from staleness_study import objective  # noqa: E402

STEPS = 4


def _train(model_dir, correction: str, lag: int, minibatches: int) -> dict[str, torch.Tensor]:
    cfg = load_config(PRESET, [f"model.path={model_dir}", f"learner.correction={correction}",
                               f"learner.minibatches={minibatches}", "learner.prompts_per_step=8",
                               "learner.max_grad_norm=0", "learner.lr=3e-3"])
    return run_sync(cfg, STEPS, lag=lag).state_dict()


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("lag, minibatches, shared, other", [
    (2, 1, ("tis", "decoupled"), "none"),        # one update at pi_prox: no clip binds
    (0, 2, ("decoupled", "none"), "tis"),        # eta 0: pi_prox = mu; tis has no clip
])
def test_cells_the_study_shares_train_identically(tiny_model_dir, lag, minibatches, shared, other):
    a, b = shared
    job = {"eta": lag, "minibatches": minibatches}
    assert objective({**job, "correction": a}) == objective({**job, "correction": b})
    assert objective({**job, "correction": other}) != objective({**job, "correction": a})
    ta, tb = (_train(tiny_model_dir, c, lag, minibatches) for c in shared)
    assert _same(ta, tb)
    assert not _same(ta, _train(tiny_model_dir, other, lag, minibatches))
