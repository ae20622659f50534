import math

import pytest
import torch

from configs.schema import LearnerConfig
from learner.algo.loss import group_advantages, policy_loss


def test_advantages_by_hand():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    std = math.sqrt(1 / 3)  # unbiased std of [0, 1, 1, 0]
    torch.testing.assert_close(group_advantages(r, "grpo"),
                               torch.tensor([[-0.5, 0.5, 0.5, -0.5]]) / (std + 1e-6))
    torch.testing.assert_close(group_advantages(r, "drgrpo"), torch.tensor([[-0.5, 0.5, 0.5, -0.5]]))
    # RLOO: r_i minus the mean of the others
    torch.testing.assert_close(group_advantages(r, "rloo"),
                               torch.tensor([[-2 / 3, 2 / 3, 2 / 3, -2 / 3]]))


def _inputs():
    # two sequences, three token slots; the last slot of row 1 is padding
    logp = torch.log(torch.tensor([[0.5, 0.6, 0.2], [0.3, 0.9, 0.7]]))
    mu = torch.log(torch.tensor([[0.4, 0.6, 0.1], [0.5, 0.5, 0.7]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    return logp, mu, mask, adv


def test_ppo_clip_against_behavior_by_hand():
    logp, mu, mask, adv = _inputs()
    cfg = LearnerConfig(correction="none", clip_low=0.2, clip_high=0.2)
    loss, stats = policy_loss(logp, mu, mu.clone(), adv, mask, torch.zeros_like(mask), cfg, 3)
    # ratios: row0 = 1.25, 1.0, 2.0 (A=+1): min(r*A, clip(r)*A) = 1.2, 1.0, 1.2
    #         row1 = 0.6, 1.8 (A=-2):  min(-0.6*2, -0.8*2) = -1.6 ; min(-3.6, -2.4) = -3.6
    per_token = [-1.2, -1.0, -1.2, 1.6, 3.6]
    assert loss.item() == pytest.approx(sum(per_token) / 5, rel=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(3 / 5)


def test_loss_aggregations_by_hand():
    logp, mu, mask, adv = _inputs()
    per_token = torch.tensor([[-1.2, -1.0, -1.2], [1.6, 3.6, 0.0]])
    for agg, expected in [
        ("seq_mean_token_mean", ((-3.4 / 3) + (5.2 / 2)) / 2),
        ("constant", per_token.sum().item() / (2 * 4)),
    ]:
        cfg = LearnerConfig(correction="none", loss_agg=agg)
        loss, _ = policy_loss(logp, mu, mu.clone(), adv, mask, torch.zeros_like(mask), cfg, 4)
        assert loss.item() == pytest.approx(expected, rel=1e-6), agg


def test_dual_clip_bounds_negative_advantage_loss():
    logp, mu, mask, adv = _inputs()
    cfg = LearnerConfig(correction="none", dual_clip=1.5)
    loss, _ = policy_loss(logp, mu, mu.clone(), adv, mask, torch.zeros_like(mask), cfg, 3)
    # row1 token 1 had loss 3.6 > c*|A| = 3.0 -> capped at 3.0
    assert loss.item() == pytest.approx((-1.2 - 1.0 - 1.2 + 1.6 + 3.0) / 5, rel=1e-6)


def test_decoupled_uses_prox_anchor_and_truncated_weight():
    logp, mu, mask, adv = _inputs()
    prox = logp.detach().clone()  # first minibatch: pi_theta == pi_prox
    cfg = LearnerConfig(correction="decoupled", is_cap=1.5)
    loss, stats = policy_loss(logp, mu, prox, adv, mask, torch.zeros_like(mask), cfg, 3)
    w = torch.clamp(torch.exp(prox - mu), max=1.5)
    expected = ((-adv[:, None] * w) * mask).sum() / mask.sum()  # ratio 1 -> no clipping
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert stats["is_truncated_frac"].item() == pytest.approx(2 / 5)  # 0.2/0.1 and 0.9/0.5 > 1.5


def test_tis_sequence_level_and_gradient():
    logp, mu, mask, adv = _inputs()
    logp = logp.clone().requires_grad_(True)
    prox = logp.detach().clone()
    cfg = LearnerConfig(correction="tis", is_level="sequence", is_cap=10.0)
    loss, _ = policy_loss(logp, mu, prox, adv, mask, torch.zeros_like(mask), cfg, 3)
    loss.backward()
    seq_w = torch.exp(((prox - mu) * mask).sum(1))  # row0: 1.25*1*2=2.5, row1: 0.6*1.8=1.08
    torch.testing.assert_close(seq_w, torch.tensor([2.5, 1.08]))
    expected_grad = -(adv * seq_w)[:, None] * mask / mask.sum()
    torch.testing.assert_close(logp.grad, expected_grad)


def test_mask_correction_zeroes_out_of_range_tokens():
    logp, mu, mask, adv = _inputs()
    prox = logp.detach().clone()
    cfg = LearnerConfig(correction="mask", mask_low=0.7, mask_high=1.5)
    _, stats = policy_loss(logp, mu, prox, adv, mask, torch.zeros_like(mask), cfg, 3)
    # pi_prox/mu = 1.25, 1, 2 | 0.6, 1.8 -> masked: 2, 0.6, 1.8
    assert stats["masked_frac"].item() == pytest.approx(3 / 5)


def test_staleness_decay_scales_weights():
    logp, mu, mask, adv = _inputs()
    cfg = LearnerConfig(correction="none", staleness_decay=0.5)
    stale = torch.tensor([[0, 1, 2], [1, 1, 0]])
    _, stats = policy_loss(logp, mu, mu.clone(), adv, mask, stale, cfg, 3)
    assert stats["is_weight_mean"].item() == pytest.approx((1 + 0.5 + 0.25 + 0.5 + 0.5) / 5)
