"""`actors.agent`: the agent's kind and its settings (one section per kind).

    actors:
      agent: {kind: tools, tools: "calc,python", max_turns: 3}     # or only `agent: tools`

The multi-turn kinds share their turn and token budgets and the tool-call parser; the kinds that
run through the actor's OpenAI endpoint (openai, environment, verifiers) share its port.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from configs.base import Count, ImportPath, Kind, Port, Positive

TOOLS = ("calc", "python")
"""Tools the `tools` agent can offer (actors/agents/tools.py)."""
_TOOL = "|".join(TOOLS)
ToolList = Annotated[str, Meta(pattern=rf"^\s*({_TOOL})\s*(,\s*({_TOOL})\s*)*$",
                               description=f"a comma-separated subset of {TOOLS}")]
"""Comma-separated names from TOOLS."""


class SingleTurnAgentConfig(Kind, tag="single_turn"):
    """One generation per sample, scored by the task's reward."""


class MultiTurnAgentConfig(Kind):
    """What the multi-turn agents share: their budgets and how tool calls are read."""

    max_turns: Count = 4
    """Most model turns (generations) per sample."""
    max_total_tokens: int = 48
    """Most completion tokens (model + tool) per sample; the learner refuses more."""
    tool_parser: Literal["tether", "hermes"] = "tether"
    """Tool-call syntax: tether (`<call> NAME ARG </call>`, tiny models) | hermes (Qwen-family)."""


class ToolsAgentConfig(MultiTurnAgentConfig, tag="tools"):
    """Multi-turn tool calls, the tools run by the actor (docs/agents.md)."""

    tools: ToolList = "calc"
    """Comma-separated tools: calc (integer sums) | python (limited subprocess)."""
    tool_timeout_s: Positive = 5.0
    """Wall-clock limit of one tool call (python: also its CPU limit); a timeout is an error message."""
    tool_memory_mb: Annotated[int, Meta(ge=64)] = 512
    """Address-space limit (RLIMIT_AS) of the python tool's subprocess."""
    python_sandbox: Literal["bwrap", "rlimits"] = "bwrap"
    """python tool: bwrap (bubblewrap sandbox, required) | rlimits (limits only: unsafe)."""
    tool_max_procs: Count = 16
    """python tool under bwrap: most processes (RLIMIT_NPROC) its code may have at once."""


class EndpointAgentConfig(MultiTurnAgentConfig):
    """What the agents behind the actor's OpenAI chat-completions endpoint share."""

    port: Port = 0
    """Port of the actor's chat-completions endpoint on 127.0.0.1 (0 = any free port)."""


class OpenAIAgentConfig(EndpointAgentConfig, tag="openai", kw_only=True):
    """Your code, talking to the actor's OpenAI endpoint (docs/agents.md)."""

    function: ImportPath
    """Your module:function (or file.py:function), called as fn(base_url, messages) (sync or
    async) per sample."""


class EnvironmentAgentConfig(EndpointAgentConfig, tag="environment"):
    """An environment's rollout and rubric, through the endpoint (docs/agents.md)."""

    environment: str = ""
    """module:attribute of the environment (rollout through an OpenAI client + rubric; default:
    task.environment)."""


class VerifiersAgentConfig(EndpointAgentConfig, tag="verifiers"):
    """task.verifiers_env's episode and rubric, through the endpoint (docs/agents.md)."""


AgentConfig = (SingleTurnAgentConfig | ToolsAgentConfig | OpenAIAgentConfig
               | EnvironmentAgentConfig | VerifiersAgentConfig)
"""The agent's section: one of the kinds above, chosen by `kind`."""
