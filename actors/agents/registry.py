"""Build the agent `actors.agent` names: the one module that knows every agent."""

from __future__ import annotations

from tasks.chat import make_chat_format
from actors.agents.environment import EnvironmentAgent, load_environment
from actors.agents.openai.server import OpenAIAgent, OpenAIEndpoint, load_user_agent
from actors.rollout import Agent
from actors.agents.single_turn import SingleTurnAgent
from actors.agents.tool_agent import ToolAgent
from actors.agents.tool_parsers import make_parser
from actors.agents.tools import make_tools
from actors.agents.verifiers import VerifiersAgent
from configs.schema import TetherConfig
from tasks.scorers import agent_reward


def make_agent(cfg: TetherConfig, task, tokenizer) -> Agent:
    """The agent `actors.agent` names, scoring with the task's reward function (with
    `task.scorers`: their function part, tasks/scorers)."""
    A = cfg.actors.agent
    reward = agent_reward(cfg.task, task, tokenizer)
    if A.kind == "single_turn":
        return SingleTurnAgent(reward)
    if A.kind == "tools":
        return ToolAgent(reward, make_chat_format(tokenizer),
                         make_tools(A.tools, A.tool_timeout_s, A.tool_memory_mb, A.python_sandbox,
                                    A.tool_max_procs),
                         A.max_turns, A.max_total_tokens, make_parser(A.tool_parser))
    if A.kind == "openai":
        endpoint = OpenAIEndpoint(make_chat_format(tokenizer), A.port, A.max_turns,
                                  A.max_total_tokens, make_parser(A.tool_parser))
        return OpenAIAgent(endpoint, load_user_agent(A.function), reward)
    if A.kind == "environment":
        endpoint = OpenAIEndpoint(make_chat_format(tokenizer), A.port, A.max_turns,
                                  A.max_total_tokens, make_parser(A.tool_parser))
        env = load_environment(A.environment or cfg.task.environment)
        return EnvironmentAgent(OpenAIAgent(endpoint, None, reward,
                                            tool_defs=getattr(env, "tools", None)), env)
    if A.kind == "verifiers":  # task is a VerifiersTask (configs.schema.validate)
        endpoint = OpenAIEndpoint(make_chat_format(tokenizer), A.port, A.max_turns,
                                  A.max_total_tokens, make_parser(A.tool_parser))
        return VerifiersAgent(OpenAIAgent(endpoint, None, reward), task.env)
    raise ValueError(f"unknown agent {A.kind!r}")


def served_endpoint(agent: Agent) -> OpenAIEndpoint | None:
    """The OpenAI endpoint `agent` serves its rollouts through (None: it has none)."""
    inner = agent.agent if isinstance(agent, (EnvironmentAgent, VerifiersAgent)) else agent
    return inner.endpoint if isinstance(inner, OpenAIAgent) else None
