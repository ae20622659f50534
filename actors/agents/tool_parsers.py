"""Named parsers from a model turn's text to OpenAI tool calls (`actors.agent.tool_parser`).

    tether   the tiny models' format: the whole turn is `<call> NAME ARGUMENT </call>`
             -> one call, arguments `{"argument": "ARGUMENT"}` (actors/agents/tools.py parse_call)
    hermes   Qwen-family (Hermes) templates: optional text, then one or more
             `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>` blocks
             -> content = the text before the first block (None if empty), one call per block

A turn without the format's markers is plain content. A turn with markers that does not parse
is a `ParseFailure`: the endpoint returns it as plain content and counts it
(`tool_parse_errors`); the tool agent answers it with an error message. Parsers only read text:
the turn's sampled token ids are kept as they are.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from actors.agents.tools import CallError, parse_call


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str
    """A JSON object, as text (what OpenAI's `tool_calls[].function.arguments` holds)."""


@dataclass(frozen=True)
class ParsedTurn:
    content: str | None
    calls: list[FunctionCall]


@dataclass(frozen=True)
class ParseFailure:
    message: str


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedTurn | ParseFailure: ...


class TetherParser:
    name = "tether"

    def parse(self, text: str) -> ParsedTurn | ParseFailure:
        call = parse_call(text)
        if call is None:
            return ParsedTurn(text, [])
        if isinstance(call, CallError):
            return ParseFailure(call.message)
        return ParsedTurn(None, [FunctionCall(call.name, json.dumps({"argument": call.argument}))])


HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesParser:
    name = "hermes"

    def parse(self, text: str) -> ParsedTurn | ParseFailure:
        if "<tool_call>" not in text and "</tool_call>" not in text:
            return ParsedTurn(text, [])
        head = text.split("<tool_call>", 1)[0]
        blocks = HERMES_BLOCK.findall(text)
        rest = HERMES_BLOCK.sub("", text[len(head):]).strip()
        if not blocks or rest:
            return ParseFailure("expected text, then only <tool_call>{json}</tool_call> blocks")
        calls = []
        for block in blocks:
            try:
                obj = json.loads(block)
            except json.JSONDecodeError as e:
                return ParseFailure(f"a <tool_call> block is not JSON: {e}")
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                    and isinstance(obj.get("arguments", {}), dict)):
                return ParseFailure('a <tool_call> block must be {"name": str, "arguments": {...}}')
            calls.append(FunctionCall(obj["name"], json.dumps(obj.get("arguments", {}))))
        return ParsedTurn(head.strip() or None, calls)


PARSERS: dict[str, type] = {"tether": TetherParser, "hermes": HermesParser}


def make_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool parser {name!r} (parsers: {', '.join(PARSERS)})")
    return PARSERS[name]()


def argument_of(call: FunctionCall) -> str:
    """The one string argument a built-in tool takes (actors/agents/tools.py): the only string value of
    the arguments object (`{"argument": "1 + 2"}`, `{"expression": "1 + 2"}`, ...)."""
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        return call.arguments
    values = [v for v in args.values() if isinstance(v, str)] if isinstance(args, dict) else []
    return values[0] if len(values) == 1 else call.arguments
