"""Each estimator and loss equals a direct transcription of its paper's formula on random inputs.

The transcriptions below loop over one unpadded sequence at a time, in the papers' notation;
Tether's functions run on padded (rows, tokens) tensors whose rows have different lengths and
untrained (mask 0) tokens in the middle, like tool output in multi-turn rollouts: the
recursions must skip those and stop at each row's end.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from configs.schema import LearnerConfig
from learner.algo import advantages as A
from learner.algo.loss import LossNorm, group_advantages, kl_estimate, policy_loss, value_loss

TOL = 1e-6


def _batch(seed: int, rows: int = 5, width: int = 9):
    """Random padded rows: a mask with holes, rewards, values, log-ratios."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    for i in range(rows):
        start, end = int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(5, width + 1, (1,), generator=g))
        mask[i, start:end] = 1.0
        if end - start > 3:
            mask[i, start + 2] = 0.0  # a tool token in the middle
    return dict(mask=mask, reward=torch.rand(rows, generator=g),
                r=torch.randn(rows, width, generator=g) * mask,
                values=torch.randn(rows, width, generator=g) * mask,
                log_rho=0.5 * torch.randn(rows, width, generator=g) * mask)


def _trained(x: torch.Tensor, mask: torch.Tensor, i: int) -> list[float]:
    return x[i][mask[i] > 0].double().tolist()


