"""Token-level advantage estimators and reward shaping, beside the group estimators
(grpo / drgrpo / rloo: learner/algo/loss.py `group_advantages`).

Pure functions on the trainer's padded (rows, tokens) tensors. A row's trained tokens are its
mask-1 columns; tokens with mask 0 (prompt, padding, tool output) are skipped by every
recursion, so "the next token" of a trained token is the next trained token of its row, and
after the last one the episode has ended (value 0). The sequence reward sits on the last
trained token; a reference KL in the reward (`kl_in: reward`) is a per-token penalty.

  reinforce_pp  REINFORCE++ (Hu 2025): discounted return per token, normalised over the
                minibatch's trained tokens (mean and std through `reduce`, so a data-parallel
                shard normalises with the whole minibatch's statistics); the std is the
                population one (OpenRLHF) or Bessel-corrected (verl), `reinforce_pp_std`.
  gae           GAE (Schulman et al. 2016) from the critic's values at step start.
  vtrace        V-trace (Espeholt et al. 2018) targets and advantages from rho = pi_prox / mu;
                with rho = 1 (on-policy, rho-bar and c-bar >= 1) it is gae with lambda = 1.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from buffer.record import TrajGroup
from configs.schema import TetherConfig, max_completion_tokens


def is_uniform(rewards: np.ndarray) -> bool:
    """Every sample got the same reward: a zero group-relative advantage (DAPO's filter)."""
    return bool(np.all(rewards == rewards[0]))


def overlong_penalty(lengths: np.ndarray, budget: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), scaled by `penalty`:
    0 up to budget - buffer tokens, then falling linearly to -penalty at the budget."""
    over = np.asarray(lengths, np.float64) - (budget - buffer)
    return (-penalty * np.clip(over / max(buffer, 1), 0.0, 1.0)).astype(np.float32)


def shape_groups(groups: list[TrajGroup], cfg: TetherConfig,
                 eos_id: int | None) -> list[TrajGroup]:
    """The groups as trained on: overlong penalty added to the rewards, and with
    `mask_truncated` the loss masks of truncated samples (the whole budget, no eos) zeroed.
    Returns `groups` itself when both are off."""
    T, L = cfg.task, cfg.learner
    if not T.overlong_buffer and not L.mask_truncated:
        return groups
    if L.mask_truncated and eos_id is None:
        raise ValueError("learner.mask_truncated needs the tokenizer's eos token id")
    budget = max_completion_tokens(cfg)
    out = []
    for g in groups:
        rewards, masks = g.rewards, g.loss_masks
        if T.overlong_buffer:
            lengths = np.array([len(c) for c in g.completions])
            rewards = rewards + overlong_penalty(lengths, budget, T.overlong_buffer,
                                                 T.overlong_penalty)
        if L.mask_truncated:
            masks = [m * 0 if len(c) >= budget and c[-1] != eos_id else m
                     for c, m in zip(g.completions, masks)]
        out.append(dataclasses.replace(g, rewards=rewards, loss_masks=masks))
    return out


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """(rows, tokens) one-hot of each row's last trained column (all zero for a row with none)."""
    cols = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, cols, -1).max(dim=1, keepdim=True).values
    return ((cols == last) & (last >= 0)).to(mask.dtype)


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor,
                  kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """rewards (rows,) on each row's last trained token, minus `kl_penalty` (rows, tokens;
    already multiplied by kl_coef) on every trained token."""
    r = last_token(mask) * rewards[:, None]
    if kl_penalty is not None:
        r = r - kl_penalty * mask
    return r


def discounted_returns(r: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum over the row's later trained tokens s >= t of gamma^(s-t) r_s."""
    out = torch.zeros_like(r)
    nxt = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        m = mask[:, t] > 0
        g = r[:, t] + gamma * nxt
        out[:, t] = torch.where(m, g, 0.0)
        nxt = torch.where(m, g, nxt)
    return out


def reinforce_pp(r: torch.Tensor, mask: torch.Tensor, gamma: float, tokens: float,
                 reduce: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                 std: str = "population") -> torch.Tensor:
    """REINFORCE++ advantages: returns normalised by their mean and std over the trained
    tokens of the whole minibatch (`tokens` of them; `reduce` sums shares over ranks).
    std: population (divides the squared deviations by n, as OpenRLHF does) | bessel (by
    n - 1, verl's `masked_whiten`): the bessel advantages are the population ones times
    sqrt((n - 1) / n)."""
    g = discounted_returns(r, mask, gamma)
    s = reduce({"sum": (g * mask).sum() / tokens, "sq": (g.square() * mask).sum() / tokens})
    mean, sq = s["sum"].to(g.device), s["sq"].to(g.device)
    var = (sq - mean.square()).clamp(min=0)
    if std == "bessel":
        var = var * (tokens / max(tokens - 1.0, 1.0))
    return (g - mean) / (var.sqrt() + 1e-8) * mask


def gae(r: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: A_t = delta_t + gamma lam A_{t+1}, delta_t = r_t + gamma V_{t+1} - V_t over the
    row's trained tokens (V after the last = 0). Returns (advantages, returns = A + V)."""
    adv = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])
    next_a = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        m = mask[:, t] > 0
        a = r[:, t] + gamma * next_v - values[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(m, a, 0.0)
        next_v = torch.where(m, values[:, t], next_v)
        next_a = torch.where(m, a, next_a)
    return adv, (adv + values) * mask


def vtrace(r: torch.Tensor, values: torch.Tensor, log_rho: torch.Tensor, mask: torch.Tensor,
           gamma: float, rho_bar: float, c_bar: float) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace: targets v_s = V_s + delta_s + gamma c_s (v_{s+1} - V_{s+1}) with
    delta_s = rho_s (r_s + gamma V_{s+1} - V_s), rho_s = min(rho_bar, pi/mu),
    c_s = min(c_bar, pi/mu); advantages rho_s (r_s + gamma v_{s+1} - V_s).
    Returns (advantages, targets)."""
    ratio = torch.exp(log_rho)
    rho, c = ratio.clamp(max=rho_bar), ratio.clamp(max=c_bar)
    adv = torch.zeros_like(r)
    target = torch.zeros_like(r)
    next_v = torch.zeros_like(r[:, 0])       # V_{s+1}
    next_target = torch.zeros_like(r[:, 0])  # v_{s+1}
    next_diff = torch.zeros_like(r[:, 0])    # v_{s+1} - V_{s+1}
    for t in reversed(range(r.shape[1])):
        m = mask[:, t] > 0
        v = values[:, t]
        diff = rho[:, t] * (r[:, t] + gamma * next_v - v) + gamma * c[:, t] * next_diff
        adv[:, t] = torch.where(m, rho[:, t] * (r[:, t] + gamma * next_target - v), 0.0)
        target[:, t] = torch.where(m, v + diff, 0.0)
        next_v = torch.where(m, v, next_v)
        next_target = torch.where(m, v + diff, next_target)
        next_diff = torch.where(m, diff, next_diff)
    return adv, target
