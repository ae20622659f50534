"""With one minibatch and one epoch the trainer takes pi_prox from pi_theta's forward instead of a
second no-grad forward: the same step, bit for bit, one forward pass fewer."""

from __future__ import annotations

import pytest
import torch

import fsdp_worker
from learner.backends.single import SingleProcessBackend
from learner.distributed import Ranks, make_models
from learner.algo.trainer import Trainer

STEPS = 3
OBJECTIVES = {
    "decoupled": ["learner.correction=decoupled"],
    "vtrace_kl_in_reward": ["learner.advantage=vtrace", "learner.correction=none",
                            "learner.kl_coef=0.1", "learner.kl_in=reward"],
    "gae_kl_in_loss_entropy": fsdp_worker.ALGO_OVERRIDES,
}
"""Objectives that read pi_prox in different places: the importance ratio, V-trace's rho and
the KL penalty in the reward (at step start), the KL in the loss with an entropy bonus."""


def _run(cfg, fuse: bool) -> tuple[list[dict[str, float]], dict[str, torch.Tensor], int]:
    L = cfg.learner
    backend = SingleProcessBackend(cfg.model.path, L.lr, L.weight_decay, L.seed)
    trainer = Trainer(cfg, backend, pad_id=0,
                      models=make_models(cfg, Ranks(0, 1, torch.device("cpu"))))
    trainer.fuse_prox = fuse
    separate = 0
    plain = backend.logprobs

    def counted(*args, **kwargs):
        nonlocal separate
        separate += 1
        return plain(*args, **kwargs)

    backend.logprobs = counted
    metrics = [trainer.step(fsdp_worker.synthetic_groups(cfg, s), s) for s in range(STEPS)]
    return metrics, backend.state_dict(), separate


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_one_minibatch_step_is_bitwise_the_two_pass_step(tiny_model_dir, objective):
    cfg = fsdp_worker.config(tiny_model_dir, "learner.minibatches=1", "learner.epochs=1",
                             *OBJECTIVES[objective])
    fused_metrics, fused_weights, fused_passes = _run(cfg, fuse=True)
    plain_metrics, plain_weights, plain_passes = _run(cfg, fuse=False)
    assert (fused_passes, plain_passes) == (0, STEPS)  # the separate pi_prox forward is gone
    assert fused_metrics == plain_metrics
    assert fused_weights.keys() == plain_weights.keys()
    for k in fused_weights:
        assert torch.equal(fused_weights[k], plain_weights[k]), k


def test_several_minibatches_keep_the_step_start_pass(tiny_model_dir):
    """pi_prox must be the weights before the first update, so with two minibatches it is a
    separate pass at step start (one per minibatch), fused or not."""
    cfg = fsdp_worker.config(tiny_model_dir)  # minibatches=2 (fsdp_worker.TRAIN_OVERRIDES)
    fused_metrics, fused_weights, passes = _run(cfg, fuse=True)
    plain_metrics, _, _ = _run(cfg, fuse=False)
    assert passes == 2 * STEPS
    assert fused_metrics == plain_metrics
