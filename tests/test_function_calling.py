"""OpenAI function calling and streaming on the actor's endpoint, driven by the official `openai`
client: tools rendered by a chat template, the hermes parser, `role: tool` messages, SSE, bad
input, and the tool agent speaking the same format.

The tiny models have no chat template with tools, so this file builds one: a locally trained
byte-level tokenizer (test_chat_template.chatml_tokenizer) with a Qwen2.5-style ChatML template
whose system message lists the tools and asks for `<tool_call>{json}</tool_call>`."""

from __future__ import annotations

import asyncio
import json
import socket

import msgspec
import numpy as np
import openai
import pytest

from actors.actor import _sample
from tasks.chat import TemplateChat
from actors.engines.base import Completion
from actors.agents.openai.server import OpenAIAgent, OpenAIEndpoint
from actors.agents.tool_agent import ToolAgent
from actors.agents.tool_parsers import FunctionCall, HermesParser, ParsedTurn, ParseFailure, TetherParser
from actors.rollout import RolloutTask
from actors.agents.tools import Calculator, ToolRegistry
from buffer.record import TrajGroup
from learner.leases import LeaseRecord
from learner.validate import to_group
from tasks.base import Prompt
from test_chat_template import chatml_tokenizer
from transport import messages as m

QWEN_TOOLS = (
    "<|im_start|>system\nYou add numbers."
    "{% if tools %}\n\n# Tools\n\nYou are provided with function signatures within <tools></tools>:"
    "\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\nFor each function "
    "call, return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>{% endif %}'
    "<|im_end|>\n"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen2.5's tool-use layout, shortened: tools in the system message, consecutive tool results
in one user turn as <tool_response> blocks, `<|im_end|>\\n` after every message."""

TOK = chatml_tokenizer(QWEN_TOOLS, name="local-qwen-tools")
CHAT = TemplateChat(TOK)
END = TOK.convert_tokens_to_ids("<|im_end|>")
TOOLS = ToolRegistry([Calculator()], 5.0).definitions()
QUESTION = [{"role": "user", "content": "What is 12 + 30 ?"}]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"argument": "12 + 30"}}\n</tool_call>'
ANSWER = "4 2"


def ids(text: str) -> np.ndarray:
    return np.asarray(TOK.encode(text, add_special_tokens=False), dtype=np.int32)


class ScriptedLLM:
    """A named fake engine client: each generate() answers the next scripted turn + <|im_end|>,
    logprob -0.1 * (turn + 1), weight version 7. `gate`, if set, is awaited first."""

    def __init__(self, turns: list[str], gate: asyncio.Event | None = None) -> None:
        self.turns = turns
        self.gate = gate
        self.contexts: list[np.ndarray] = []

    async def generate(self, prompt_ids, max_new_tokens, temperature, seed) -> Completion:
        if self.gate is not None:
            await self.gate.wait()
        k = len(self.contexts)
        self.contexts.append(np.asarray(prompt_ids).copy())
        tok = np.concatenate([ids(self.turns[min(k, len(self.turns) - 1)]), [END]])
        tok = tok[:max_new_tokens].astype(np.int32)
        return Completion(token_ids=tok, logprobs=np.full(len(tok), -0.1 * (k + 1), np.float32),
                          versions=np.full(len(tok), 7, np.int32),
                          finish_reason="stop" if tok[-1] == END else "length")


def task(index: int = 0) -> RolloutTask:
    return RolloutTask(prompt_id=3, sample_index=index, prompt_ids=CHAT.start(QUESTION, TOOLS),
                       meta={}, max_new_tokens=100, temperature=1.0, run_seed=0)


def endpoint(max_turns: int = 3) -> OpenAIEndpoint:
    return OpenAIEndpoint(CHAT, 0, max_turns=max_turns, max_total_tokens=300, parser=HermesParser())


def calc(arguments: str) -> str:
    """The client's own calculator: `{"argument": "12 + 30"}` -> `4 2`."""
    return " ".join(str(sum(int(x) for x in json.loads(arguments)["argument"].split("+"))))


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=30)


