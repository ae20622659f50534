"""What third-party clients send back to the actor's endpoint: compared by meaning (tool-call
arguments as parsed JSON, content as text parts or null), the recorded tokens always the sampled
ones; a real difference names the message and the field; a client's own temperature is
recorded as not applied instead of refused."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import openai
import pytest

from test_function_calling import (ANSWER, CALL, CHAT, TOOLS, ScriptedLLM, as_learner_receives,
                                   calc, client, endpoint, plain_agent, run_agent, task)


def _compact(message: dict) -> dict:
    """The assistant message as pydantic-ai and others send it back: arguments re-serialised
    without spaces, content as a list of text parts (or absent), no `type` on the calls."""
    out = {"role": "assistant"}
    if message.get("content"):
        out["content"] = [{"type": "text", "text": message["content"]}]
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "function": {
            "name": c["function"]["name"],
            "arguments": json.dumps(json.loads(c["function"]["arguments"]),
                                    separators=(",", ":"))}} for c in message["tool_calls"]]
    return out


async def compact_agent(base_url: str, messages: list[dict]) -> None:
    async with client(base_url) as c:
        for _ in range(3):
            r = await c.chat.completions.create(model="tether", messages=messages, tools=TOOLS,
                                                temperature=0)
            message = r.choices[0].message.model_dump(exclude_none=True)
            messages = [*messages, _compact(message)]
            if r.choices[0].finish_reason != "tool_calls":
                return
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": [{"type": "text",
                                              "text": calc(call["function"]["arguments"])}]})


def test_a_client_that_re_serialises_what_it_sends_back_gets_the_same_trajectory():
    """pydantic-ai failed on its first tool call: it sends the arguments back as
    {"argument":"12 + 30"} and the endpoint compared the conversation byte for byte."""
    plain = run_agent(plain_agent, ScriptedLLM([CALL, ANSWER]))
    compact = run_agent(compact_agent, ScriptedLLM([CALL, ANSWER]))
    assert compact.reward == plain.reward == 1.0
    for name in ("completion_ids", "logprobs", "versions", "loss_mask"):
        assert np.array_equal(getattr(compact, name), getattr(plain, name)), name
    as_learner_receives(compact)  # and the learner takes it


def test_a_client_may_leave_out_an_empty_answer():
    """pydantic-ai sends the conversation back without an answer that had no content and no
    tool calls (then asks again): that was refused as `messages[3].role differs`. The empty
    turn's tokens stay in the trajectory."""
    seen = []

    async def agent(base_url, messages):
        async with client(base_url) as c:
            r = await c.chat.completions.create(model="tether", messages=messages, tools=TOOLS)
            assert r.choices[0].message.content == ""
            again = [*messages, {"role": "user", "content": "Please answer."}]
            seen.append(await c.chat.completions.create(model="tether", messages=again,
                                                        tools=TOOLS))

    r = run_agent(agent, ScriptedLLM(["", ANSWER]))
    assert seen[0].choices[0].message.content == ANSWER and r.reward == 1.0
    assert CHAT.text(r.completion_ids).endswith(ANSWER) and r.loss_mask[0] == 1
    as_learner_receives(r)


def test_a_changed_message_is_refused_naming_the_message_and_the_field():
    ep = endpoint()
    prompt = CHAT.prompt_messages(task().prompt_ids, TOOLS)
    out = {}

    async def scenario():
        await ep.start()
        s = ep.open(task(), ScriptedLLM([CALL, ANSWER]))
        async with client(s.base_url) as c:
            first = await c.chat.completions.create(model="tether", messages=prompt, tools=TOOLS)
            reply = first.choices[0].message.model_dump(exclude_none=True)
            call = reply["tool_calls"][0]
            edited = {**reply, "tool_calls": [{**call, "function": {
                **call["function"], "arguments": '{"argument": "12 + 31"}'}}]}
            with pytest.raises(openai.APIStatusError) as e:
                await c.chat.completions.create(model="tether", tools=TOOLS, messages=[
                    *prompt, edited, {"role": "tool", "tool_call_id": call["id"], "content": "x"}])
            out["edited"] = e.value.body["message"]
        await ep.close_server()

    asyncio.run(scenario())
    k = len(prompt)
    assert out["edited"] == (
        f"messages[{k}].tool_calls[0].function.arguments differs from what the endpoint returned "
        "(got {'argument': '12 + 31'}, returned {'argument': '12 + 30'}): send assistant "
        "messages back exactly as returned (content and tool_calls; JSON arguments may be "
        "re-serialised)")


def test_a_clients_temperature_is_recorded_as_not_applied_and_the_tasks_is_used():
    """`ChatOpenAI(..., temperature=0)`, in most tutorials, got a 400."""
    ep = endpoint()
    prompt = CHAT.prompt_messages(task().prompt_ids, TOOLS)
    llm = ScriptedLLM([ANSWER])
    seen = {}

    async def scenario():
        await ep.start()
        s = ep.open(task(), llm)
        async with client(s.base_url) as c:
            r = await c.chat.completions.with_raw_response.create(
                model="tether", messages=prompt, tools=TOOLS, temperature=0, top_p=0.5)
            seen["body"] = json.loads(r.text)
        await ep.close_server()

    asyncio.run(scenario())
    assert seen["body"]["choices"][0]["message"]["content"] == ANSWER
    assert seen["body"]["tether_sampling"] == {
        "temperature": 1.0, "not_applied": {"temperature": 0.0, "top_p": 0.5},
        "why": "rollouts sample with the task's settings (task.temperature), whose logprobs "
               "the learner trains with"}


def test_the_openai_tools_example_runs_with_the_installed_openai_client():
    """It imported `httpx`, which openai 3.x no longer installs (it depends on httpx2)."""
    from actors.agents.openai.tools_example import calculator_agent

    r = run_agent(calculator_agent, ScriptedLLM([CALL, ANSWER]))
    assert r.reward == 1.0 and r.finish == "answer"
