"""Build the agent `actors.agent` names: the one module that knows every agent."""

from __future__ import annotations

from actors.chat import make_chat_format
from actors.environment import EnvironmentAgent, load_environment
from actors.openai_server import OpenAIAgent, OpenAIEndpoint, load_user_agent
from actors.rollout import Agent
from actors.single_turn import SingleTurnAgent
from actors.tool_agent import ToolAgent
from actors.tool_parsers import make_parser
from actors.tools import make_tools
from actors.verifiers_agent import VerifiersAgent
from configs.schema import TetherConfig


def make_agent(cfg: TetherConfig, task, tokenizer) -> Agent:
    """The agent `actors.agent` names, scoring with the task's reward function."""
    A = cfg.actors.agent
    if A.kind == "single_turn":
        return SingleTurnAgent(task.reward)
    if A.kind == "tools":
        return ToolAgent(task.reward, make_chat_format(tokenizer),
                         make_tools(A.tools, A.tool_timeout_s, A.tool_memory_mb, A.python_sandbox,
                                    A.tool_max_procs),
                         A.max_turns, A.max_total_tokens, make_parser(A.tool_parser))
    if A.kind == "openai":
        endpoint = OpenAIEndpoint(make_chat_format(tokenizer), A.port, A.max_turns,
                                  A.max_total_tokens, make_parser(A.tool_parser))
        return OpenAIAgent(endpoint, load_user_agent(A.function), task.reward)
    if A.kind == "environment":
        endpoint = OpenAIEndpoint(make_chat_format(tokenizer), A.port, A.max_turns,
                                  A.max_total_tokens, make_parser(A.tool_parser))
        env = load_environment(A.environment or cfg.task.environment)
        return EnvironmentAgent(OpenAIAgent(endpoint, None, task.reward,
                                            tool_defs=getattr(env, "tools", None)), env)
    if A.kind == "verifiers":  # task is a VerifiersTask (configs.schema.validate)
        endpoint = OpenAIEndpoint(make_chat_format(tokenizer), A.port, A.max_turns,
                                  A.max_total_tokens, make_parser(A.tool_parser))
        return VerifiersAgent(OpenAIAgent(endpoint, None, task.reward), task.env)
    raise ValueError(f"unknown agent {A.kind!r}")
