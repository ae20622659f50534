"""The OpenAI chat-completions wire format as the actor's endpoint speaks it: the request
fields it honours (typed, validated on decode; others are ignored) and the response, stream
chunk and error bodies it sends."""

from __future__ import annotations

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


class ChatMessage(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None


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


def message_key(m: ChatMessage) -> tuple:
    """What must repeat exactly when a client sends the conversation back."""
    calls = tuple((c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
    return (m.role, m.content or "", calls, m.tool_call_id or "")


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": status}}


def completion_body(cid: str, message: dict, finish: str, usage: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": "tether",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage}


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
