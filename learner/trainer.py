"""One RL training step on a batch of groups: the algorithm, independent of the backend.

    groups -> collate -> pi_prox (no grad, weights at step start) -> for each epoch and
    minibatch: pi_theta -> policy_loss -> backend.step

`max_staleness = 0` runs exactly this code; the only difference from a synchronous PPO loop is
where the groups came from, which is what tests/test_sync_equivalence.py checks bitwise.
"""

from __future__ import annotations

import numpy as np
import torch

from buffer.replay import TrajGroup
from configs.schema import TetherConfig, max_completion_tokens
from learner.batch import TokenBatch, collate
from learner.loss import group_advantages, policy_loss


class Trainer:
    def __init__(self, cfg: TetherConfig, backend, pad_id: int) -> None:
        self.cfg = cfg
        self.lcfg = cfg.learner
        self.backend = backend
        self.pad_id = pad_id

    def step(self, groups: list[TrajGroup], version: int) -> dict[str, float]:
        """Train on `groups` at policy `version`; returns this step's metrics."""
        L, T = self.lcfg, self.cfg.task.temperature
        per_mb = len(groups) // L.minibatches
        minibatches = [collate(groups[i:i + per_mb], self.pad_id)
                       for i in range(0, len(groups), per_mb)]
        with torch.no_grad():
            proxes = [self.backend.logprobs(mb.input_ids, T) for mb in minibatches]
        sums: dict[str, float] = {}
        count = 0
        for _ in range(L.epochs):
            for mb, prox in zip(minibatches, proxes):
                stats = self._minibatch(mb, prox, version)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        metrics = {k: v / count for k, v in sums.items()}
        metrics.update(_staleness_metrics(groups, version))
        rewards = np.concatenate([g.rewards for g in groups])
        metrics["reward_mean"] = float(rewards.mean())
        metrics["reward_std"] = float(rewards.std())
        metrics["tokens"] = float(sum(g.num_tokens for g in groups))
        metrics["reused_frac"] = float(np.mean([g.uses > 1 for g in groups]))
        return metrics

    def _minibatch(self, mb: TokenBatch, prox: torch.Tensor, version: int) -> dict[str, float]:
        L = self.lcfg
        adv = group_advantages(mb.rewards, L.advantage).reshape(-1)
        logp = self.backend.logprobs(mb.input_ids, self.cfg.task.temperature)
        staleness = (version - mb.versions) * mb.mask.long()
        loss, stats = policy_loss(logp, mb.behavior, prox, adv, mb.mask, staleness, L,
                                  max_completion_tokens(self.cfg))
        grad_norm = self.backend.step(loss, L.max_grad_norm)
        out = {k: float(v) for k, v in stats.items()}
        out["loss"] = float(loss.detach())
        out["grad_norm"] = grad_norm
        return out


def _staleness_metrics(groups: list[TrajGroup], version: int) -> dict[str, float]:
    """Per-token staleness = version - token version, over the model tokens (loss_mask 1) of the
    batch; tool tokens were sampled by no policy and are not stale."""
    per_token = np.concatenate([version - v[m > 0] for g in groups
                                for v, m in zip(g.versions, g.loss_masks)])
    hist = np.bincount(per_token, minlength=1)
    out = {"staleness_mean": float(per_token.mean()), "staleness_max": float(per_token.max())}
    out.update({f"staleness_hist_{k}": float(c) for k, c in enumerate(hist)})
    return out
