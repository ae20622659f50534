"""Agents turn a leased task into a trajectory using only the engine client.

Agent code never touches sockets, leases or weights. A single-turn completion is simply the
simplest agent, so every rollout takes the same path:

    class MyAgent:
        async def run(self, task: RolloutTask, llm: EngineClient) -> Rollout:
            c = await llm.generate(prompt_ids, max_new_tokens, temperature, task.seed(turn))
            ...  # c.token_ids, c.logprobs, c.versions; tool turns via actors.trajectory

Agents here: SingleTurnAgent; ToolAgent (actors/tool_agent.py: multi-turn, tool calls);
OpenAIAgent (actors/openai_server.py: your OpenAI-client code through a local endpoint).
An agent that raises fails its sample; the learner drops the group as `agent_error`.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from actors.client import EngineClient
from actors.engine import sample_seed

if TYPE_CHECKING:
    from configs.schema import TetherConfig


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
    """The model used all `actors.max_turns` turns (its last one still called a tool)."""
    MAX_TOKENS = "max_tokens"
    """Out of tokens: the last model turn was cut at its limit (`task.max_new_tokens`, or what
    was left of `actors.max_total_tokens`), or the next turn would not fit into the latter."""
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


class Agent(Protocol):
    async def run(self, task: RolloutTask, llm: EngineClient) -> Rollout: ...


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


class SingleTurnAgent:
    """Generate once from the prompt; score with the task's reward function."""

    def __init__(self, reward_fn: RewardFn) -> None:
        self.reward_fn = reward_fn

    async def run(self, task: RolloutTask, llm: EngineClient) -> Rollout:
        c = await llm.generate(task.prompt_ids, task.max_new_tokens, task.temperature, task.seed())
        finish = Finish.ANSWER if c.finish_reason == "stop" else Finish.MAX_TOKENS
        reward, scores = await score(self.reward_fn, task.meta, c.token_ids)
        return Rollout(completion_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                       loss_mask=np.ones(len(c.token_ids), dtype=np.uint8),
                       reward=reward, finish=finish.value, scores=scores)


def make_agent(cfg: "TetherConfig", task, tokenizer) -> Agent:
    """The agent `actors.agent` names, scoring with the task's reward function."""
    A = cfg.actors
    if A.agent == "single_turn":
        return SingleTurnAgent(task.reward)
    from actors.chat import make_chat_format

    if A.agent == "tools":
        from actors.tool_agent import ToolAgent
        from actors.tools import make_tools

        return ToolAgent(task.reward, make_chat_format(tokenizer),
                         make_tools(A.tools, A.tool_timeout_s, A.tool_memory_mb),
                         A.max_turns, A.max_total_tokens)
    if A.agent == "openai":
        from actors.openai_server import OpenAIAgent, OpenAIEndpoint, load_user_agent

        endpoint = OpenAIEndpoint(make_chat_format(tokenizer), A.openai_port, A.max_turns,
                                  A.max_total_tokens)
        return OpenAIAgent(endpoint, load_user_agent(A.openai_agent), task.reward)
    raise ValueError(f"unknown agent {A.agent!r}")