def _scatter(values: list[float], mask: torch.Tensor, i: int) -> torch.Tensor:
    out = torch.zeros(mask.shape[1], dtype=torch.float64)
    out[mask[i] > 0] = torch.tensor(values, dtype=torch.float64)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_equals_schulman_2016_eq16(seed, gamma, lam):
    """GAE paper (Schulman et al. 2016), eq. 16: A_t = sum_l (gamma lam)^l delta_{t+l},
    delta_t = r_t + gamma V(s_{t+1}) - V(s_t), V = 0 after the episode ends."""
    b = _batch(seed)
    adv, ret = A.gae(b["r"], b["values"], b["mask"], gamma, lam)
    for i in range(len(b["mask"])):
        r, v = _trained(b["r"], b["mask"], i), _trained(b["values"], b["mask"], i)
        v_next = v[1:] + [0.0]
        delta = [r[t] + gamma * v_next[t] - v[t] for t in range(len(r))]
        want = [sum((gamma * lam) ** l * delta[t + l] for l in range(len(r) - t))
                for t in range(len(r))]
        torch.testing.assert_close(adv[i].double(), _scatter(want, b["mask"], i), atol=TOL, rtol=0)
        torch.testing.assert_close(ret[i].double(), _scatter([a + x for a, x in zip(want, v)],
                                                             b["mask"], i), atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_vtrace_equals_espeholt_2018_eq1(seed):
    """IMPALA (Espeholt et al. 2018), eq. 1: v_s = V(x_s) + sum_{t>=s} gamma^(t-s)
    (prod_{i=s}^{t-1} c_i) delta_t V, delta_t V = rho_t (r_t + gamma V(x_{t+1}) - V(x_t)),
    rho_t = min(rho_bar, pi/mu), c_i = min(c_bar, pi/mu); the policy-gradient advantage of
    Sec. 4.2 is rho_s (r_s + gamma v_{s+1} - V(x_s))."""
    b = _batch(seed)
    gamma, rho_bar, c_bar = 0.97, 1.2, 0.9
    adv, target = A.vtrace(b["r"], b["values"], b["log_rho"], b["mask"], gamma, rho_bar, c_bar)
    for i in range(len(b["mask"])):
        r, v = _trained(b["r"], b["mask"], i), _trained(b["values"], b["mask"], i)
        ratio = [math.exp(x) for x in _trained(b["log_rho"], b["mask"], i)]
        rho, c = [min(rho_bar, x) for x in ratio], [min(c_bar, x) for x in ratio]
        n, v_next = len(r), v[1:] + [0.0]
        delta = [rho[t] * (r[t] + gamma * v_next[t] - v[t]) for t in range(n)]
        vs = [v[s] + sum(gamma ** (t - s) * math.prod(c[s:t]) * delta[t] for t in range(s, n))
              for s in range(n)]
        vs_next = vs[1:] + [0.0]
        want_adv = [rho[s] * (r[s] + gamma * vs_next[s] - v[s]) for s in range(n)]
        torch.testing.assert_close(target[i].double(), _scatter(vs, b["mask"], i), atol=TOL, rtol=0)
        torch.testing.assert_close(adv[i].double(), _scatter(want_adv, b["mask"], i), atol=TOL, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_vtrace_on_policy_equals_gae_lambda_1(seed):
    """Espeholt et al. 2018, Sec. 4.1: with pi = mu (and rho_bar, c_bar >= 1) the V-trace
    target is the n-step Bellman target, i.e. GAE's return with lambda = 1."""
    b = _batch(seed)
    adv_v, target = A.vtrace(b["r"], b["values"], torch.zeros_like(b["r"]), b["mask"], 0.95, 1.0, 1.0)
    adv_g, ret = A.gae(b["r"], b["values"], b["mask"], 0.95, 1.0)
    assert (target - ret).abs().max().item() <= TOL
    assert (adv_v - adv_g).abs().max().item() <= TOL


def test_grpo_equals_shao_2024_outcome_supervision():
    """DeepSeekMath (Shao et al. 2024), Sec. 4.1.2 outcome supervision:
    A_i = (r_i - mean(r)) / std(r) for every token of output i (std: the sample std, as in
    the reference implementations; Tether adds 1e-6 to the denominator)."""
    rewards = torch.rand(6, 8, generator=torch.Generator().manual_seed(0))
    got = group_advantages(rewards, "grpo")
    for g, row in enumerate(rewards.double().tolist()):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / (len(row) - 1))
        want = torch.tensor([(x - mean) / (std + 1e-6) for x in row], dtype=torch.float64)
        torch.testing.assert_close(got[g].double(), want, atol=1e-5, rtol=0)


def test_rloo_equals_ahmadian_2024_leave_one_out():
    """RLOO (Ahmadian et al. 2024, Sec. 3.2, after Kool et al. 2019): the baseline of sample i
    is the mean reward of the other k - 1 samples: A_i = r_i - 1/(k-1) sum_{j != i} r_j."""
    rewards = torch.rand(4, 5, generator=torch.Generator().manual_seed(1))
    got = group_advantages(rewards, "rloo")
    for g, row in enumerate(rewards.double().tolist()):
        k = len(row)
        want = [row[i] - sum(row[j] for j in range(k) if j != i) / (k - 1) for i in range(k)]
        torch.testing.assert_close(got[g].double(), torch.tensor(want, dtype=torch.float64),
                                   atol=TOL, rtol=0)


def test_reinforce_pp_equals_hu_2025():
    """REINFORCE++ (Hu 2025, Sec. 3): token reward r_t = 1[t = last] r(x, y) - beta KL_t,
    return A_t = sum_{i>=t} gamma^(i-t) r_i, normalised over every token of the batch:
    (A - mean) / std."""
    b = _batch(2)
    gamma, beta = 0.99, 0.05
    kl = torch.rand_like(b["r"]) * b["mask"]
    r = A.token_rewards(b["reward"], b["mask"], beta * kl)
    got = A.reinforce_pp(r, b["mask"], gamma, float(b["mask"].sum()), lambda s: s)
    returns = []
    for i in range(len(b["mask"])):
        k = _trained(kl, b["mask"], i)
        n = len(k)
        rew = [(b["reward"][i].item() if t == n - 1 else 0.0) - beta * k[t] for t in range(n)]
        returns.append([sum(gamma ** (j - t) * rew[j] for j in range(t, n)) for t in range(n)])
    flat = [x for row in returns for x in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    for i, row in enumerate(returns):
        want = _scatter([(x - mean) / (std + 1e-8) for x in row], b["mask"], i)
        torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=0)


def _policy_inputs(seed: int):
    b = _batch(seed, rows=4)
    g = torch.Generator().manual_seed(100 + seed)
    mask = b["mask"]
    behavior = torch.log(torch.rand(mask.shape, generator=g) * 0.9 + 0.05) * mask
    logp = (behavior + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    adv = torch.randn(mask.shape[0], generator=g)
    return logp, behavior, adv, mask


@pytest.mark.parametrize("seed", range(3))
def test_gspo_equals_zheng_2025(seed):
    """GSPO (Zheng et al. 2025, eqs. 5-7): J = 1/G sum_i min(s_i A_i, clip(s_i, 1-eps, 1+eps) A_i),
    s_i = (pi_theta(y_i|x) / pi_old(y_i|x))^(1/|y_i|); loss = -J (Tether: seq_mean_token_mean)."""
    logp, behavior, adv, mask = _policy_inputs(seed)
    cfg = LearnerConfig(correction="none", ratio_level="sequence", loss_agg="seq_mean_token_mean",
                        clip_low=0.1, clip_high=0.15)
    loss, _ = policy_loss(logp, behavior, behavior, adv, mask, torch.zeros_like(mask), cfg, 9)
    terms = []
    for i in range(len(mask)):
        lp, mu = _trained(logp, mask, i), _trained(behavior, mask, i)
        s = math.exp((sum(lp) - sum(mu)) / len(lp))
        a = adv[i].item()
        terms.append(min(s * a, min(max(s, 0.9), 1.15) * a))
    assert loss.item() == pytest.approx(-sum(terms) / len(terms), abs=TOL)


@pytest.mark.parametrize("seed", range(3))
def test_gspo_token_equals_zheng_2025(seed):
    """GSPO-token (Zheng et al. 2025, eqs. 13-14): J = sum_i sum_t w_it min(s_it A_it,
    clip(s_it) A_it) / N with s_it = sg[s_i] pi_theta(y_it) / sg[pi_theta(y_it)], so the value is
    GSPO's and d(-J)/d log pi_theta(y_it) = -w_it A_it s_i / N where the unclipped term is the
    min, else 0. Token-level advantages and decoupled per-token IS weights w = min(pi_prox/mu, C)
    (Tether: token_mean over N trained tokens, anchor pi_prox)."""
    logp, behavior, _, mask = _policy_inputs(seed)
    g = torch.Generator().manual_seed(200 + seed)
    prox = (behavior + 0.2 * torch.randn(mask.shape, generator=g)) * mask
    adv = torch.randn(mask.shape, generator=g) * mask
    logp = logp.clone().requires_grad_(True)
    cfg = LearnerConfig(correction="decoupled", ratio_level="sequence", is_cap=1.5,
                        clip_low=0.1, clip_high=0.15)
    loss, _ = policy_loss(logp, behavior, prox, adv, mask, torch.zeros_like(mask), cfg, 9)
    loss.backward()
    n = mask.sum().item()
    want, want_grad = 0.0, torch.zeros_like(mask, dtype=torch.float64)
    for i in range(len(mask)):
        lp, px = _trained(logp.detach(), mask, i), _trained(prox, mask, i)
        s = math.exp((sum(lp) - sum(px)) / len(lp))
        cols = torch.nonzero(mask[i]).flatten().tolist()
        for t in cols:
            a = adv[i, t].item()
            w = min(math.exp(prox[i, t].item() - behavior[i, t].item()), 1.5)
            clipped = min(max(s, 0.9), 1.15)
            want += w * min(s * a, clipped * a) / n
            want_grad[i, t] = -w * a * s / n if s * a <= clipped * a else 0.0
    assert loss.item() == pytest.approx(-want, abs=TOL)
    torch.testing.assert_close(logp.grad.double(), want_grad, atol=TOL, rtol=0)


@pytest.mark.parametrize("correction, is_level", [("none", "token"), ("decoupled", "sequence")])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_gspo_sequence_form_equals_gspo_token_for_outcome_advantages(correction, is_level, agg):
    """Zheng et al. 2025 (after eq. 14): with A_it = A_i (and a weight constant in the sample)
    GSPO-token equals GSPO in value, clipping and gradient. One advantage per row uses the
    sequence ratio; the same advantage repeated on every token uses GSPO-token."""
    logp, behavior, adv, mask = _policy_inputs(2)  # sequence ratios 0.80, 0.75, 1.12, 1.10
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(7))
    prox = (behavior + 0.02 * noise) * mask
    cfg = LearnerConfig(correction=correction, is_level=is_level, ratio_level="sequence",
                        loss_agg=agg, clip_low=0.1, clip_high=0.1, is_cap=5.0)
    out = []
    for a in (adv, adv[:, None].expand_as(mask)):
        lp = logp.clone().requires_grad_(True)
        loss, stats = policy_loss(lp, behavior, prox, a, mask, torch.zeros_like(mask), cfg, 9)
        loss.backward()
        out.append((loss.item(), lp.grad, stats["clip_frac"].item()))
    (seq_loss, seq_grad, seq_clip), (tok_loss, tok_grad, tok_clip) = out
    assert 0 < seq_clip < 1 and seq_clip == tok_clip  # some rows clipped, the same ones
    assert seq_loss == tok_loss
    torch.testing.assert_close(tok_grad, seq_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", range(3))
def test_cispo_equals_minimax_2025(seed):
    """CISPO (MiniMax-M1, 2025, Sec. 3.1, eqs. 4-5): J = 1/sum|o_i| sum_i sum_t
    sg(r_hat_it) A_i log pi_theta(o_it), r_hat = clip(r, 1 - eps_low, 1 + eps_high): the
    loss -J and its gradient in log pi_theta, which is -sg(r_hat) A / sum|o_i|."""
    logp, behavior, adv, mask = _policy_inputs(seed)
    logp = logp.clone().requires_grad_(True)
    cfg = LearnerConfig(correction="none", policy_loss="cispo", clip_low=0.5, clip_high=0.28)
    loss, _ = policy_loss(logp, behavior, behavior, adv, mask, torch.zeros_like(mask), cfg, 9)
    loss.backward()
    n = mask.sum().item()
    want, want_grad = 0.0, torch.zeros_like(mask, dtype=torch.float64)
    for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
        r = math.exp(logp[i, t].item() - behavior[i, t].item())
        r_hat = min(max(r, 0.5), 1.28)
        want += r_hat * adv[i].item() * logp[i, t].item() / n
        want_grad[i, t] = -r_hat * adv[i].item() / n
    assert loss.item() == pytest.approx(-want, abs=TOL)
    torch.testing.assert_close(logp.grad.double(), want_grad, atol=TOL, rtol=0)


def test_kl_estimators_equal_schulman_2020():
    """Schulman 2020, "Approximating KL Divergence": for x ~ q = pi and r = p(x)/q(x) with
    p = pi_ref: k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r; low_var_kl is k3 with
    log r clamped to [-20, 20] and the estimate to [-10, 10] (verl's convention)."""
    g = torch.Generator().manual_seed(3)
    logp = torch.log(torch.rand(50, generator=g))
    ref = torch.log(torch.rand(50, generator=g))
    ref[0], ref[1] = logp[0] + 30.0, logp[1] - 30.0  # the clamps matter here
    for kind, f in [("k1", lambda lr: -lr), ("k2", lambda lr: 0.5 * lr * lr),
                    ("k3", lambda lr: math.exp(lr) - 1 - lr),
                    ("low_var_kl", lambda lr: min(max(math.exp(min(max(lr, -20), 20)) - 1
                                                      - min(max(lr, -20), 20), -10), 10))]:
        got = kl_estimate(logp, ref, kind)
        want = [f(b - a) for a, b in zip(logp.double().tolist(), ref.double().tolist())]
        torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5, msg=kind)
    assert kl_estimate(logp, ref, "low_var_kl")[0].item() == 10.0


@pytest.mark.parametrize("clip", [0.0, 0.2])
def test_value_loss_equals_clipped_value_objective(clip):
    """PPO's clipped value loss (OpenAI baselines ppo2, as written in Engstrom et al. 2020,
    "Implementation Matters in Deep Policy Gradients", Sec. 3 "value function clipping"):
    L_V = 1/2 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2), token mean."""
    b = _batch(4)
    mask = b["mask"]
    old = b["values"]
    values = old + 0.5 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(9)) * mask
    returns = b["r"]
    loss, _ = value_loss(values, old, returns, mask, clip, "token_mean", 9)
    total = 0.0
    for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
        v, vo, R = values[i, t].item(), old[i, t].item(), returns[i, t].item()
        err = (v - R) ** 2
        if clip:
            err = max(err, (min(max(v, vo - clip), vo + clip) - R) ** 2)
        total += 0.5 * err
    assert loss.item() == pytest.approx(total / mask.sum().item(), abs=TOL)


