"""An agent written against the OpenAI chat-completions wire format, for `actors.agent=openai`.

It knows nothing about Tether: plain HTTP (urllib), OpenAI request/response JSON, its own tool
handling. Run it as an actor with

    actors.agent=openai actors.agent.function=actors.agents.openai.example:calculator_agent

With the `openai` package the same loop would be
`OpenAI(base_url=base_url, api_key="-").chat.completions.create(model="tether", messages=...)`.
"""

from __future__ import annotations

import json
import re
import urllib.request

CALL = re.compile(r"\s*<call>\s*calc\s+(.*?)\s*</call>\s*", re.DOTALL)
SUM = re.compile(r"\d{1,30}(\+\d{1,30}){0,9}")


def chat(base_url: str, messages: list[dict[str, str]], max_tokens: int | None = None) -> dict:
    """One POST /chat/completions; returns the parsed OpenAI response."""
    body = {"model": "tether", "messages": messages}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    req = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def calculate(argument: str) -> str:
    """`1 2 + 3 4` -> `4 6` (digit by digit, as the tiny tokenizer needs); a bad expression
    gets an error message back, so the model may try again."""
    expr = "".join(argument.split())
    if not SUM.fullmatch(expr):
        return "error calc takes integers joined by +"
    return " ".join(str(sum(int(x) for x in expr.split("+"))))


def calculator_agent(base_url: str, messages: list[dict[str, str]], max_turns: int = 4) -> None:
    """Ask; while the model calls the calculator, answer the call and ask again."""
    messages = list(messages)
    for _ in range(max_turns):
        reply = chat(base_url, messages)["choices"][0]
        content = reply["message"]["content"]
        messages.append({"role": "assistant", "content": content})
        call = CALL.fullmatch(content)
        if call is None or reply["finish_reason"] != "stop":
            return
        messages.append({"role": "tool", "content": calculate(call.group(1))})
