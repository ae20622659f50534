"""Agents turn a leased task into a trajectory using only the engine client.

Agent code never touches sockets, leases or weights. A single-turn completion is simply the
simplest agent, so every rollout takes the same path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from actors.client import EngineClient
from actors.engine import sample_seed


@dataclass(frozen=True)
class RolloutTask:
    """What an agent gets for one sample of a leased group."""

    prompt_id: int
    sample_index: int
    prompt_ids: np.ndarray
    meta: dict[str, str]
    max_new_tokens: int
    temperature: float
    run_seed: int

    def seed(self, turn: int = 0) -> int:
        return sample_seed(self.run_seed, self.prompt_id, self.sample_index, turn)


@dataclass
class Rollout:
    """Token-aligned arrays for everything after the prompt, plus the reward."""

    completion_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    reward: float


class Agent(Protocol):
    async def run(self, task: RolloutTask, llm: EngineClient) -> Rollout: ...


RewardFn = Callable[[dict[str, str], np.ndarray], float]


class SingleTurnAgent:
    """Generate once from the prompt; score with the task's reward function."""

    def __init__(self, reward_fn: RewardFn) -> None:
        self.reward_fn = reward_fn

    async def run(self, task: RolloutTask, llm: EngineClient) -> Rollout:
        c = await llm.generate(task.prompt_ids, task.max_new_tokens, task.temperature, task.seed())
        return Rollout(completion_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                       loss_mask=np.ones(len(c.token_ids), dtype=np.uint8),
                       reward=float(self.reward_fn(task.meta, c.token_ids)))
