"""`kind: function`: today's import-path reward (tasks/rewards.py), one process pool per scorer,
in the actor (and in the learner for its evaluation). `fn: ""` is the task's own reward.

A function scorer named `fmt` with weight w adds w * its reward to the sample's reward and logs
`fmt` (its reward), `fmt_<key>` for the entries of a dict it returns, and its flags
`fmt_reward_timeout` / `fmt_reward_error`.
"""

from __future__ import annotations

import asyncio
import inspect

import numpy as np

from configs.scorers import FunctionScorer
from tasks.rewards import RewardPool, RewardResult
from tasks.scorers.base import label_and_metadata


class FunctionScorers:
    """The function scorers of `task.scorers`, weighted and summed: the part of the reward an
    actor computes. Pools start on the first call (in the process and loop that score)."""

    def __init__(self, scorers: list[FunctionScorer], task, tokenizer) -> None:
        self.scorers, self.task, self.tokenizer = scorers, task, tokenizer
        self._pools: dict[str, RewardPool] | None = None

    def _pool(self, s: FunctionScorer) -> RewardPool:
        if self._pools is None:
            self._pools = {x.name: RewardPool(x.fn, x.kwargs, x.workers, x.timeout_s)
                           for x in self.scorers if x.fn}
        return self._pools[s.name]

    async def reward(self, meta: dict[str, str], completion_ids: np.ndarray) -> RewardResult:
        results = await asyncio.gather(*(self._one(s, meta, completion_ids) for s in self.scorers))
        total, scores = 0.0, {}
        for s, (value, named) in zip(self.scorers, results):
            total += s.weight * value
            scores[s.name] = value
            scores.update({f"{s.name}_{k}": v for k, v in named.items() if k != "score"})
        return RewardResult(total, scores)

    async def _one(self, s: FunctionScorer, meta, ids) -> tuple[float, dict]:
        if not s.fn:
            out = self.task.reward(meta, ids)
            if inspect.isawaitable(out):
                out = await out
            return (float(out), {}) if isinstance(out, (int, float, np.floating)) else (
                float(out.reward), dict(out.scores))
        ids = np.asarray(ids).tolist()
        label, metadata = label_and_metadata(meta)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        res = await self._pool(s).score(text, ids, label, metadata)
        return res.reward, res.scores

    def close(self) -> None:
        for pool in (self._pools or {}).values():
            pool.close()
