"""The vocabulary of rollouts: what an agent is given, what it returns, how it ended.

Agent code never touches sockets, leases or weights; it sees only an `LLMClient`
(actors/engines/base.py: the HF or simulated engine behind `EngineClient`, or `VLLMEngine`):

    class MyAgent:
        async def run(self, task: RolloutTask, llm: LLMClient) -> Rollout:
            c = await llm.generate(prompt_ids, max_new_tokens, temperature, task.seed(turn))
            ...  # c.token_ids, c.logprobs, c.versions; tool turns via actors.agents.trajectory

This module imports no agent. The agents (actors/agents/single_turn.py, actors/agents/tool_agent.py,
actors/agents/openai/server.py) import it, and `actors/agents/registry.py` (the factory) imports them.
An agent that raises fails its sample; the learner drops the group as `agent_error`.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from actors.engines.base import LLMClient, sample_seed


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


class Finish(str, enum.Enum):
    """Why a rollout ended (the wire's `Sample.finish`; transport.messages.FINISH_REASONS)."""

    ANSWER = "answer"
    """The model ended its turn (end-of-turn token) without calling a tool, or the OpenAI
    client stopped asking."""
    MAX_TURNS = "max_turns"
    """The model used all `actors.agent.max_turns` turns (its last one still called a tool)."""
    MAX_TOKENS = "max_tokens"
    """Out of tokens: the last model turn was cut at its limit (`task.max_new_tokens`, or what
    was left of `actors.agent.max_total_tokens`), or the next turn would not fit into the latter."""
    ERROR = "error"
    """The agent raised; the sample carries the error instead of a trajectory."""


@dataclass
class Rollout:
    """Token-aligned arrays for everything after the prompt, plus the reward."""

    completion_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    reward: float
    finish: str = ""
    """Why it ended: a `Finish` value ("" = the agent does not say). Reported to the learner."""
    scores: dict[str, float] = field(default_factory=dict)
    """Named scores of the reward (tasks/rewards.py), logged by the learner; {} for plain rewards."""
    tool_parse_errors: int = 0
    """Model turns whose tool calls did not parse (actors/agents/tool_parsers.py). Reported to the learner."""


class Agent(Protocol):
    async def run(self, task: RolloutTask, llm: LLMClient) -> Rollout: ...


RewardFn = Callable[[dict[str, str], np.ndarray], Any]
"""A task's reward: a float, or an awaitable of a float or of a `tasks.rewards.RewardResult`."""


async def score(reward_fn: RewardFn, meta: dict[str, str], ids: np.ndarray) -> tuple[float, dict]:
    """(reward, named scores) of one completion, awaiting the reward if it is asynchronous."""
    out = reward_fn(meta, ids)
    if inspect.isawaitable(out):
        out = await out
    if isinstance(out, (int, float, np.floating)):
        return float(out), {}
    return float(out.reward), dict(out.scores)
