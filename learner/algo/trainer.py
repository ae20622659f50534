"""One RL training step on a batch of groups: the algorithm, independent of the backend.

    groups -> shape (overlong, mask_truncated) -> collate -> at step start, no grad: pi_prox,
    pi_ref, critic values, advantages (+ value targets) -> for each epoch and minibatch:
    pi_theta -> policy_loss -> backend.step; values -> value_loss -> critic.step

With one minibatch and one epoch, pi_prox is pi_theta before the only update: the step runs
pi_theta's forward (with gradient) first and takes pi_prox from it, detached, instead of a
second no-grad forward (the same values bit for bit; tests/test_trainer_fused.py).

Micro-batches (`learner.max_tokens_per_microbatch`, learner/algo/microbatch.py): every forward of
the step (pi_prox, reference, critic, pi_theta) runs a few rows at a time, each update's
gradients accumulate over them and one optimizer step follows; pi_prox is then always its own
no-grad pass (pi_theta's graph is never held for the whole share). With `learner.pack_rows`
each micro-batch's rows run as one packed sequence; the models are checked at start-up to keep
packed rows apart (models/packing.py).

`max_staleness = 0` runs exactly this code; the only difference from a synchronous PPO loop is
where the groups came from, which is what tests/test_sync_equivalence.py checks bitwise.

Data parallelism (backend.dp_size > 1): every rank is given the whole batch and trains on its
share of each minibatch (whole groups, since advantages are per group), with the loss scaled
by the whole minibatch's token/sequence counts; the backend sums gradients over ranks, so a
step equals the single-process step on the whole batch (tests/test_fsdp.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from buffer.record import TrajGroup
from configs.schema import TetherConfig, max_completion_tokens
from learner.algo import advantages as A, microbatch
from learner.algo.batch import TokenBatch, collate, padded_length
from learner.algo.critic import AlgoModels, FrozenBase
from learner.algo.loss import (LossNorm, accepted_tokens, group_advantages, kl_estimate,
                               policy_loss, value_loss)
from learner.backends.base import Backend
from learner.obs.timeline import Timeline
from models import packing


@dataclass
class Prepared:
    """A minibatch's step-start quantities (no gradient), fixed over the epochs."""

    prox: torch.Tensor
    """pi_prox logprobs (rows, tokens)."""
    advantages: torch.Tensor
    """(rows,) for group estimators, (rows, tokens) for token-level ones."""
    ref: torch.Tensor | None = None
    """Reference logprobs (kl_coef > 0)."""
    old_values: torch.Tensor | None = None
    """Critic values at step start (gae, vtrace)."""
    returns: torch.Tensor | None = None
    """Value targets (gae: A + V; vtrace: v_s)."""
    accepted: float | None = None
    """Trained tokens the mask correction accepts in the whole minibatch (a data-parallel
    shard with mask_denominator=accepted; fixed over the epochs, since pi_prox is)."""


