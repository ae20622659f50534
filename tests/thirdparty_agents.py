"""The calculator agent written with three popular agent libraries, as their own tutorials write
them, for `actors.agent=openai` (tests/test_thirdparty_agents.py runs each as an actor's agent):

    actors.agent.function=tests/thirdparty_agents.py:openai_agents      # openai-agents
    actors.agent.function=tests/thirdparty_agents.py:langgraph          # LangGraph + langchain-openai
    actors.agent.function=tests/thirdparty_agents.py:pydantic_ai        # pydantic-ai

Nothing in them is Tether's: each declares the calculator as a tool named `calc` with one string
argument, points its library's OpenAI chat-completions model at `base_url`, and runs the
conversation from `messages` (the task prompt: one user message). Each opens one async client
for its rollout and closes it before returning (`async with`): a client left open holds
connections whose transports are closed only when garbage collected, perhaps after the event
loop that made them is gone.
"""

from __future__ import annotations

import aiohttp
import httpx
from openai import AsyncOpenAI

from actors.agents.openai.example import calculate

MAX_TURNS = 3


def calc(argument: str) -> str:
    """Sum of non-negative integers joined by +, e.g. 1 2 + 3 4."""
    return calculate(argument)


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key="-", timeout=300)


async def openai_agents(base_url: str, messages: list[dict]) -> None:
    from agents import (Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, RunConfig, Runner,
                        function_tool)

    async with client(base_url) as c:
        agent = Agent(name="calculator", model=OpenAIChatCompletionsModel("tether", c),
                      tools=[function_tool(calc)])
        try:  # no tracing: it would export each run to api.openai.com
            await Runner.run(agent, messages, max_turns=MAX_TURNS,
                             run_config=RunConfig(tracing_disabled=True))
        except MaxTurnsExceeded:
            pass  # the endpoint's turn limit ended the conversation


async def langgraph(base_url: str, messages: list[dict]) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    # ChatOpenAI's own async client is cached per base URL and never closed: give it one
    async with httpx.AsyncClient(timeout=300) as http:
        model = ChatOpenAI(model="tether", api_key="-", base_url=base_url, temperature=0,
                           http_async_client=http)
        graph = create_react_agent(model, [tool(calc)])
        try:
            await graph.ainvoke({"messages": messages}, {"recursion_limit": 2 * MAX_TURNS + 1})
        except GraphRecursionError:
            pass


async def pydantic_ai(base_url: str, messages: list[dict]) -> None:
    from pydantic_ai import Agent, UnexpectedModelBehavior
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async with client(base_url) as c:
        agent = Agent(OpenAIChatModel("tether", provider=OpenAIProvider(openai_client=c)),
                      tools=[calc])
        try:
            await agent.run(messages[-1]["content"])
        except UnexpectedModelBehavior:
            pass


SHARED: aiohttp.ClientSession | None = None


async def shared_client(base_url: str, messages: list[dict]) -> None:
    """One call through a process-wide HTTP session made on first use, as libraries keep their
    async clients (openai-agents' default provider, langchain-openai per base URL, pydantic-ai):
    it belongs to the event loop that made it (aiohttp's, which says so at once)."""
    global SHARED
    SHARED = SHARED or aiohttp.ClientSession()
    async with SHARED.post(f"{base_url}/chat/completions",
                           json={"model": "tether", "messages": messages}) as r:
        r.raise_for_status()