async def tool_loop(base_url: str, messages: list[dict], stream: bool = False) -> list:
    """A function-calling agent written with the openai client only: call, run the tools the
    model asked for, send their results back by tool_call_id, until it answers."""
    seen = []
    async with client(base_url) as c:
        for _ in range(3):
            if stream:
                message, finish = await streamed(c, messages, seen)
            else:
                r = await c.chat.completions.create(model="tether", messages=messages, tools=TOOLS)
                message, finish = r.choices[0].message, r.choices[0].finish_reason
                seen.append(r)
                message = message.model_dump(exclude_none=True)
            messages = [*messages, message]
            if finish != "tool_calls":
                return seen
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": calc(call["function"]["arguments"])})
    return seen


async def plain_agent(base_url: str, messages: list[dict]) -> None:
    await tool_loop(base_url, messages)


async def streamed(c: openai.AsyncOpenAI, messages: list[dict], seen: list) -> tuple[dict, str]:
    """One streamed call, its chunks put together into the assistant message."""
    content, calls, finish, usage = "", [], None, None
    stream = await c.chat.completions.create(model="tether", messages=messages, tools=TOOLS,
                                             stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [tc.model_dump(exclude_none=True) for tc in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    seen.append((content, calls, finish, usage))
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in calls]
    return message, finish


def run_agent(fn, llm, tool_defs=TOOLS, ep=None):
    ep = ep or endpoint()
    agent = OpenAIAgent(ep, fn, lambda meta, ids: float(ANSWER in TOK.decode(ids)),
                        tool_defs=tool_defs)

    async def go():
        try:
            return await agent.run(task(), llm)
        finally:
            await ep.close_server()

    return asyncio.run(go())


def as_learner_receives(r) -> tuple[m.GroupResult, TrajGroup]:
    """The rollout as the actor sends it (a group of one) and the learner decodes and validates
    it: the decoded message and the record."""
    sample, tokens = _sample(0, r)
    msg = m.pack_group(lease_id=1, actor_id="a", prompt_id=3, samples=[sample], tokens=[tokens])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=m.GroupResult)
    rec = LeaseRecord(lease_id=1, prompt=Prompt(3, task().prompt_ids, {}), actor_id="a",
                      incarnation="i", num_samples=1, min_version=0)
    group = to_group(decoded, rec, vocab_size=len(TOK), latest_version=7, max_tokens=300)
    return decoded, group


# ------------------------------------------------------------------ parsers


@pytest.mark.parametrize("text, want", [
    ("4 2", ParsedTurn("4 2", [])),
    (CALL, ParsedTurn(None, [FunctionCall("calc", '{"argument": "12 + 30"}')])),
    ("Let me add.\n" + CALL + "\n" + CALL.replace("12", "1"),
     ParsedTurn("Let me add.", [FunctionCall("calc", '{"argument": "12 + 30"}'),
                                FunctionCall("calc", '{"argument": "1 + 30"}')])),
    ("<tool_call>{not json}</tool_call>", ParseFailure),
    ('<tool_call>{"arguments": {}}</tool_call>', ParseFailure),
    (CALL + " and more", ParseFailure),
    ("<tool_call>" + CALL[11:-12], ParseFailure),
])
def test_hermes_parser(text, want):
    got = HermesParser().parse(text)
    assert got == want if isinstance(want, ParsedTurn) else isinstance(got, want), got


def test_tether_parser_keeps_the_call_format():
    assert TetherParser().parse("<call> calc 1 + 2 </call>") == \
        ParsedTurn(None, [FunctionCall("calc", '{"argument": "1 + 2"}')])
    assert TetherParser().parse("4 2") == ParsedTurn("4 2", [])
    assert isinstance(TetherParser().parse("x <call> calc 1 </call>"), ParseFailure)


# ------------------------------------------------------------------ the openai client


def expected_completion() -> tuple[np.ndarray, np.ndarray]:
    """Token ids and mask of prompt -> call -> tool response -> answer, built independently of
    the endpoint from the template's own rendering."""
    call, answer = np.concatenate([ids(CALL), [END]]), np.concatenate([ids(ANSWER), [END]])
    history = [*QUESTION, {"role": "assistant", "content": CALL}]
    before = TOK.apply_chat_template(history, tools=TOOLS, tokenize=False)
    after = TOK.apply_chat_template([*history, {"role": "tool", "content": "4 2"}], tools=TOOLS,
                                    tokenize=False, add_generation_prompt=True)
    tool = ids("\n" + after[len(before):])  # the template's "\n" after the sampled <|im_end|>
    mask = np.concatenate([np.ones(len(call)), np.zeros(len(tool)), np.ones(len(answer))])
    return np.concatenate([call, tool, answer]), mask


