"""An OpenAI-compatible chat-completions endpoint per actor, recording token-level trajectories.

    OpenAIAgent.run(task, llm)                      your agent (any OpenAI client, sync or async)
      open a session -> base_url ----------------->  fn(base_url, messages)
                                                       POST {base_url}/chat/completions
      endpoint: check the messages extend the          (tools, tool_choice, stream)
      conversation, render only the new ones           <- message / tool_calls, or SSE chunks
      (mask 0), generate (mask 1), parse tool calls
      fn returns -> close the session -> Rollout (reward from the task on the completion ids)

Every rollout gets its own base URL, http://127.0.0.1:PORT/rollout/RID/v1, so each call is
applied to that rollout's trajectory (a plain /v1/chat/completions with `"user": RID` works
too). Assistant turns are kept as the sampled token ids, never re-tokenized: the client must
send back the assistant messages exactly as it got them (content and tool_calls). The first
call's messages (and `tools`, rendered by the chat template) must render to the task prompt
(`messages` handed to your function are exactly that); later calls must send the same `tools`.
An answer with no content and no tool calls may be left out (pydantic-ai does).

Function calling: with `tools` (and `tool_choice` not "none"), a model turn that ended with its
end-of-turn token is parsed by the configured parser (actors/agents/tool_parsers.py) into
`message.tool_calls` with finish_reason "tool_calls". A turn that does not parse, or calls a
tool not in `tools`, is returned as plain content and counted (the rollout's
`tool_parse_errors`). `role: "tool"` messages must answer an open call of the last assistant
message by its `tool_call_id`; they are rendered by the chat format with mask 0. There is no
constrained decoding: "required" and a named `tool_choice` are accepted but not enforced.

Streaming (`stream: true`): server-sent events; the turn is generated whole, then sent as a role
chunk, one content delta per token, the tool calls, the finish reason, a usage chunk and
`[DONE]`. A client that disconnects mid-stream fails its rollout (the turn it did not see is in
the trajectory); the actor goes on.

Retries: a call that repeats the last call's messages exactly (the OpenAI client retrying after
a lost connection or a timeout) gets the last call's answer again and records nothing; a call
whose body never arrived was never applied. So clients may keep their default `max_retries`.

A client's own `temperature`, `top_p`, ... are not applied (rollouts sample with the task's) and
are named in the answer's `tether_sampling`; `max_tokens` can only lower the per-turn limit.
Past `max_turns` model turns or `max_total_tokens` tokens, an answer is empty with finish_reason
"length". Only 127.0.0.1 is bound: the endpoint has no auth. Bodies over 1 MiB get 413.
The HTTP server is aiohttp's, on the actor's event loop (actors/agents/openai/http.py).

Your function runs in its own thread pool (sync) or on the actor's loop (async), never in the
engine's worker threads, so a blocking client cannot starve generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import numpy as np

from tasks.chat import ChatFormat, Message, Tools
from actors.engines.base import Completion, LLMClient
from actors.agents.openai.http import HTTPServer
from actors.agents.openai.wire import (ChatMessage, ChatRequest, HTTPError, NamedTool,
                                       first_difference, message_key, not_applied, tool_names)
from actors.rollout import Finish, RewardFn, Rollout, RolloutTask, score
from actors.agents.tool_parsers import ParsedTurn, ParseFailure, TetherParser, ToolParser
from actors.agents.trajectory import TrajectoryBuilder
from configs.imports import load_function

log = logging.getLogger(__name__)


@dataclass
class Turn:
    """One answer: the assistant message, why it ended, the usage, the sampled ids."""

    message: dict
    finish: str
    usage: dict
    token_ids: np.ndarray
    cid: str
    sampling: dict | None = None
    """The answer's `tether_sampling` when the request's own sampling settings were not applied."""


@dataclass
class Session:
    """One rollout served through the endpoint."""

    rid: str
    task: RolloutTask
    llm: LLMClient
    traj: TrajectoryBuilder
    base_url: str
    keys: list[tuple] = field(default_factory=list)
    """message_key of every message so far, our answers included (what clients must repeat)."""
    messages: list[ChatMessage] = field(default_factory=list)
    """The same messages (to say which field of a resent one differs)."""
    rendered: list[Message] = field(default_factory=list)
    """The same messages as the chat format sees them (assistant: the turn's whole text)."""
    tools: list[dict] | None = None
    """The first call's `tools`; every later call must send the same."""
    open_calls: list[str] = field(default_factory=list)
    """ids of the last turn's tool calls that no tool message has answered yet."""
    tool_parse_errors: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    error: BaseException | None = None
    """An engine or chat-format failure, or a client gone mid-stream: fails the rollout."""
    last_turn: Completion | None = None
    """The newest model turn as generated."""
    finish: Finish | None = None
    """Set when a turn or token limit was reached; later calls get empty answers."""
    last_call: tuple[list[tuple], Turn] | None = None
    """The last answered call's message keys and its answer: a retry of that call gets it again."""

    def finish_reason(self) -> Finish:
        """How the rollout ended once the client is done: a limit it hit, the last turn cut at
        the per-turn token limit, or else an answer."""
        if self.finish is not None:
            return self.finish
        cut = self.last_turn is not None and self.last_turn.finish_reason == "length"
        return Finish.MAX_TOKENS if cut else Finish.ANSWER


class OpenAIEndpoint:
    def __init__(self, chat: ChatFormat, port: int, max_turns: int, max_total_tokens: int,
                 parser: ToolParser | None = None) -> None:
        self.chat = chat
        self.parser = parser or TetherParser()
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.sessions: dict[str, Session] = {}
        self.said_not_applied = False
        """Whether a client's own sampling settings were logged as not applied (once)."""
        self._ids = itertools.count()
        self.http = HTTPServer(self, port)

    @property
    def port(self) -> int:
        return self.http.port

    async def start(self) -> None:
        """Listen on 127.0.0.1 (once; later calls return at once)."""
        await self.http.start()

    async def close_server(self) -> None:
        await self.http.close()

    def open(self, task: RolloutTask, llm: LLMClient) -> Session:
        rid = f"{task.prompt_id}-{task.sample_index}-{next(self._ids)}"
        s = Session(rid=rid, task=task, llm=llm,
                    traj=TrajectoryBuilder(task.prompt_ids, self.max_total_tokens),
                    base_url=f"http://127.0.0.1:{self.port}/rollout/{rid}/v1")
        self.sessions[rid] = s
        return s

    def close(self, rid: str) -> Session:
        return self.sessions.pop(rid)

    def session(self, rid: str) -> Session:
        s = self.sessions.get(rid)
        if s is None:
            raise HTTPError(404, f"no open rollout {rid!r}")
        return s

    # ------------------------------------------------------------ one call
    async def complete(self, s: Session, req: ChatRequest) -> Turn:
        """Answer one call (the caller holds `s.lock`); a retry of the last call gets its answer."""
        keys = [message_key(m) for m in req.messages]
        if s.last_call is not None and s.last_call[0] == keys:
            log.info("rollout %s: call repeated (a client retry): the same answer again", s.rid)
            return s.last_call[1]
        turn = await self._turn(s, req, keys)
        ignored = not_applied(req, s.task.temperature)
        if ignored:
            turn = dataclasses.replace(turn, sampling={
                "temperature": s.task.temperature, "not_applied": ignored,
                "why": "rollouts sample with the task's settings (task.temperature), whose "
                       "logprobs the learner trains with"})
            if not self.said_not_applied:
                self.said_not_applied = True
                log.info("a client asked for %s: not applied (said in each such answer's "
                         "tether_sampling); rollouts sample with the task's temperature=%g",
                         ", ".join(f"{k}={v}" for k, v in ignored.items()), s.task.temperature)
        s.last_call = (keys, turn)
        return turn

    async def _turn(self, s: Session, req: ChatRequest, keys: list[tuple]) -> Turn:
        task, traj = s.task, s.traj
        if req.n != 1:
            raise HTTPError(400, "only n=1 is supported")
        tools = self._check_tools(s, req)
        new = self._new_messages(s, req.messages, keys)
        if s.finish is not None:  # a limit was reached: every further call gets an empty answer
            return self._refuse(s, new)
        rendered = self._render(s, new, tools)
        if not s.keys and rendered.tolist() != task.prompt_ids.tolist():
            raise HTTPError(400, "the first messages (and tools) must be the task prompt as given")
        limit = min(task.max_new_tokens, req.max_tokens or task.max_new_tokens,
                    req.max_completion_tokens or task.max_new_tokens)
        room = traj.remaining - (len(rendered) if traj.turns else 0)
        if traj.turns >= self.max_turns or room < 1:
            s.finish = Finish.MAX_TURNS if traj.turns >= self.max_turns else Finish.MAX_TOKENS
            return self._refuse(s, new)
        self._accept(s, new)
        if traj.turns:
            traj.add_environment(rendered)
        prompt_tokens = len(traj.context())
        try:
            c = await s.llm.generate(traj.context(), min(limit, traj.remaining), task.temperature,
                                     task.seed(traj.turns))
        except Exception as e:  # the engine failed: the rollout fails with this error
            s.error = e
            raise HTTPError(500, f"generation failed: {e!r}") from None
        traj.add_model(c)
        s.last_turn = c
        return self._answer(s, c, prompt_tokens, parse=tools is not None and
                            req.tool_choice != "none")

    def _check_tools(self, s: Session, req: ChatRequest) -> list[dict] | None:
        tools = req.tools or None
        if s.keys and tools != s.tools:
            raise HTTPError(400, "tools must be the same in every call of a rollout")
        names = tool_names(tools or [])
        if isinstance(req.tool_choice, NamedTool) and req.tool_choice.function.get("name") not in names:
            raise HTTPError(400, f"tool_choice names an unknown tool "
                                 f"{req.tool_choice.function.get('name')!r} (tools: {names})")
        if req.tool_choice not in (None, "none", "auto") and not names:
            raise HTTPError(400, "tool_choice needs tools")
        s.tools = tools
        return tools

    def _new_messages(self, s: Session, messages: list[ChatMessage],
                      keys: list[tuple]) -> list[ChatMessage]:
        """The messages after the conversation so far (`keys`: message_key of each message)."""
        repeated = _repeated(s.keys, keys)
        if repeated is None:
            raise HTTPError(400, _difference(s, messages, keys))
        new = messages[repeated:]
        if not new or any(m.role == "assistant" for m in new):
            raise HTTPError(400, "a call must add at least one message and no assistant message")
        open_calls = list(s.open_calls)
        for m in new:
            if m.role != "tool" or (m.tool_call_id is None and not s.open_calls):
                continue  # a tool message without an id answers a turn without tool_calls
            if m.tool_call_id not in open_calls:
                raise HTTPError(400, f"tool message with tool_call_id {m.tool_call_id!r} answers "
                                     f"no open call of the last assistant message "
                                     f"(open: {open_calls})")
            open_calls.remove(m.tool_call_id)
        return new

    def _accept(self, s: Session, new: list[ChatMessage]) -> None:
        s.keys.extend(message_key(m) for m in new)
        s.messages.extend(new)
        s.rendered.extend(_as_template(m) for m in new)
        answered = {m.tool_call_id for m in new if m.role == "tool"}
        s.open_calls = [c for c in s.open_calls if c not in answered]

    def _render(self, s: Session, new: list[ChatMessage], tools: list[dict] | None) -> np.ndarray:
        """Token ids of the new messages (after the last model turn, if any)."""
        msgs = [_as_template(m) for m in new]
        try:
            if s.last_turn is None:
                return self.chat.start(msgs, tools)
            return self.chat.follow(s.rendered, s.last_turn.token_ids, msgs, tools)
        except ValueError as e:  # the chat format cannot continue this conversation
            s.error = e
            raise HTTPError(400, str(e)) from None

    def _answer(self, s: Session, c: Completion, prompt_tokens: int, parse: bool) -> Turn:
        text = self.chat.text(c.token_ids)
        s.rendered.append({"role": "assistant", "content": text})
        message, finish = {"role": "assistant", "content": text}, c.finish_reason
        if parse and c.finish_reason == "stop":
            parsed = self.parser.parse(text)
            names = set(tool_names(s.tools or []))
            if isinstance(parsed, ParsedTurn) and any(f.name not in names for f in parsed.calls):
                parsed = ParseFailure("a call names a tool not in the request's tools")
            if isinstance(parsed, ParseFailure):
                s.tool_parse_errors += 1  # counted in metrics (tool_parse_errors); one per turn
                log.debug("rollout %s turn %d: tool call did not parse (%s); returned as content",
                         s.rid, s.traj.turns, parsed.message)
            elif parsed.calls:
                calls = [{"id": f"call_{s.rid}_{s.traj.turns}_{k}", "type": "function",
                          "function": {"name": f.name, "arguments": f.arguments}}
                         for k, f in enumerate(parsed.calls)]
                message = {"role": "assistant", "content": parsed.content, "tool_calls": calls}
                finish = "tool_calls"
                s.open_calls = [call["id"] for call in calls]
        _record(s, message)
        return Turn(message, finish, _usage(prompt_tokens, len(c.token_ids)), c.token_ids,
                    f"chatcmpl-{s.rid}-{s.traj.turns}")

    def deltas(self, turn: Turn) -> list[str]:
        """The content as stream deltas: the text each token adds (the whole content at once
        for a turn with tool calls, or if a token's text is not a clean extension of the text
        before it, e.g. half a UTF-8 character)."""
        text = turn.message["content"] or ""
        if turn.finish == "tool_calls":
            return [text]
        out, prev, ids = [], "", turn.token_ids
        for k in range(1, len(ids) + 1):
            cur = self.chat.text(ids[:k])
            if not cur.startswith(prev):
                return [text]
            out.append(cur[len(prev):])
            prev = cur
        return out if prev == text else [text]

    def _refuse(self, s: Session, new: list[ChatMessage]) -> Turn:
        """Past a limit: an empty answer with finish_reason "length" (nothing is recorded)."""
        self._accept(s, new)
        message = {"role": "assistant", "content": ""}
        s.rendered.append(message)
        _record(s, message)
        return Turn(message, "length", _usage(len(s.traj.context()), 0), np.zeros(0, np.int32),
                    f"chatcmpl-{s.rid}-{s.traj.turns}")


def _as_template(m: ChatMessage) -> Message:
    return {"role": m.role, "content": m.text()}


def _record(s: Session, message: dict) -> None:
    """Our answer, as a client must send it back."""
    ours = msgspec.convert(message, ChatMessage)
    s.keys.append(message_key(ours))
    s.messages.append(ours)


EMPTY_ANSWER = ("assistant", "", (), "")
"""message_key of an answer with no content and no tool calls (a turn that was only its
end-of-turn token, or past a limit): pydantic-ai leaves such answers out when it sends the
conversation back. Their tokens stay in the trajectory as sampled."""


def _repeated(had: list[tuple], got: list[tuple]) -> int | None:
    """How many of the keys `got` repeat the conversation so far (`had`), where an empty answer
    may be left out; None if they do not repeat it."""
    j = 0
    for key in had:
        if j < len(got) and got[j] == key:
            j += 1
        elif key != EMPTY_ANSWER:
            return None
    return j


def _difference(s: Session, messages: list[ChatMessage], keys: list[tuple]) -> str:
    """Why `messages` do not repeat the conversation so far, naming the message and field."""
    if len(keys) < len(s.keys):
        return (f"messages must repeat the conversation so far: got {len(keys)} messages, the "
                f"conversation has {len(s.keys)}")
    i = next(i for i, (a, b) in enumerate(zip(keys, s.keys)) if a != b)
    where, got, had = first_difference(messages[i], s.messages[i])
    if s.messages[i].role == "assistant":
        return (f"messages[{i}].{where} differs from what the endpoint returned (got "
                f"{_short(got)}, returned {_short(had)}): send assistant messages back exactly "
                "as returned (content and tool_calls; JSON arguments may be re-serialised)")
    return (f"messages[{i}].{where} differs from the conversation so far (got {_short(got)}, "
            f"had {_short(had)}): messages must repeat the conversation so far")


def _short(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


UserAgent = Callable[[str, list[dict[str, str]]], object]
"""fn(base_url, messages): runs one rollout through the endpoint; sync or async."""


def load_user_agent(spec: str) -> UserAgent:
    """`package.module:function` or `path/to/file.py:function` -> the function."""
    return load_function(spec, "actors.agent.function")


class OpenAIAgent:
    """Runs your OpenAI-client function per sample and returns what the endpoint recorded."""

    def __init__(self, endpoint: OpenAIEndpoint, fn: UserAgent, reward_fn: RewardFn,
                 threads: int = 64, tool_defs: Tools = None) -> None:
        """`tool_defs`: the tools the task's prompts were rendered with (None: no tools)."""
        self.endpoint = endpoint
        self.tool_defs = tool_defs
        self.fn = fn
        self.reward_fn = reward_fn
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="openai-agent")

    async def run(self, task: RolloutTask, llm: LLMClient) -> Rollout:
        session, _ = await self.serve(task, llm, self.fn)
        ids = session.traj.context()[len(task.prompt_ids):]
        reward, scores = await score(self.reward_fn, task.meta, ids)
        return finished(session, reward, scores)

    async def serve(self, task: RolloutTask, llm: LLMClient, fn: UserAgent) -> tuple[Session, object]:
        """Open a session, run fn(base_url, messages) to its end, close it: the session and
        what fn returned. Raises what failed the rollout (the engine, the chat format, a client
        gone mid-stream) or what fn raised."""
        await self.endpoint.start()
        session = self.endpoint.open(task, llm)
        messages = self.endpoint.chat.prompt_messages(task.prompt_ids, self.tool_defs)
        try:
            if inspect.iscoroutinefunction(fn):
                out = await fn(session.base_url, messages)
            else:
                out = await asyncio.get_running_loop().run_in_executor(self.pool, fn,
                                                                       session.base_url, messages)
        finally:
            self.endpoint.close(session.rid)
        if session.error is not None:
            raise session.error
        return session, out


def finished(session: Session, reward: float, scores: dict | None = None) -> Rollout:
    """The session's trajectory as a rollout with `reward` (and its named `scores`)."""
    r = session.traj.rollout(reward, session.finish_reason())
    r.scores = scores or {}
    r.tool_parse_errors = session.tool_parse_errors
    return r
