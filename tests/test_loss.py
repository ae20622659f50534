import math

import pytest
import torch

from configs.schema import LearnerConfig
from learner.algo import advantages as A
from learner.algo.loss import LossNorm, group_advantages, gspo_ratio, policy_loss


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


# issue 44: the three conventions that differ from verl 0.9.1 (docs/algorithms.md "Conventions")

@pytest.mark.parametrize("std, expected", [("population", [-1.0, 1.0]),
                                           ("bessel", [-1 / math.sqrt(2), 1 / math.sqrt(2)])])
def test_reinforce_pp_whitening_std_by_hand(std, expected):
    # one row, two trained tokens, reward 1, gamma 0.5: returns 0.5, 1, mean 0.75; squared
    # deviations 1/16 each: population std sqrt(1/16) = 0.25, Bessel sqrt(1/8) = 0.3536
    mask = torch.ones(1, 2)
    r = A.token_rewards(torch.tensor([1.0]), mask)
    got = A.reinforce_pp(r, mask, 0.5, float(mask.sum()), lambda s: s, std)
    torch.testing.assert_close(got, torch.tensor([expected]), atol=1e-6, rtol=0)


def _gspo_token_grad(adv, log_w, cfg):
    """One row, two tokens, pi_theta = pi_prox (ratio 1), token_mean: the gradient of the loss
    in log pi_theta, and of Tether's former sequence-ratio form for comparison."""
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    prox = logp.detach().clone()
    mask = torch.ones(1, 2)
    behavior = prox - log_w
    loss, _ = policy_loss(logp, behavior, prox, adv, mask, torch.zeros_like(mask), cfg, 2)
    (grad,) = torch.autograd.grad(loss, logp)
    weight = torch.exp(log_w).clamp(max=cfg.is_cap) if cfg.correction == "decoupled" else 1.0
    a = adv[:, None] if adv.dim() == 1 else adv
    seq = gspo_ratio(logp, prox, mask, token_grad=False)
    (seq_grad,) = torch.autograd.grad((-a * seq * weight).mean(), logp)
    return grad, seq_grad


def test_gspo_token_gradient_carries_token_advantages_by_hand():
    # advantages [1, -1] at ratio 1: s_it = sg[s] pi/sg[pi] gives token t the gradient
    # -A_t s / 2 = [-0.5, 0.5]; the sequence ratio's gradient, (-1 + 1) s / 2 / 2 each, is 0
    cfg = LearnerConfig(correction="none", ratio_level="sequence")
    grad, seq_grad = _gspo_token_grad(torch.tensor([[1.0, -1.0]]), torch.zeros(1, 2), cfg)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5]]))
    torch.testing.assert_close(seq_grad, torch.tensor([[0.0, 0.0]]))


def test_gspo_token_gradient_carries_token_weights_by_hand():
    # IS weights [2, 0.5], advantage 1, ratio 1: token t gets -w_t / 2 = [-1, -0.25]; the
    # sequence ratio spreads the row's -(2 + 0.5) / 2 over both tokens: -0.625 each
    cfg = LearnerConfig(correction="decoupled", ratio_level="sequence", is_cap=2.0)
    log_w = torch.log(torch.tensor([[2.0, 0.5]]))
    grad, seq_grad = _gspo_token_grad(torch.tensor([1.0]), log_w, cfg)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -0.25]]))
    torch.testing.assert_close(seq_grad, torch.tensor([[-0.625, -0.625]]))


@pytest.mark.parametrize("denominator", ["trained", "accepted"])
def test_mask_correction_denominators_by_hand(denominator):
    logp, mu, mask, adv = _inputs()
    logp = logp.clone().requires_grad_(True)
    prox = logp.detach().clone()  # ratio 1: the per-token loss is -A * weight
    # pi_prox/mu = 1.25, 1, 2 | 0.6, 1.8 in [0.7, 1.5]: row 0's first two tokens are accepted,
    # row 1 has none; per-token losses -1, -1 (accepted), 5 trained tokens, 3 slots per row
    trained = denominator == "trained"
    expected = {
        "token_mean": -2 / 5 if trained else -2 / 2,
        "seq_mean_token_mean": (-2 / 3 + 0) / 2 if trained else (-2 / 2 + 0) / 2,
        "constant": -2 / (2 * 3),  # samples x max_new_tokens either way
    }
    for agg, want in expected.items():
        cfg = LearnerConfig(correction="mask", mask_low=0.7, mask_high=1.5, loss_agg=agg,
                            mask_denominator=denominator)
        loss, stats = policy_loss(logp, mu, prox, adv, mask, torch.zeros_like(mask), cfg, 3)
        assert loss.item() == pytest.approx(want, rel=1e-6), agg
        assert stats["masked_frac"].item() == pytest.approx(3 / 5)  # over every trained token
        if agg == "token_mean":
            (grad,) = torch.autograd.grad(loss, logp)
            g = -1 / 5 if trained else -1 / 2
            torch.testing.assert_close(grad, torch.tensor([[g, g, 0.0], [0.0, 0.0, 0.0]]))


def test_mask_accepted_denominators_on_shards_sum_to_the_whole():
    logp, mu, mask, adv = _inputs()
    prox = logp.clone()
    prox[1, 0] = mu[1, 0]  # row 1's first token accepted too: 3 accepted tokens
    stale = torch.zeros_like(mask)
    for agg in ("token_mean", "seq_mean_token_mean"):
        cfg = LearnerConfig(correction="mask", mask_low=0.7, mask_high=1.5, loss_agg=agg,
                            mask_denominator="accepted")
        whole, _ = policy_loss(logp, mu, prox, adv, mask, stale, cfg, 3)
        norm = LossNorm(tokens=5.0, rows=2, accepted=3.0)
        shares = [policy_loss(logp[i:i + 1], mu[i:i + 1], prox[i:i + 1], adv[i:i + 1],
                              mask[i:i + 1], stale[i:i + 1], cfg, 3, norm)[0] for i in range(2)]
        assert sum(s.item() for s in shares) == pytest.approx(whole.item(), rel=1e-6), agg
        with pytest.raises(ValueError, match="mask_denominator=accepted"):
            policy_loss(logp[:1], mu[:1], prox[:1], adv[:1], mask[:1], stale[:1], cfg, 3,
                        LossNorm(tokens=5.0, rows=2))
