"""The simplest agent: one generation from the prompt, scored by the task's reward."""

from __future__ import annotations

import numpy as np

from actors.engines.base import LLMClient
from actors.rollout import Finish, RewardFn, Rollout, RolloutTask, score


class SingleTurnAgent:
    """Generate once from the prompt; score with the task's reward function."""

    def __init__(self, reward_fn: RewardFn) -> None:
        self.reward_fn = reward_fn

    async def run(self, task: RolloutTask, llm: LLMClient) -> Rollout:
        c = await llm.generate(task.prompt_ids, task.max_new_tokens, task.temperature, task.seed())
        finish = Finish.ANSWER if c.finish_reason == "stop" else Finish.MAX_TOKENS
        reward, scores = await score(self.reward_fn, task.meta, c.token_ids)
        return Rollout(completion_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                       loss_mask=np.ones(len(c.token_ids), dtype=np.uint8),
                       reward=reward, finish=finish.value, scores=scores)
