"""The RL objective: advantages, off-policy corrections, PPO clipping, loss aggregation.

Pure tensor functions, no model and no backend: the single-process and FSDP2 backends share them.
Notation per token: pi_theta (being trained), pi_prox (the learner's weights at the start of the
step, recomputed), mu (behavior: the logprob the actor's engine sampled with).

  none       ratio pi_theta/mu, PPO-clipped; weight 1.
  tis        truncated IS policy gradient: weight min(pi_prox/mu, C) times the unclipped
             ratio pi_theta/pi_prox (no PPO clip; truncation is the only guard).
  decoupled  AReaL's decoupled PPO: clip on pi_theta/pi_prox, weight min(pi_prox/mu, C).
  mask       clip on pi_theta/pi_prox; tokens (or sequences) whose pi_prox/mu leaves
             [mask_low, mask_high] get weight 0.
Weights can be token- or sequence-level and are multiplied by staleness_decay**staleness.

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

    @classmethod
    def of(cls, mask: torch.Tensor) -> LossNorm:
        """The counts of a whole minibatch held by one process (mask: (rows, tokens))."""
        return cls(tokens=float(mask.sum()), rows=mask.shape[0])


def policy_loss(logp: torch.Tensor, behavior: torch.Tensor, prox: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, staleness: torch.Tensor,
                cfg: LearnerConfig, max_new_tokens: int,
                norm: LossNorm | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped policy loss.

    logp, behavior, prox, mask, staleness: (batch, tokens); advantages: (batch,).
    Returns the scalar loss and detached statistics (means over masked tokens). With `norm`
    (a data-parallel shard) both are this shard's share of the minibatch's values: sum them
    over ranks (`is_weight_max`: take the max); without it the rows are the whole minibatch."""
    norm = LossNorm.of(mask) if norm is None else norm
    adv = advantages[:, None]
    with torch.no_grad():
        log_w = (prox - behavior) * mask
        if cfg.is_level == "sequence":
            log_w = log_w.sum(dim=1, keepdim=True).expand_as(mask)
        raw_w = torch.exp(log_w)
        if cfg.correction in ("tis", "decoupled"):
            weight = raw_w.clamp(max=cfg.is_cap)
        elif cfg.correction == "mask":
            weight = ((raw_w >= cfg.mask_low) & (raw_w <= cfg.mask_high)).float()
        else:
            weight = torch.ones_like(raw_w)
        if cfg.staleness_decay != 1.0:
            weight = weight * cfg.staleness_decay ** staleness.float()
    anchor = behavior if cfg.correction == "none" else prox
    ratio = torch.exp(logp - anchor)
    if cfg.correction == "tis":
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
    loss = aggregate(token_loss, mask, cfg.loss_agg, max_new_tokens, norm)
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
        }
    return loss, stats


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
