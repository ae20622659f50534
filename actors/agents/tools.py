"""Tools for multi-turn agents: the call format, a registry, and two tools.

Call format (parsed strictly from a model turn's text): the whole turn is exactly one call,

    <call> NAME ARGUMENT </call>

NAME is an identifier, ARGUMENT free text (each tool parses its own argument strictly). A turn
with neither `<call>` nor `</call>` is a final answer. Anything else (two calls, text around the
call, a missing tag, an unknown tool, a bad argument, a timeout) is not an exception: the model
gets an error message back as the tool result (`error ...`) and may try again.

A tool signals a bad call by raising `ToolError`. Any other exception is a bug in the tool: it
fails the rollout, which the learner counts as an agent error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import resource
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Literal, Protocol

from actors.agents.sandbox import bwrap_argv, find_bwrap

log = logging.getLogger(__name__)

CALL = re.compile(r"\s*<call>\s*([A-Za-z_][A-Za-z0-9_]*)(?:\s+(.*?))?\s*</call>\s*", re.DOTALL)

OUTPUT_CHARS = 2000
"""A tool's answer is cut to this many characters."""


class ToolError(Exception):
    """The call was wrong (bad argument, tool failed); the message goes back to the model."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str


@dataclass(frozen=True)
class CallError:
    """A model turn that tried to call a tool but does not follow the call format."""

    message: str


def parse_call(text: str) -> ToolCall | CallError | None:
    """The call in a model turn, a CallError if the turn is a malformed call, None if an answer."""
    if "<call>" not in text and "</call>" not in text:
        return None
    if text.count("<call>") != 1 or text.count("</call>") != 1:
        return CallError("a turn must hold exactly one <call> NAME ARGUMENT </call>")
    match = CALL.fullmatch(text)
    if match is None:
        return CallError("expected <call> NAME ARGUMENT </call> and nothing around it")
    return ToolCall(name=match.group(1), argument=match.group(2) or "")


class Tool(Protocol):
    name: str
    description: str
    """One line for the model (the tool's OpenAI definition, rendered by chat templates)."""

    async def run(self, argument: str) -> str:
        """The answer to show the model; raise ToolError for a bad call. May be cancelled (timeout)."""


class ToolRegistry:
    """Runs calls by name with a per-call wall-clock timeout; always answers with text."""

    def __init__(self, tools: list[Tool], timeout_s: float) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s

    def definitions(self) -> list[dict]:
        """The tools as OpenAI function definitions: one string parameter, `argument`."""
        return [{"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": {"type": "object", "properties": {"argument": {"type": "string"}},
                           "required": ["argument"]}}} for t in self.tools.values()]

    async def call(self, call: ToolCall | CallError) -> str:
        if isinstance(call, CallError):
            return f"error malformed call: {call.message}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error unknown tool {call.name!r} (tools: {', '.join(sorted(self.tools))})"
        try:
            out = await asyncio.wait_for(tool.run(call.argument), self.timeout_s)
        except ToolError as e:
            return f"error {e}"[:OUTPUT_CHARS]
        except TimeoutError:
            return f"error {call.name} timed out after {self.timeout_s:g}s"
        return out[:OUTPUT_CHARS]


class Calculator:
    """Sums non-negative integers: `1 2 3 + 4 5` (digits may be spaced) -> `1 6 8`.
    The result is written digit by digit, which word-level tokenizers need."""

    name = "calc"
    description = "Sum of non-negative integers joined by +, e.g. 1 2 + 3 4."

    async def run(self, argument: str) -> str:
        expr = "".join(argument.split())
        if not re.fullmatch(r"\d{1,30}(\+\d{1,30}){0,9}", expr):
            raise ToolError("calc takes integers joined by +")
        return " ".join(str(sum(int(x) for x in expr.split("+"))))


class PythonTool:
    """Runs the argument as a Python program in a subprocess (isolated mode, own session) with
    limits on address space, CPU time and file size; the registry's timeout bounds wall time,
    and a cancelled call kills the process group. Answers with stdout, or an error message.

    sandbox="bwrap" (the default) runs it inside bubblewrap (actors/agents/sandbox.py), with a process
    limit too, and refuses to start without bwrap. sandbox="rlimits" is the limits alone: the
    code can read every file the actor can, reach the network and write anywhere (unsafe)."""

    name = "python"
    description = "Run a Python program; the answer is what it prints."

    def __init__(self, cpu_s: float, memory_mb: int, file_mb: int = 16,
                 sandbox: Literal["bwrap", "rlimits"] = "bwrap", max_procs: int = 16) -> None:
        self.cpu_s = max(1, math.ceil(cpu_s))
        self.memory_bytes = memory_mb * 1024 * 1024
        self.file_bytes = file_mb * 1024 * 1024
        self.sandbox = sandbox
        self.max_procs = max_procs
        self.bwrap = find_bwrap() if sandbox == "bwrap" else None
        if sandbox == "bwrap" and self.bwrap is None:
            raise RuntimeError("the python tool needs bubblewrap (`bwrap` on PATH; Debian/Ubuntu: "
                               "apt-get install bubblewrap), or "
                               "actors.agent.python_sandbox=rlimits to run model-written code "
                               "without a sandbox (unsafe)")
        if sandbox == "rlimits":
            log.warning("python tool without a sandbox (actors.agent.python_sandbox=rlimits): "
                        "model-written code can read the actor's files (CURVE keys), reach the "
                        "network and write anywhere the actor can")

    def argv(self, code: str) -> list[str]:
        if self.bwrap is not None:
            return bwrap_argv(self.bwrap, code)
        return [sys.executable, "-I", "-c", code]

    def _limit(self) -> None:
        """Runs in the child between fork and exec."""
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
        # SIGXCPU at the soft limit; the kernel's SIGKILL one second later if it is ignored
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_bytes, self.file_bytes))
        if self.bwrap is not None:  # applies to the sandboxed code's uid (actors/agents/sandbox.py)
            resource.setrlimit(resource.RLIMIT_NPROC, (self.max_procs, self.max_procs))

    async def run(self, argument: str) -> str:
        # Output goes to files (capped by RLIMIT_FSIZE), so a chatty program cannot fill our memory.
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(argument), stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=err, preexec_fn=self._limit, start_new_session=True)
            try:
                rc = await proc.wait()
            finally:
                if proc.returncode is None:  # cancelled by the registry's timeout
                    os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
            out.seek(0)
            err.seek(0)
            stdout = out.read(OUTPUT_CHARS).decode(errors="replace").strip()
            stderr = err.read(64 * 1024).decode(errors="replace").strip()
        if self.bwrap is not None and rc > 128:  # bwrap exits 128 + N when its child got signal N
            rc = 128 - rc
        if rc < 0:
            name = signal.Signals(-rc).name
            why = {"SIGXCPU": "cpu time limit", "SIGXFSZ": "file size limit"}.get(name, "signal")
            raise ToolError(f"python killed by {name} ({why})")
        if rc != 0:
            last = stderr.splitlines()[-1] if stderr else f"exit code {rc}"
            raise ToolError(f"python failed: {last}")
        return stdout


def make_tools(names: str, timeout_s: float, memory_mb: int, sandbox: str = "bwrap",
               max_procs: int = 16) -> ToolRegistry:
    """The registry for `actors.agent.tools` (comma-separated names, checked by the config)."""
    made = {"calc": Calculator,
            "python": lambda: PythonTool(timeout_s, memory_mb, sandbox=sandbox, max_procs=max_procs)}
    return ToolRegistry([made[n.strip()]() for n in names.split(",")], timeout_s)