def test_overlong_penalty_equals_dapo_eq13():
    """DAPO (Yu et al. 2025), eq. 13: R = 0 for |y| <= L_max - L_cache,
    ((L_max - L_cache) - |y|) / L_cache up to L_max, -1 beyond (times the penalty)."""
    L_max, L_cache = 10, 4
    lengths = np.arange(0, 13)
    want = [0.0 if y <= L_max - L_cache else ((L_max - L_cache) - y) / L_cache if y <= L_max
            else -1.0 for y in lengths]
    np.testing.assert_allclose(A.overlong_penalty(lengths, L_max, L_cache, 0.5),
                               0.5 * np.array(want), atol=TOL)


def test_ess_is_kish_effective_sample_size():
    """Kish ESS / n = (sum w)^2 / (n sum w^2) of the raw weights pi_prox/mu over trained
    tokens; 1 when every weight is equal."""
    logp, behavior, adv, mask = _policy_inputs(0)
    prox = (behavior + 0.4 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))) * mask
    _, stats = policy_loss(logp, behavior, prox, adv, mask, torch.zeros_like(mask),
                           LearnerConfig(correction="decoupled"), 9)
    w = torch.exp(prox - behavior)[mask > 0].double()
    want = w.sum() ** 2 / (len(w) * (w * w).sum())
    assert (stats["ess_w"] ** 2 / stats["ess_w2"]).item() == pytest.approx(want.item(), rel=1e-5)
    _, same = policy_loss(logp, behavior, behavior, adv, mask, torch.zeros_like(mask),
                          LearnerConfig(correction="decoupled"), 9)
    assert (same["ess_w"] ** 2 / same["ess_w2"]).item() == pytest.approx(1.0)