def test_openai_client_tool_loop_trajectory_is_what_the_learner_receives():
    llm = ScriptedLLM([CALL, ANSWER])
    seen = []

    async def agent(base_url, messages):
        seen.extend(await tool_loop(base_url, messages))

    r = run_agent(agent, llm)
    first, second = seen
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == \
        ("function", "calc", {"argument": "12 + 30"})
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == ANSWER
    assert second.choices[0].message.tool_calls is None
    assert first.usage.prompt_tokens == len(task().prompt_ids)
    want_ids, want_mask = expected_completion()
    sent, group = as_learner_receives(r)
    np.testing.assert_array_equal(sent.completion_ids.to_numpy(), want_ids)
    np.testing.assert_array_equal(sent.loss_mask.to_numpy(), want_mask)
    np.testing.assert_array_equal(sent.versions.to_numpy(), np.where(want_mask == 1, 7, -1))
    n_call = len(ids(CALL)) + 1
    np.testing.assert_allclose(sent.logprobs.to_numpy(), np.concatenate(
        [np.full(n_call, -0.1), np.zeros(int((want_mask == 0).sum())),
         np.full(len(want_ids) - n_call - int((want_mask == 0).sum()), -0.2)]))
    # the tools were rendered into the prompt the model saw; the second turn continues the ids
    assert '"name": "calc"' in TOK.decode(task().prompt_ids)
    np.testing.assert_array_equal(llm.contexts[1], np.concatenate([task().prompt_ids,
                                                                   want_ids[:n_call + (want_mask == 0).sum()]]))
    assert r.reward == 1.0 and r.finish == "answer" and r.tool_parse_errors == 0
    assert sent.samples[0].tool_parse_errors == 0 and len(group.completions) == 1


def test_streaming_gives_the_same_answers_and_trajectory():
    plain = run_agent(plain_agent, ScriptedLLM([CALL, ANSWER]))
    seen = []

    async def agent(base_url, messages):
        seen.extend(await tool_loop(base_url, messages, stream=True))

    streamed_r = run_agent(agent, ScriptedLLM([CALL, ANSWER]))
    (c1, calls1, f1, u1), (c2, calls2, f2, u2) = seen
    assert (c1, f1) == ("", "tool_calls") and calls1[0]["function"]["name"] == "calc"
    assert (c2, calls2, f2) == (ANSWER, [], "stop")
    assert u1.completion_tokens == len(ids(CALL)) + 1 and u2.completion_tokens == len(ids(ANSWER)) + 1
    for field in ("completion_ids", "logprobs", "versions", "loss_mask"):
        np.testing.assert_array_equal(getattr(streamed_r, field), getattr(plain, field))


def test_the_tool_agent_speaks_the_same_format_and_gets_the_same_trajectory():
    via_http = run_agent(plain_agent, ScriptedLLM([CALL, ANSWER]))
    agent = ToolAgent(lambda meta, ids: float(ANSWER in TOK.decode(ids)), CHAT,
                      ToolRegistry([Calculator()], 5.0), 3, 300, HermesParser(), TOOLS)
    direct = asyncio.run(agent.run(task(), ScriptedLLM([CALL, ANSWER])))
    for field in ("completion_ids", "logprobs", "versions", "loss_mask"):
        np.testing.assert_array_equal(getattr(via_http, field), getattr(direct, field))
    assert direct.reward == via_http.reward == 1.0 and direct.finish == "answer"


@pytest.mark.parametrize("turn", ["<tool_call>{not json}</tool_call>",
                                  '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>'])
