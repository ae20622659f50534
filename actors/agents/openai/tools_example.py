"""A function-calling agent written with the official `openai` client only, for
`actors.agent=openai`:

    actors.agent=openai actors.agent.function=actors.agents.openai.tools_example:calculator_agent

It declares the calculator as an OpenAI tool, runs the calls the model makes
(`message.tool_calls`) and answers each with a `role: "tool"` message by `tool_call_id`, until
the model answers. Nothing in it is Tether's: the same function runs against any
OpenAI-compatible server. With the tiny calculator model the endpoint's `tether` parser turns
`<call> calc ARG </call>` into the call; a Qwen-family model would use `actors.agent.tool_parser=hermes`.

One HTTP client (a connection pool: `openai.DefaultHttpxClient`, an httpx client under
openai 1.x/2.x and an httpx2 one under 3.x) serves every rollout: each rollout only wraps it in an
`OpenAI` for its own base URL. A fresh `OpenAI(...)` per rollout builds its own pool and TLS
context, about 40 ms here, which at 64 rollouts a step cost more than the model did.
"""

from __future__ import annotations

import json

from openai import DefaultHttpxClient, OpenAI

from actors.agents.openai.example import calculate

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Sum of non-negative integers joined by +, e.g. 1 2 + 3 4.",
    "parameters": {"type": "object", "properties": {"argument": {"type": "string"}},
                   "required": ["argument"]}}}]


HTTP = DefaultHttpxClient(timeout=300)
"""Shared by every rollout's client (httpx clients are thread-safe); never closed by them. A
request waits for a place in the engine's batch: with 64 rollouts per actor on 2 loaded cores
one turn took over 60 s once (the timeout before). The client keeps its default retries (2): a
connection lost on loopback under load failed a rollout once with none, and the endpoint answers
a repeated call with the answer it already gave (actors/agents/openai/server.py, "Retries")."""


def calculator_agent(base_url: str, messages: list[dict], max_turns: int = 4) -> None:
    messages = list(messages)
    client = OpenAI(base_url=base_url, api_key="-", timeout=300, http_client=HTTP)
    for _ in range(max_turns):
        choice = client.chat.completions.create(model="tether", messages=messages,
                                                tools=TOOLS).choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return
        for call in choice.message.tool_calls:
            argument = json.loads(call.function.arguments)["argument"]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(argument)})
