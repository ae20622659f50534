"""The RL objective: advantages, off-policy corrections, PPO clipping, loss aggregation.

Pure tensor functions, no model and no backend: the single-process and FSDP2 backends share them.
Notation per token: pi_theta (being trained), pi_prox (the learner's weights at the start of the
step, recomputed), mu (behavior: the logprob the actor's engine sampled with).

  none       ratio pi_theta/mu, PPO-clipped; weight 1.
  tis        truncated IS policy gradient: weight min(pi_prox/mu, C) times the unclipped
             ratio pi_theta/pi_prox (no PPO clip; truncation is the only guard).
  decoupled  AReaL's decoupled PPO: clip on pi_theta/pi_prox, weight min(pi_prox/mu, C).
  mask       clip on pi_theta/pi_prox; tokens (or sequences) whose pi_prox/mu leaves
             [mask_low, mask_high] get weight 0 and still count in the loss's denominators
             (`mask_denominator=trained`), or leave them (`accepted`: verl's rejection sampling).
Weights can be token- or sequence-level and are multiplied by staleness_decay**staleness.

The surrogate: `ratio_level=sequence` clips GSPO's length-normalised sequence ratio instead of
the token ratio (its GSPO-token form whenever advantages or weights can vary within a sample:
`gspo_ratio`); `policy_loss=cispo` replaces the clipped surrogate by CISPO's REINFORCE term
with a clipped stop-gradient ratio weight. Optional terms: the KL to a frozen reference policy
(`kl_estimator`, weight `kl_coef`) and an entropy bonus (`entropy_coef`). The critic's clipped
value loss is `value_loss`. Advantage estimators live in learner/algo/advantages.py.

Data parallelism: a rank that holds only part of a minibatch passes the minibatch's `LossNorm`;
its loss and statistics are then its share of the minibatch's (sums over its tokens divided by
the global counts), and the shares summed over ranks equal the single-process values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from configs.schema import LearnerConfig


def group_advantages(rewards: torch.Tensor, kind: str) -> torch.Tensor:
    """rewards: (groups, n) -> advantages of the same shape."""
    mean = rewards.mean(dim=1, keepdim=True)
    if kind == "grpo":
        return (rewards - mean) / (rewards.std(dim=1, keepdim=True) + 1e-6)
    if kind == "drgrpo":
        return rewards - mean
    if kind == "rloo":
        n = rewards.shape[1]
        return (rewards - mean) * n / (n - 1)
    raise ValueError(f"unknown advantage estimator {kind!r}")


@dataclass(frozen=True)
class LossNorm:
    """The denominators of a whole minibatch, for a rank that holds only part of it."""

    tokens: float
    """Masked (trained-on) tokens in the whole minibatch (token_mean, statistics)."""
    rows: int
    """Sequences in the whole minibatch (seq_mean_token_mean, constant)."""
    accepted: float | None = None
    """Tokens the mask correction accepted in the whole minibatch (`mask_denominator=accepted`,
    the policy loss's token_mean); None: counted from the rows at hand."""

    @classmethod
    def of(cls, mask: torch.Tensor) -> LossNorm:
        """The counts of a whole minibatch held by one process (mask: (rows, tokens))."""
        return cls(tokens=float(mask.sum()), rows=mask.shape[0])


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating
    KL divergence"), with log r = ref - logp: k1 = -log r, k2 = (log r)^2 / 2,
    k3 = r - 1 - log r; low_var_kl is k3 with log r clamped to [-20, 20] and the result to
    [-10, 10] (verl's convention)."""
    log_r = ref - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    if kind == "low_var_kl":
        log_r = log_r.clamp(-20.0, 20.0)
        return (torch.exp(log_r) - 1 - log_r).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, clip: float, agg: str, max_new_tokens: int,
               norm: LossNorm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, 1/2 max((V - R)^2, (clip(V, V_old +- clip) - R)^2) per token
    (clip 0: 1/2 (V - R)^2), aggregated like the policy loss; all tensors (rows, tokens)."""
    norm = LossNorm.of(mask) if norm is None else norm
    err = (values - returns).square()
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_c = (clipped - returns).square()
        frac = ((err_c > err).float() * mask).sum() / max(norm.tokens, 1.0)
        err = torch.maximum(err, err_c)
    else:
        frac = torch.zeros(())
    loss = aggregate(0.5 * err, mask, agg, max_new_tokens, norm)
    n = max(norm.tokens, 1.0)
    with torch.no_grad():
        stats = {"value_loss": loss.detach(), "value_clip_frac": frac.detach(),
                 "value_mean": (values.detach() * mask).sum() / n,
                 "return_mean": (returns * mask).sum() / n}
    return loss, stats


def policy_loss(logp: torch.Tensor, behavior: torch.Tensor, prox: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor,
                cfg: LearnerConfig, max_new_tokens: int,
                norm: LossNorm | None = None, ref: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped policy loss (or GSPO's sequence-level, or CISPO's), plus the
    reference KL (`ref`: the reference policy's logprobs, when cfg.kl_in is loss) and the
    entropy bonus (`entropy`: the policy's per-token entropy, logged as well).

    logp, behavior, prox, mask, staleness: (batch, tokens); advantages: (batch,) or
    (batch, tokens). Returns the scalar loss and detached statistics (means over masked
    tokens). With `norm` (a data-parallel shard) both are this shard's share of the
    minibatch's values: sum them over ranks (`is_weight_max`: take the max); without it the
    rows are the whole minibatch. With `mask_denominator=accepted` the loss's terms count only
    the accepted tokens (a shard's `norm.accepted` must be set); the statistics still average
    over every trained token."""
    shard = norm is not None
    norm = LossNorm.of(mask) if norm is None else norm
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    with torch.no_grad():
        raw_w = torch.exp(_log_is_weights(prox, behavior, mask, cfg))
        if cfg.correction in ("tis", "decoupled"):
            weight = raw_w.clamp(max=cfg.is_cap)
        elif cfg.correction == "mask":
            weight = _in_range(raw_w, cfg)
        else:
            weight = torch.ones_like(raw_w)
        if cfg.staleness_decay != 1.0:
            weight = weight * cfg.staleness_decay ** staleness.float()
    anchor = behavior if cfg.correction == "none" else prox
    if cfg.ratio_level == "sequence":
        per_sample = (advantages.dim() == 1 and cfg.staleness_decay == 1.0
                      and (cfg.correction == "none" or cfg.is_level == "sequence"))
        ratio = gspo_ratio(logp, anchor, mask, token_grad=not per_sample)
    else:
        ratio = torch.exp(logp - anchor)
    if cfg.policy_loss == "cispo":
        bounded = ratio.detach().clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        pg = -adv * bounded * logp
        clipped = bounded != ratio.detach()
    elif cfg.correction == "tis":
        pg = -adv * ratio
        clipped = torch.zeros_like(mask, dtype=torch.bool)
    else:
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        pg = torch.maximum(pg1, pg2)
        clipped = pg2 > pg1
        if cfg.dual_clip:
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * cfg.dual_clip), pg)
    token_loss = pg * weight
    loss_mask, loss_norm = mask, norm
    if cfg.correction == "mask" and cfg.mask_denominator == "accepted":
        if shard and norm.accepted is None:
            raise ValueError("learner.mask_denominator=accepted on a data-parallel shard needs "
                             "the minibatch's accepted token count (LossNorm.accepted)")
        loss_mask = mask * _in_range(raw_w, cfg)
        kept = float(loss_mask.sum()) if norm.accepted is None else norm.accepted
        loss_norm = LossNorm(tokens=kept, rows=norm.rows)
    loss = aggregate(token_loss, loss_mask, cfg.loss_agg, max_new_tokens, loss_norm)
    extra: dict[str, torch.Tensor] = {}
    if ref is not None:
        kl = kl_estimate(logp, ref, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * aggregate(kl, loss_mask, cfg.loss_agg, max_new_tokens,
                                              loss_norm)
        extra["kl_ref"] = (kl.detach() * mask).sum() / max(norm.tokens, 1.0)
    if entropy is not None:
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * aggregate(entropy, loss_mask, cfg.loss_agg,
                                                       max_new_tokens, loss_norm)
        extra["entropy"] = (entropy.detach() * mask).sum() / max(norm.tokens, 1.0)
    with torch.no_grad():
        n = max(norm.tokens, 1.0)
        r = torch.exp(prox - behavior)
        stats = {
            "clip_frac": (clipped.float() * mask).sum() / n,
            "is_weight_mean": (weight * mask).sum() / n,
            "is_weight_max": (weight * mask).max(),
            "is_truncated_frac": ((raw_w > cfg.is_cap).float() * mask).sum() / n
            if cfg.correction in ("tis", "decoupled") else torch.zeros(()),
            "masked_frac": ((weight == 0).float() * mask).sum() / n,
            "kl_behavior_prox_k3": ((r - 1 - (prox - behavior)) * mask).sum() / n,
            "ratio_mean": (ratio.detach() * mask).sum() / n,
            # Kish ESS / n of the raw weights pi_prox/mu = ess_w ^ 2 / ess_w2 (learner/algo/trainer.py)
            "ess_w": (raw_w * mask).sum() / n,
            "ess_w2": (raw_w.square() * mask).sum() / n,
            **extra,
        }
    return loss, stats


def gspo_ratio(logp: torch.Tensor, anchor: torch.Tensor, mask: torch.Tensor,
               token_grad: bool) -> torch.Tensor:
    """GSPO's length-normalised sequence ratio s_i on every token of row i (Zheng et al. 2025,
    eq. 7). token_grad: GSPO-token's s_it = sg[s_i] pi_theta(y_t) / sg[pi_theta(y_t)] (eq. 14),
    the same value, but token t's gradient is s_i grad log pi_theta(y_t), so its own advantage
    and weight reach it; otherwise s_i's own gradient, which gives every token 1/|y_i| of the
    row's sum. The two gradients are equal when advantage and weight are constant in the row."""
    log_s = _sequence_mean((logp - anchor) * mask, mask)
    if token_grad:
        return torch.exp(log_s.detach() + (logp - logp.detach()))
    return torch.exp(log_s).expand_as(mask)


def accepted_tokens(prox: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor,
                    cfg: LearnerConfig) -> torch.Tensor:
    """The mask correction's accepted trained tokens of these rows (a scalar): those whose
    pi_prox/mu (token, or the sample's with is_level=sequence) lies in [mask_low, mask_high]."""
    return (_in_range(torch.exp(_log_is_weights(prox, behavior, mask, cfg)), cfg) * mask).sum()


def _log_is_weights(prox: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor,
                    cfg: LearnerConfig) -> torch.Tensor:
    """log pi_prox/mu per token, or the sample's sum on each of its tokens (is_level=sequence)."""
    log_w = (prox - behavior) * mask
    if cfg.is_level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(mask)
    return log_w


def _in_range(w: torch.Tensor, cfg: LearnerConfig) -> torch.Tensor:
    """1.0 where the weight lies in [mask_low, mask_high], else 0.0."""
    return ((w >= cfg.mask_low) & (w <= cfg.mask_high)).float()


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean over masked tokens, (rows, 1)."""
    return x.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, kind: str, max_new_tokens: int,
              norm: LossNorm) -> torch.Tensor:
    """This rows' share of the minibatch loss that `norm` describes: sums over these rows
    divided by the whole minibatch's counts. A single process passes its whole minibatch's
    counts (`LossNorm.of`), so its share is the loss."""
    if kind == "token_mean":
        return (token_loss * mask).sum() / max(norm.tokens, 1.0)
    if kind == "seq_mean_token_mean":
        per_seq = (token_loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / norm.rows
    if kind == "constant":
        return (token_loss * mask).sum() / (norm.rows * max_new_tokens)
    raise ValueError(f"unknown loss aggregation {kind!r}")
