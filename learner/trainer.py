"""One RL training step on a batch of groups: the algorithm, independent of the backend.

    groups -> collate -> pi_prox (no grad, weights at step start) -> for each epoch and
    minibatch: pi_theta -> policy_loss -> backend.step

`max_staleness = 0` runs exactly this code; the only difference from a synchronous PPO loop is
where the groups came from, which is what tests/test_sync_equivalence.py checks bitwise.

Data parallelism (backend.dp_size > 1): every rank is given the whole batch and trains on its
share of each minibatch (whole groups, since advantages are per group), with the loss scaled
by the whole minibatch's token/sequence counts; the backend sums gradients over ranks, so a
step equals the single-process step on the whole batch (tests/test_fsdp.py).
"""

from __future__ import annotations

import numpy as np
import torch

from buffer.record import TrajGroup
from configs.schema import TetherConfig, max_completion_tokens
from learner.backend import Backend
from learner.batch import TokenBatch, collate, padded_length
from learner.loss import LossNorm, group_advantages, policy_loss


class Trainer:
    def __init__(self, cfg: TetherConfig, backend: Backend, pad_id: int) -> None:
        self.cfg = cfg
        self.lcfg = cfg.learner
        self.backend = backend
        self.pad_id = pad_id

    def step(self, groups: list[TrajGroup], version: int) -> dict[str, float]:
        """Train on `groups` at policy `version`; returns this step's metrics."""
        L, T = self.lcfg, self.cfg.task.temperature
        per_mb = len(groups) // L.minibatches
        minibatches = [self._shard(groups[i:i + per_mb]) for i in range(0, len(groups), per_mb)]
        with torch.no_grad():
            proxes = [self.backend.logprobs(mb.input_ids, T) for mb, _ in minibatches]
        sums: dict[str, float] = {}
        count = 0
        for _ in range(L.epochs):
            for (mb, norm), prox in zip(minibatches, proxes):
                stats = self._minibatch(mb, norm, prox, version)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        metrics = {k: v / count for k, v in sums.items()}
        metrics.update(_staleness_metrics(groups, version))
        rewards = np.concatenate([g.rewards for g in groups])
        metrics["reward_mean"] = float(rewards.mean())
        metrics["reward_std"] = float(rewards.std())
        metrics["tokens"] = float(sum(g.num_tokens for g in groups))
        # tool/environment tokens (mask 0) exist only between the turns of multi-turn rollouts
        metrics["tool_tokens_frac"] = float(sum(int((lm == 0).sum()) for g in groups
                                                for lm in g.loss_masks)) / metrics["tokens"]
        metrics["reused_frac"] = float(np.mean([g.uses > 1 for g in groups]))
        return metrics

    def _shard(self, groups: list[TrajGroup]) -> tuple[TokenBatch, LossNorm | None]:
        """This rank's part of a minibatch, and the whole minibatch's counts (None: no split).
        Rows are padded to the whole minibatch's length, as in a single process."""
        rank, size = self.backend.dp_rank, self.backend.dp_size
        if size == 1:
            return collate(groups, self.pad_id).to(self.backend.device), None
        if len(groups) < size:
            raise ValueError(f"a minibatch of {len(groups)} groups (learner.prompts_per_step / "
                             f"learner.minibatches) cannot be split over {size} data-parallel ranks")
        norm = LossNorm(tokens=float(sum(lm.sum() for g in groups for lm in g.loss_masks)),
                        rows=sum(len(g.completions) for g in groups))
        mine = groups[rank * len(groups) // size:(rank + 1) * len(groups) // size]
        return collate(mine, self.pad_id, padded_length(groups)).to(self.backend.device), norm

    def _minibatch(self, mb: TokenBatch, norm: LossNorm | None, prox: torch.Tensor,
                   version: int) -> dict[str, float]:
        L = self.lcfg
        adv = group_advantages(mb.rewards, L.advantage).reshape(-1)
        logp = self.backend.logprobs(mb.input_ids, self.cfg.task.temperature)
        staleness = (version - mb.versions) * mb.mask.long()
        loss, stats = policy_loss(logp, mb.behavior, prox, adv, mb.mask, staleness, L,
                                  max_completion_tokens(self.cfg), norm)
        grad_norm = self.backend.step(loss, L.max_grad_norm)
        stats["loss"] = loss.detach()
        out = {k: float(v) for k, v in self.backend.reduce_stats(stats).items()}
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
