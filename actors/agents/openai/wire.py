"""The OpenAI chat-completions wire format as the actor's endpoint speaks it: the request
fields it honours (typed, validated on decode; others are ignored) and the response, stream
chunk and error bodies it sends."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import msgspec


class HTTPError(Exception):
    """A request the endpoint refuses: the status and a message naming what was wrong."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class FunctionSpec(msgspec.Struct):
    name: str
    description: str = ""
    parameters: dict[str, Any] = {}
    strict: bool | None = None


class ToolSpec(msgspec.Struct):
    """An entry of `tools`: a function the model may call (rendered by the chat template)."""

    function: FunctionSpec
    type: Literal["function"] = "function"


class CallFunction(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    """An entry of an assistant message's `tool_calls`."""

    id: str
    function: CallFunction
    type: Literal["function"] = "function"


class ContentPart(msgspec.Struct):
    """A part of a message's content given as a list (only text parts are taken)."""

    type: str
    text: str = ""


class ChatMessage(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string: text parts joined, null as "" (what clients send back
        for the same content differs in these forms only)."""
        if isinstance(self.content, list):
            kinds = sorted({p.type for p in self.content} - {"text"})
            if kinds:
                raise HTTPError(400, f"{self.role} message content parts of type {kinds} are not "
                                     "supported (text only)")
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(msgspec.Struct):
    include_usage: bool = True


class NamedTool(msgspec.Struct):
    function: dict[str, str]
    type: Literal["function"] = "function"


class ChatRequest(msgspec.Struct):
    messages: list[ChatMessage]
    model: str = ""
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[dict[str, Any]] | None = None
    """As the client sent them: rendered by the chat template as they are (see `tool_names`)."""
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    user: str = ""


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """The function names of `tools`, after checking each entry is a ToolSpec."""
    try:
        return [t.function.name for t in msgspec.convert(tools, list[ToolSpec])]
    except msgspec.ValidationError as e:
        raise HTTPError(400, f"bad request body: tools: {e}") from None


SAMPLING_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
"""A request's own sampling settings: never applied (rollouts sample with the task's), and
recorded in the answer's `tether_sampling` when given with another value."""


def not_applied(req: ChatRequest, temperature: float) -> dict[str, float]:
    """The request's sampling settings that differ from what the endpoint samples with."""
    asked = {name: getattr(req, name) for name in SAMPLING_FIELDS}
    neutral = {"temperature": temperature, "top_p": 1.0, "presence_penalty": 0.0,
               "frequency_penalty": 0.0}
    return {k: v for k, v in asked.items() if v is not None and v != neutral.get(k)}


def _arguments(text: str) -> object:
    """Tool-call arguments by meaning: the parsed JSON (clients re-serialise it), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def message_key(m: ChatMessage) -> tuple:
    """What must repeat when a client sends the conversation back: the role, the content's
    text, each call's id, name and arguments (as parsed JSON, canonically written), and the
    tool_call_id."""
    calls = tuple((c.id, c.function.name, json.dumps(_arguments(c.function.arguments),
                                                     sort_keys=True))
                  for c in m.tool_calls or ())
    return (m.role, m.text(), calls, m.tool_call_id or "")


def first_difference(got: ChatMessage, had: ChatMessage) -> tuple[str, object, object] | None:
    """The first field (as a path below the message) where `got` means something else than
    `had`, with both values; None when they mean the same."""
    if got.role != had.role:
        return "role", got.role, had.role
    if got.text() != had.text():
        return "content", got.text(), had.text()
    calls, had_calls = got.tool_calls or [], had.tool_calls or []
    if len(calls) != len(had_calls):
        return "tool_calls", f"{len(calls)} calls", f"{len(had_calls)} calls"
    for k, (c, h) in enumerate(zip(calls, had_calls)):
        for name, a, b in (("id", c.id, h.id), ("function.name", c.function.name, h.function.name),
                           ("function.arguments", _arguments(c.function.arguments),
                            _arguments(h.function.arguments))):
            if a != b:
                return f"tool_calls[{k}].{name}", a, b
    if (got.tool_call_id or "") != (had.tool_call_id or ""):
        return "tool_call_id", got.tool_call_id, had.tool_call_id
    return None


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": status}}


def completion_body(cid: str, message: dict, finish: str, usage: dict,
                    sampling: dict | None = None) -> dict:
    """`sampling`, if given, is the answer's `tether_sampling`: what was sampled with and which
    of the request's own settings were not applied."""
    out = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": "tether",
           "choices": [{"index": 0, "message": message, "finish_reason": finish}],
           "usage": usage}
    if sampling:
        out["tether_sampling"] = sampling
    return out


def chunk_body(cid: str, delta: dict, finish: str | None, usage: dict | None = None) -> dict:
    """One `chat.completion.chunk`; the usage chunk has no choices."""
    choices = [] if usage is not None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    out = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
           "model": "tether", "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def stream_chunks(cid: str, deltas: list[str], message: dict, finish: str,
                  usage: dict | None) -> list[dict]:
    """A finished turn as stream chunks: the role, one content delta per token's text, the tool
    calls (one chunk each, whole), the finish reason, then the usage (if asked for)."""
    out = [chunk_body(cid, {"role": "assistant", "content": ""}, None)]
    if message.get("content") is not None:
        out += [chunk_body(cid, {"content": d}, None) for d in deltas if d]
    for i, call in enumerate(message.get("tool_calls") or []):
        out.append(chunk_body(cid, {"tool_calls": [{"index": i, **call}]}, None))
    out.append(chunk_body(cid, {}, finish))
    if usage is not None:
        out.append(chunk_body(cid, {}, None, usage))
    return out