def test_entropy_bonus_and_reference_kl_enter_the_loss():
    """The loss = surrogate + kl_coef * mean KL - entropy_coef * mean entropy, and a shard's
    loss with the minibatch's LossNorm is its share (the shares add up)."""
    logp, behavior, adv, mask = _policy_inputs(1)
    ref = behavior - 0.2 * mask
    entropy = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2))
    base = LearnerConfig(correction="none")
    plain, _ = policy_loss(logp, behavior, behavior, adv, mask, torch.zeros_like(mask), base, 9)
    cfg = LearnerConfig(correction="none", kl_coef=0.3, kl_estimator="k3", entropy_coef=0.01)
    full, stats = policy_loss(logp, behavior, behavior, adv, mask, torch.zeros_like(mask), cfg, 9,
                              ref=ref, entropy=entropy)
    n = mask.sum()
    kl = ((kl_estimate(logp, ref, "k3") * mask).sum() / n).item()
    ent = ((entropy * mask).sum() / n).item()
    assert full.item() == pytest.approx(plain.item() + 0.3 * kl - 0.01 * ent, abs=TOL)
    assert stats["kl_ref"].item() == pytest.approx(kl, abs=TOL)
    assert stats["entropy"].item() == pytest.approx(ent, abs=TOL)
    norm = LossNorm.of(mask)
    halves = [policy_loss(logp[s], behavior[s], behavior[s], adv[s], mask[s],
                          torch.zeros_like(mask[s]), cfg, 9, norm, ref=ref[s], entropy=entropy[s])[0]
              for s in (slice(0, 2), slice(2, 4))]
    assert sum(h.item() for h in halves) == pytest.approx(full.item(), abs=TOL)


def test_shape_groups_masks_truncated_and_penalises_overlong():
    from configs.loader import load_config
    from helpers import make_group
    import procs

    cfg = load_config(procs.PRESET, ["task.max_new_tokens=3", "task.overlong_buffer=2",
                                     "task.overlong_penalty=1.0", "learner.mask_truncated=true"])
    g = make_group(0, 0, n=2, tokens=3, rewards=[1.0, 0.5])  # 3 tokens of id 6: no eos
    eos = 2
    ended = A.dataclasses.replace(g, completions=[g.completions[0],
                                                   np.array([6, 6, eos], np.int64)])
    (out,) = A.shape_groups([ended], cfg, eos)
    np.testing.assert_allclose(out.rewards, [0.0, -0.5])  # both used all 3 tokens: -1 each
    assert out.loss_masks[0].sum() == 0 and out.loss_masks[1].sum() == 3  # only the eos one trains
    with pytest.raises(ValueError, match="eos"):
        A.shape_groups([g], cfg, None)