class Trainer:
    def __init__(self, cfg: TetherConfig, backend: Backend, pad_id: int,
                 models: AlgoModels | None = None, eos_id: int | None = None) -> None:
        """`models`: the reference and critic the config needs (learner/distributed.py
        `make_models`); `eos_id`: the tokenizer's, needed by learner.mask_truncated."""
        self.cfg = cfg
        self.lcfg = cfg.learner
        self.backend = backend
        self.pad_id = pad_id
        self.models = AlgoModels() if models is None else models
        self.eos_id = eos_id
        self.fuse_prox = True
        """With one minibatch and one epoch, take pi_prox from pi_theta's forward (False: a
        separate no-grad forward, as with several minibatches or epochs; for tests)."""
        self.timeline = Timeline()
        """Where this step's time goes (prox, forward, backward_optimizer; learner/obs/timeline.py)."""
        if cfg.learner.kl_coef > 0 and self.models.reference is None:
            raise ValueError("learner.kl_coef > 0 needs a reference model (make_models)")
        if cfg.learner.advantage in ("gae", "vtrace") and self.models.critic is None:
            raise ValueError(f"learner.advantage={cfg.learner.advantage} needs a critic "
                             "(make_models)")
        if cfg.learner.pack_rows:
            self._check_packing()

    def step(self, groups: list[TrajGroup], version: int) -> dict[str, float]:
        """Train on `groups` at policy `version`; returns this step's metrics."""
        L = self.lcfg
        per_mb = len(groups) // L.minibatches
        shaped = A.shape_groups(groups, self.cfg, self.eos_id)
        minibatches = [self._shard(shaped[i:i + per_mb]) for i in range(0, len(shaped), per_mb)]
        if (self.fuse_prox and L.minibatches == 1 and L.epochs == 1
                and not L.max_tokens_per_microbatch):
            (mb, norm), = minibatches
            with self.timeline.span("forward"):
                theta = self._logprobs(mb.input_ids)
            with torch.no_grad(), self.timeline.span("prox"):
                prep = self._prepare(mb, norm, prox=theta[0].detach())
            metrics = self._minibatch(mb, norm, prep, version, theta)
        else:
            metrics = self._epochs(minibatches, version)
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

    def _epochs(self, minibatches: list[tuple[TokenBatch, LossNorm | None]],
                version: int) -> dict[str, float]:
        """Step-start quantities of every minibatch, then `epochs` passes over them; the
        metrics averaged over the minibatch updates."""
        with torch.no_grad(), self.timeline.span("prox"):
            preps = [self._prepare(mb, norm) for mb, norm in minibatches]
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.lcfg.epochs):
            for (mb, norm), prep in zip(minibatches, preps):
                stats = self._minibatch(mb, norm, prep, version)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        return {k: v / count for k, v in sums.items()}

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

    def _prepare(self, mb: TokenBatch, norm: LossNorm | None,
                 prox: torch.Tensor | None = None) -> Prepared:
        """pi_prox (computed here unless given), the reference logprobs, the critic's values and
        the advantages, at step start (called under no_grad for every minibatch before any
        optimizer step)."""
        L, T = self.lcfg, self.cfg.task.temperature
        if prox is None:
            prox = self._per_token(mb, lambda ids, pos: self.backend.logprobs(ids, T, pos))
        ref = (self._per_token(mb, lambda ids, pos: self.models.ref_logprobs(ids, T, pos))
               if L.kl_coef > 0 else None)
        kl_pen = None
        if ref is not None and L.kl_in == "reward":
            kl_pen = L.kl_coef * kl_estimate(prox, ref, L.kl_estimator) * mb.mask
        prep = Prepared(prox=prox, advantages=torch.zeros(()), ref=ref)
        split = norm is not None or L.max_tokens_per_microbatch  # rows see part of the minibatch
        if split and L.correction == "mask" and L.mask_denominator == "accepted":
            kept = accepted_tokens(prox, mb.behavior, mb.mask, L)
            prep.accepted = float(self.backend.reduce_stats({"accepted": kept})["accepted"])
        if L.advantage in ("grpo", "drgrpo", "rloo"):
            rewards = mb.rewards
            if kl_pen is not None:
                rewards = rewards - kl_pen.sum(dim=1).reshape(rewards.shape)
            prep.advantages = group_advantages(rewards, L.advantage).reshape(-1)
            return prep
        r = A.token_rewards(mb.rewards.reshape(-1), mb.mask, kl_pen)
        if L.advantage == "reinforce_pp":
            tokens = max((norm or LossNorm.of(mb.mask)).tokens, 1.0)
            prep.advantages = A.reinforce_pp(r, mb.mask, L.gamma, tokens,
                                             self.backend.reduce_stats, L.reinforce_pp_std)
            return prep
        values = self._per_token(mb, self.models.values) * mb.mask
        prep.old_values = values
        if L.advantage == "gae":
            prep.advantages, prep.returns = A.gae(r, values, mb.mask, L.gamma, L.lam)
        else:
            prep.advantages, prep.returns = A.vtrace(r, values, (prox - mb.behavior) * mb.mask,
                                                     mb.mask, L.gamma, L.vtrace_rho, L.vtrace_c)
        return prep

    def _per_token(self, mb: TokenBatch, fn) -> torch.Tensor:
        """`fn(input_ids, position_ids)` (rows, L-1) of the share, by micro-batch when they are
        on (position ids: packed rows)."""
        if not self.lcfg.max_tokens_per_microbatch:
            return fn(mb.input_ids, None)
        return microbatch.per_token(self._plan(mb), mb, fn)

    def _plan(self, mb: TokenBatch) -> list[microbatch.MicroBatch]:
        """This rank's micro-batches, as many as on the rank that needs the most (a
        collective: every rank plans at the same points; microbatch.py)."""
        parts = microbatch.plan(mb.lengths, self.lcfg.max_tokens_per_microbatch,
                                self.lcfg.pack_rows)
        most = self.backend.reduce_stats({"parts_max": torch.tensor(float(len(parts)))})
        return microbatch.padded(parts, int(most["parts_max"]))

    def _minibatch(self, mb: TokenBatch, norm: LossNorm | None, prep: Prepared, version: int,
                   theta: tuple[torch.Tensor, torch.Tensor | None] | None = None
                   ) -> dict[str, float]:
        """One update on `mb`; `theta`: pi_theta's logprobs and entropy if already computed."""
        if self.lcfg.max_tokens_per_microbatch:
            return self._micro_minibatch(mb, norm, prep, version)
        L, tl = self.lcfg, self.timeline
        with tl.span("forward"):
            loss, stats = self._policy_loss(mb, norm, prep, version, theta)
        with tl.span("backward_optimizer"):
            grad_norm = self.backend.step(loss, L.max_grad_norm)
        stats["loss"] = loss.detach()
        critic_grad_norm = None
        if self.models.critic is not None:
            with tl.span("forward"):
                vloss, vstats = self._value_loss(mb, norm, prep)
            stats.update(vstats)
            with tl.span("backward_optimizer"):
                critic_grad_norm = self.models.critic.step(vloss, L.max_grad_norm)
        return self._finish(stats, grad_norm, critic_grad_norm)

    def _micro_minibatch(self, mb: TokenBatch, norm: LossNorm | None, prep: Prepared,
                         version: int) -> dict[str, float]:
        """One update on `mb` by micro-batches (learner/algo/microbatch.py): each one's share of the
        minibatch loss (the whole minibatch's counts), gradients accumulated, one optimizer
        step; then the critic likewise."""
        L, tl = self.lcfg, self.timeline
        norm = LossNorm.of(mb.mask) if norm is None else norm
        parts = self._plan(mb)
        shares = []
        self.backend.zero_grad()
        for part in parts:
            with tl.span("forward"):
                theta = part.run(self._logprobs, mb)
                loss, stats = self._policy_loss(part.batch(mb), norm, _take(prep, part), version,
                                                theta)
            with tl.span("backward_optimizer"):
                self.backend.backward(loss * 0.0 if part.padding else loss)
            if not part.padding:
                stats["loss"] = loss.detach()
                shares.append(stats)
        with tl.span("backward_optimizer"):
            grad_norm = self.backend.apply_gradients(L.max_grad_norm)
        stats = microbatch.combine(shares)
        critic_grad_norm = None
        if self.models.critic is not None:
            shares = []
            self.models.critic.zero_grad()
            for part in parts:
                with tl.span("forward"):
                    vloss, vstats = self._value_loss(part.batch(mb), norm, _take(prep, part),
                                                     part.run(self.models.values, mb))
                with tl.span("backward_optimizer"):
                    self.models.critic.backward(vloss * 0.0 if part.padding else vloss)
                if not part.padding:
                    shares.append(vstats)
            with tl.span("backward_optimizer"):
                critic_grad_norm = self.models.critic.apply_gradients(L.max_grad_norm)
            stats.update(microbatch.combine(shares))
        return self._finish(stats, grad_norm, critic_grad_norm)

    def _policy_loss(self, mb: TokenBatch, norm: LossNorm | None, prep: Prepared, version: int,
                     theta: tuple[torch.Tensor, torch.Tensor | None] | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """pi_theta's forward on `mb` (unless `theta` is given) and its share of the loss."""
        L = self.lcfg
        logp, entropy = self._logprobs(mb.input_ids) if theta is None else theta
        staleness = (version - mb.versions) * mb.mask.long()
        budget = max_completion_tokens(self.cfg)
        in_loss = prep.ref if L.kl_in == "loss" else None
        pnorm = norm if prep.accepted is None else replace(norm, accepted=prep.accepted)
        loss, stats = policy_loss(logp, mb.behavior, prep.prox, prep.advantages, mb.mask,
                                  staleness, L, budget, pnorm, ref=in_loss, entropy=entropy)
        if prep.ref is not None and in_loss is None:  # in the reward: logged here
            kl = kl_estimate(logp.detach(), prep.ref, L.kl_estimator)
            stats["kl_ref"] = ((kl * mb.mask).sum()
                               / max((norm or LossNorm.of(mb.mask)).tokens, 1.0))
        return loss, stats

    def _value_loss(self, mb: TokenBatch, norm: LossNorm | None, prep: Prepared,
                    values: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The critic's forward on `mb` (unless `values` are given) and its value loss."""
        values = self.models.values(mb.input_ids) if values is None else values
        return value_loss(values, prep.old_values, prep.returns, mb.mask, self.lcfg.value_clip,
                          self.lcfg.loss_agg, max_completion_tokens(self.cfg), norm)

    def _finish(self, stats: dict[str, torch.Tensor], grad_norm: float,
                critic_grad_norm: float | None) -> dict[str, float]:
        out = {k: float(v) for k, v in self.backend.reduce_stats(stats).items()}
        out["grad_norm"] = grad_norm
        if critic_grad_norm is not None:
            out["critic_grad_norm"] = critic_grad_norm
        out["is_ess"] = out["ess_w"] ** 2 / out["ess_w2"] if out["ess_w2"] > 0 else 1.0
        return out

    def _logprobs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """pi_theta's logprobs and entropy from one forward pass (position ids: packed rows);
        the entropy carries a gradient only when it is in the loss."""
        return self.backend.logprobs_entropy(input_ids, self.cfg.task.temperature,
                                             entropy_grad=self.lcfg.entropy_coef > 0,
                                             position_ids=position_ids)

    def _check_packing(self) -> None:
        """learner.pack_rows: every model the step runs must keep packed rows apart (a
        collective: every rank builds its trainer at the same point)."""
        T = self.cfg.task.temperature
        packing.require_rows_apart("the policy (model.path)", self.backend.model,
                                   lambda ids, pos: self.backend.logprobs(ids, T, pos))
        if self.models.critic is not None:
            packing.require_rows_apart("the critic (model.critic_path or model.path)",
                                       self.models.critic.model, self.models.values)
        if self.models.reference is not None and not isinstance(self.models.reference,
                                                                FrozenBase):
            packing.require_rows_apart("the reference (model.ref_path or model.path)",
                                       self.models.reference.model,
                                       lambda ids, pos: self.models.ref_logprobs(ids, T, pos))


def _take(prep: Prepared, part: microbatch.MicroBatch) -> Prepared:
    """A micro-batch's rows (and columns) of the step-start quantities."""
    return Prepared(prox=part.take(prep.prox), advantages=part.take(prep.advantages),
                    ref=part.take(prep.ref), old_values=part.take(prep.old_values),
                    returns=part.take(prep.returns), accepted=prep.accepted)


def _staleness_metrics(groups: list[TrajGroup], version: int) -> dict[str, float]:
    """Per-token staleness = version - token version, over the model tokens (loss_mask 1) of the
    batch; tool tokens were sampled by no policy and are not stale."""
    per_token = np.concatenate([version - v[m > 0] for g in groups
                                for v, m in zip(g.versions, g.loss_masks)])
    hist = np.bincount(per_token, minlength=1)
    out = {"staleness_mean": float(per_token.mean()), "staleness_max": float(per_token.max())}
    out.update({f"staleness_hist_{k}": float(c) for k, c in enumerate(hist)})
    return out
