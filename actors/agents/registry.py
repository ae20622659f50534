"""The agents by kind: the one module that knows every agent.

`actors.agent` names a kind (configs/agents.py has each kind's settings); `make_agent` builds
it, scoring with the task's reward. The kinds that run through the actor's OpenAI
chat-completions endpoint (openai, environment, verifiers: `EndpointAgentConfig`) get the one
endpoint built here. Each kind's module is imported only when that kind is built, by the
explicit imports in the factories below, so tests/test_imports.py sees every edge. A new agent is
a module in this folder, its section in configs/agents.py and an entry in KINDS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from actors.rollout import Agent
from configs.agents import (EndpointAgentConfig, EnvironmentAgentConfig, OpenAIAgentConfig,
                            SingleTurnAgentConfig, ToolsAgentConfig, VerifiersAgentConfig)
from configs.schema import TetherConfig
from tasks.scorers import agent_reward


@dataclass(frozen=True)
class AgentContext:
    """What an agent's factory gets besides its section."""

    cfg: TetherConfig
    task: object
    """The task (tasks.base.Task): its reward scores the samples."""
    tokenizer: object
    endpoint: object | None
    """The actor's OpenAI endpoint (actors/agents/openai/server.py) for the endpoint kinds."""
    reward: Callable
    """What scores a sample: the task's reward, or with `task.scorers` their function part
    (tasks/scorers; the model scorers run in the scorer fleet)."""


def _single_turn(section: SingleTurnAgentConfig, ctx: AgentContext) -> Agent:
    from actors.agents.single_turn import SingleTurnAgent

    return SingleTurnAgent(ctx.reward)


def _tools(section: ToolsAgentConfig, ctx: AgentContext) -> Agent:
    from actors.agents.tool_agent import ToolAgent
    from actors.agents.tool_parsers import make_parser
    from actors.agents.tools import make_tools
    from tasks.chat import make_chat_format

    tools = make_tools(section.tools, section.tool_timeout_s, section.tool_memory_mb,
                       section.python_sandbox, section.tool_max_procs)
    return ToolAgent(ctx.reward, make_chat_format(ctx.tokenizer), tools, section.max_turns,
                     section.max_total_tokens, make_parser(section.tool_parser))


def _openai(section: OpenAIAgentConfig, ctx: AgentContext) -> Agent:
    from actors.agents.openai.server import OpenAIAgent, load_user_agent

    return OpenAIAgent(ctx.endpoint, load_user_agent(section.function), ctx.reward)


def _environment(section: EnvironmentAgentConfig, ctx: AgentContext) -> Agent:
    from actors.agents.environment import EnvironmentAgent
    from actors.agents.openai.server import OpenAIAgent
    from tasks.environment import load_environment

    env = load_environment(section.environment or ctx.cfg.task.environment)
    return EnvironmentAgent(OpenAIAgent(ctx.endpoint, None, ctx.reward,
                                        tool_defs=getattr(env, "tools", None)), env)


def _verifiers(section: VerifiersAgentConfig, ctx: AgentContext) -> Agent:
    """The task is a VerifiersTask (configs.schema.check_ranges): its env is the one played."""
    from actors.agents.openai.server import OpenAIAgent
    from actors.agents.verifiers import VerifiersAgent

    return VerifiersAgent(OpenAIAgent(ctx.endpoint, None, ctx.reward), ctx.task.env)


KINDS: dict[str, Callable[..., Agent]] = {
    "single_turn": _single_turn, "tools": _tools, "openai": _openai,
    "environment": _environment, "verifiers": _verifiers,
}
"""Kind -> factory(section, AgentContext)."""


def make_endpoint(section: EndpointAgentConfig, tokenizer):
    """The actor's OpenAI chat-completions endpoint for an endpoint kind's section."""
    from actors.agents.openai.server import OpenAIEndpoint
    from actors.agents.tool_parsers import make_parser
    from tasks.chat import make_chat_format

    return OpenAIEndpoint(make_chat_format(tokenizer), section.port, section.max_turns,
                          section.max_total_tokens, make_parser(section.tool_parser))


def make_agent(cfg: TetherConfig, task, tokenizer) -> Agent:
    """The agent `actors.agent` names, scoring with the task's reward function (with
    `task.scorers`: their function part, tasks/scorers)."""
    section = cfg.actors.agent
    endpoint = (make_endpoint(section, tokenizer) if isinstance(section, EndpointAgentConfig)
                else None)
    reward = agent_reward(cfg.task, task, tokenizer)
    return KINDS[section.kind](section, AgentContext(cfg, task, tokenizer, endpoint, reward))


def served_endpoint(agent: Agent):
    """The OpenAI endpoint `agent` serves its rollouts through (None: it has none)."""
    from actors.agents.openai.server import OpenAIAgent

    inner = getattr(agent, "agent", agent)  # environment / verifiers agents wrap an OpenAIAgent
    return inner.endpoint if isinstance(inner, OpenAIAgent) else None