def test_a_turn_that_does_not_parse_is_content_and_counted(turn):
    seen = []

    async def agent(base_url, messages):
        seen.extend(await tool_loop(base_url, messages))

    r = run_agent(agent, ScriptedLLM([turn]))
    (only,) = seen
    assert only.choices[0].finish_reason == "stop" and only.choices[0].message.content == turn
    assert r.tool_parse_errors == 1 and as_learner_receives(r)[0].samples[0].tool_parse_errors == 1
    direct = asyncio.run(ToolAgent(lambda meta, ids: 0.0, CHAT, ToolRegistry([Calculator()], 5.0),
                                   1, 300, HermesParser(), TOOLS).run(task(), ScriptedLLM([turn])))
    assert direct.tool_parse_errors == (1 if "not json" in turn else 0)


# ------------------------------------------------------------------ bad input


async def _raw(port: int, request: bytes) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    body = await reader.readexactly(length)
    writer.close()
    return int(head.split(b" ")[1]), json.loads(body)


def test_bad_input_gets_a_clear_error_and_the_endpoint_goes_on():
    ep = endpoint()
    prompt = CHAT.prompt_messages(task().prompt_ids, TOOLS)
    out = {}

    async def scenario():
        await ep.start()
        s = ep.open(task(), ScriptedLLM([CALL, ANSWER]))
        async with client(s.base_url) as c:
            async def fails(name, **kw):
                with pytest.raises(openai.APIStatusError) as e:
                    await c.chat.completions.create(model="tether", **kw)
                out[name] = (e.value.status_code, e.value.body["message"])

            path = f"/rollout/{s.rid}/v1/chat/completions"
            body = b"{not json"
            out["json"] = await _raw(ep.port, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Type: application/json\r\nContent-Length: "
                                     + str(len(body)).encode() + b"\r\n\r\n" + body)
            big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
            out["big"] = await _raw(ep.port, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Length: " + str(len(big)).encode() + b"\r\n\r\n" + big)
            await fails("unknown_tool", messages=prompt, tools=TOOLS,
                        tool_choice={"type": "function", "function": {"name": "rm"}})
            first = await c.chat.completions.create(model="tether", messages=prompt, tools=TOOLS)
            reply = first.choices[0].message.model_dump(exclude_none=True)
            await fails("wrong_id", tools=TOOLS, messages=[
                *prompt, reply, {"role": "tool", "tool_call_id": "call_nope", "content": "4 2"}])
            await fails("edited_call", tools=TOOLS, messages=[
                *prompt, {**reply, "tool_calls": [{**reply["tool_calls"][0], "id": "call_x"}]},
                {"role": "tool", "tool_call_id": "call_x", "content": "4 2"}])
            await fails("other_tools", messages=[*prompt, reply, {
                "role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "4 2"}])
            # after every refusal the same rollout goes on
            second = await c.chat.completions.create(model="tether", tools=TOOLS, messages=[
                *prompt, reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                                 "content": "4 2"}])
            out["second"] = second.choices[0].message.content
        await ep.close_server()

    asyncio.run(scenario())
    assert out["json"][0] == 400 and "bad request body" in out["json"][1]["error"]["message"]
    assert out["big"][0] == 413 and "Request Entity Too Large" in out["big"][1]["error"]["message"]
    assert out["unknown_tool"][0] == 400 and "unknown tool 'rm'" in out["unknown_tool"][1]
    assert out["wrong_id"][0] == 400 and "tool_call_id 'call_nope'" in out["wrong_id"][1]
    assert out["edited_call"][0] == 400 and "exactly as returned" in out["edited_call"][1]
    assert out["other_tools"][0] == 400 and "same in every call" in out["other_tools"][1]
    assert out["second"] == ANSWER


def test_a_client_that_disconnects_mid_stream_fails_its_rollout_and_the_endpoint_goes_on():
    ep = endpoint()
    prompt = CHAT.prompt_messages(task().prompt_ids, TOOLS)

    async def scenario():
        gate = asyncio.Event()
        agent = OpenAIAgent(ep, None, lambda meta, ids: 0.0, tool_defs=TOOLS)

        async def hang_up(base_url, messages):
            body = json.dumps({"messages": prompt, "tools": TOOLS, "stream": True}).encode()
            path = base_url.split(str(ep.port), 1)[1] + "/chat/completions"
            reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
            writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                         .encode() + body)
            await writer.drain()
            while not ep.sessions[base_url.split("/")[-2]].lock.locked():
                await asyncio.sleep(0.01)  # polling with a deadline below: the request is in
            writer.transport.abort()       # then the client goes away mid-stream
            for _ in range(500):
                if not ep.http.runner.server.connections:
                    break
                await asyncio.sleep(0.01)
            gate.set()
            s = ep.sessions[base_url.split("/")[-2]]
            for _ in range(500):
                if s.error is not None:
                    break
                await asyncio.sleep(0.01)

        agent.fn = hang_up
        with pytest.raises(ConnectionResetError, match="disconnected mid-stream"):
            await agent.run(task(), ScriptedLLM([CALL], gate=gate))
        # the endpoint still serves the next rollout
        agent.fn = plain_agent
        r = await agent.run(task(1), ScriptedLLM([CALL, ANSWER]))
        await ep.close_server()
        return r

    r = asyncio.run(scenario())
    assert r.finish == "answer" and (r.loss_mask == 0).any()


def test_concurrent_first_rollouts_wait_for_the_server_to_listen():
    ep = endpoint()
    agent = OpenAIAgent(ep, plain_agent, lambda meta, ids: float(ANSWER in TOK.decode(ids)),
                        tool_defs=TOOLS)

    async def go():
        rs = await asyncio.gather(*(agent.run(task(i), ScriptedLLM([CALL, ANSWER]))
                                    for i in range(4)))
        await ep.close_server()
        return rs

    assert [r.reward for r in asyncio.run(go())] == [1.0] * 4


def test_a_chunked_request_body_on_a_kept_alive_connection_is_read():
    ep = endpoint()
    prompt = CHAT.prompt_messages(task().prompt_ids, TOOLS)

    async def scenario():
        await ep.start()
        s = ep.open(task(), ScriptedLLM([CALL, ANSWER]))
        body = json.dumps({"messages": prompt, "tools": TOOLS}).encode()
        half = len(body) // 2
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:]))
        path = f"/rollout/{s.rid}/v1/chat/completions".encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
        writer.write(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: application/json\r\n\r\n" + chunked + b"0\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        first = json.loads(await reader.readexactly(length))
        # the same connection serves the next request (keep-alive): an unknown rollout, 404
        writer.write(b"POST /rollout/nope/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 16\r\n\r\n{\"messages\": []}")
        head2 = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        await ep.close_server()
        return head, first, head2

    head, first, head2 = asyncio.run(scenario())
    assert head.startswith(b"HTTP/1.1 200") and first["choices"][0]["finish_reason"] == "tool_calls"
    assert head2.startswith(b"HTTP/1.1 404")


def test_a_retried_call_gets_the_same_answer_and_is_recorded_once(caplog):
    """A client's retries (the OpenAI client's default) are safe: a call whose body was cut off
    is not applied, and a call repeated after its answer was lost gets that answer again."""
    ep = endpoint()
    llm = ScriptedLLM([CALL, ANSWER])
    seen = []

    async def agent(base_url, messages):
        body = json.dumps({"messages": messages, "tools": TOOLS}).encode()
        path = base_url.split(str(ep.port), 1)[1] + "/chat/completions"
        _, writer = await asyncio.open_connection("127.0.0.1", ep.port)
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body[:len(body) // 2])
        await writer.drain()
        writer.transport.abort()  # the connection is lost with half the body sent
        async with client(base_url) as c:
            for _ in range(2):  # the second: a retry after a lost answer
                seen.append(await c.chat.completions.create(model="tether", messages=messages,
                                                            tools=TOOLS))
        await tool_loop(base_url, messages)  # from the start again: its first call is a retry

    with caplog.at_level("INFO"):
        r = run_agent(agent, llm, ep=ep)
    first, again = seen
    assert first.model_dump() == again.model_dump()
    assert first.choices[0].finish_reason == "tool_calls"
    assert len(llm.contexts) == 2  # the model was asked twice: the two turns, nothing again
    want_ids, want_mask = expected_completion()
    np.testing.assert_array_equal(r.completion_ids, want_ids)
    np.testing.assert_array_equal(r.loss_mask, want_mask)
    assert r.reward == 1.0 and r.finish == "answer"
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"], caplog.text
