"""An OpenAI-compatible chat-completions endpoint per actor, recording token-level trajectories.

    OpenAIAgent.run(task, llm)                      your agent (any OpenAI client, sync or async)
      open a session -> base_url ----------------->  fn(base_url, messages)
                                                       POST {base_url}/chat/completions
      endpoint: check the messages extend the          <- {"choices": [{"message": ...}]}
      conversation, render only the new ones
      (mask 0), generate (mask 1), answer
      fn returns -> close the session -> Rollout (reward from the task on the completion ids)

Every rollout gets its own base URL, http://127.0.0.1:PORT/rollout/RID/v1, so each call is
applied to that rollout's trajectory (a plain /v1/chat/completions with `"user": RID` works
too). Assistant turns are kept as the sampled token ids, never re-tokenized: the client must
send back the assistant messages exactly as it got them. The first call's messages must render
to the task prompt (`messages` handed to your function are exactly that). `temperature`, if
given, must be the task's (behavior logprobs must be those the learner assumes); `max_tokens`
can only lower the per-turn limit. Past `max_turns` model turns or `max_total_tokens` tokens, an
answer is empty with finish_reason "length". Only 127.0.0.1 is bound: the endpoint has no auth.

Your function runs in its own thread pool (sync) or on the actor's loop (async), never in the
engine's worker threads, so a blocking client cannot starve generation.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Literal

import msgspec
import numpy as np

from actors.chat import ChatFormat
from actors.engine import Completion, LLMClient
from actors.rollout import Finish, RewardFn, Rollout, RolloutTask, score
from actors.trajectory import TrajectoryBuilder

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           413: "Payload Too Large", 500: "Internal Server Error"}


class ChatMessage(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(msgspec.Struct):
    """The fields of an OpenAI chat-completions request that are honoured (others are ignored)."""

    messages: list[ChatMessage]
    model: str = ""
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    n: int = 1
    stream: bool = False
    user: str = ""


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Session:
    """One rollout served through the endpoint."""

    rid: str
    task: RolloutTask
    llm: LLMClient
    traj: TrajectoryBuilder
    base_url: str
    history: list[tuple[str, str]] = field(default_factory=list)
    """(role, content) of every message seen so far, with our answers."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    error: BaseException | None = None
    """An engine or chat-format failure while answering: fails the rollout."""
    last_turn: Completion | None = None
    """The newest model turn as generated."""
    finish: Finish | None = None
    """Set when a turn or token limit was reached; later calls get empty answers."""

    def finish_reason(self) -> Finish:
        """How the rollout ended once the client is done: a limit it hit, the last turn cut at
        the per-turn token limit, or else an answer."""
        if self.finish is not None:
            return self.finish
        cut = self.last_turn is not None and self.last_turn.finish_reason == "length"
        return Finish.MAX_TOKENS if cut else Finish.ANSWER


class OpenAIEndpoint:
    def __init__(self, chat: ChatFormat, port: int, max_turns: int, max_total_tokens: int) -> None:
        self.chat = chat
        self.port = port
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.sessions: dict[str, Session] = {}
        self._ids = itertools.count()
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        """Listen on 127.0.0.1 (once; later calls return at once)."""
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
                self.port = self._server.sockets[0].getsockname()[1]
                log.info("OpenAI-compatible endpoint on http://127.0.0.1:%s/rollout/<id>/v1",
                         self.port)

    async def close_server(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def open(self, task: RolloutTask, llm: LLMClient) -> Session:
        rid = f"{task.prompt_id}-{task.sample_index}-{next(self._ids)}"
        s = Session(rid=rid, task=task, llm=llm,
                    traj=TrajectoryBuilder(task.prompt_ids, self.max_total_tokens),
                    base_url=f"http://127.0.0.1:{self.port}/rollout/{rid}/v1")
        self.sessions[rid] = s
        return s

    def close(self, rid: str) -> Session:
        return self.sessions.pop(rid)

    # ------------------------------------------------------------ HTTP
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._respond(reader, writer)
        except asyncio.CancelledError:
            # The actor is stopping and its loop cancels every task, at any await of this one
            # (reading, generating, writing or closing). This task is the server's, awaited by no
            # one, so it ends quietly (Python 3.11's start_server would log a cancelled
            # connection handler as an error); the client sees the connection close.
            writer.close()

    async def _respond(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, payload = 200, await self._route(reader)
        except HTTPError as e:
            status = e.status
            payload = {"error": {"message": str(e), "type": "invalid_request_error", "code": status}}
        data = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async def _route(self, reader: asyncio.StreamReader) -> dict:
        method, _, rest = (await reader.readline()).decode("latin-1").partition(" ")
        path = rest.split(" ")[0]
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip()) if value.strip().isdigit() else -1
        if length < 0 or length > MAX_BODY_BYTES:
            raise HTTPError(413, f"body must have a Content-Length of at most {MAX_BODY_BYTES}")
        body = await reader.readexactly(length)
        parts = path.strip("/").split("/")
        if parts[-3:] != ["v1", "chat", "completions"] or len(parts) not in (3, 5) or \
                (len(parts) == 5 and parts[0] != "rollout"):
            raise HTTPError(404, f"no route {path!r}; use POST /rollout/<id>/v1/chat/completions")
        if method != "POST":
            raise HTTPError(405, "use POST")
        try:
            req = msgspec.json.decode(body, type=ChatRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise HTTPError(400, f"bad request body: {e}") from None
        rid = parts[1] if len(parts) == 5 else req.user
        session = self.sessions.get(rid)
        if session is None:
            raise HTTPError(404, f"no open rollout {rid!r}")
        async with session.lock:
            return await self._complete(session, req)

    # ------------------------------------------------------------ one call
    async def _complete(self, s: Session, req: ChatRequest) -> dict:
        task, traj = s.task, s.traj
        if req.n != 1 or req.stream:
            raise HTTPError(400, "only n=1 and stream=false are supported")
        if req.temperature is not None and req.temperature != task.temperature:
            raise HTTPError(400, f"temperature must be {task.temperature} (the task's) or absent")
        msgs = [(m.role, m.content) for m in req.messages]
        if msgs[:len(s.history)] != s.history:
            raise HTTPError(400, "messages must repeat the conversation so far, assistant "
                                 "messages exactly as returned")
        new = msgs[len(s.history):]
        if not new or any(role == "assistant" for role, _ in new):
            raise HTTPError(400, "a call must add at least one message and no assistant message")
        if s.finish is not None:  # a limit was reached: every further call gets an empty answer
            return self._refuse(s, new)
        rendered = self._render(s, new)
        if not s.history and rendered.tolist() != task.prompt_ids.tolist():
            raise HTTPError(400, "the first messages must be the task prompt as given")
        limit = min(task.max_new_tokens, req.max_tokens or task.max_new_tokens,
                    req.max_completion_tokens or task.max_new_tokens)
        room = traj.remaining - (len(rendered) if traj.turns else 0)
        if traj.turns >= self.max_turns or room < 1:
            s.finish = Finish.MAX_TURNS if traj.turns >= self.max_turns else Finish.MAX_TOKENS
            return self._refuse(s, new)
        s.history.extend(new)
        if traj.turns:
            traj.add_environment(rendered)
        try:
            c = await s.llm.generate(traj.context(), min(limit, traj.remaining), task.temperature,
                                     task.seed(traj.turns))
        except Exception as e:  # the engine failed: the rollout fails with this error
            s.error = e
            raise HTTPError(500, f"generation failed: {e!r}") from None
        prompt_tokens = len(traj.context())
        traj.add_model(c)
        s.last_turn = c
        text = self.chat.text(c.token_ids)
        s.history.append(("assistant", text))
        return _response(s, prompt_tokens, text, len(c.token_ids), c.finish_reason)

    def _render(self, s: Session, new: list[tuple[str, str]]) -> np.ndarray:
        """Token ids of the new messages (after the last model turn, if any)."""
        as_dicts = lambda pairs: [{"role": r, "content": c} for r, c in pairs]  # noqa: E731
        try:
            if s.last_turn is None:
                return self.chat.start(as_dicts(new))
            return self.chat.follow(as_dicts(s.history), s.last_turn.token_ids, as_dicts(new))
        except ValueError as e:  # the chat format cannot continue this conversation
            s.error = e
            raise HTTPError(400, str(e)) from None

    @staticmethod
    def _refuse(s: Session, new: list[tuple[str, str]]) -> dict:
        """Past a limit: an empty answer with finish_reason "length" (nothing is recorded)."""
        s.history.extend(new)
        s.history.append(("assistant", ""))
        return _response(s, len(s.traj.context()), "", 0, "length")


def _response(s: Session, prompt_tokens: int, text: str, completion_tokens: int,
              finish: str) -> dict:
    return {"id": f"chatcmpl-{s.rid}-{s.traj.turns}", "object": "chat.completion",
            "created": int(time.time()), "model": "tether",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


UserAgent = Callable[[str, list[dict[str, str]]], object]
"""fn(base_url, messages): runs one rollout through the endpoint; sync or async."""


def load_user_agent(spec: str) -> UserAgent:
    """`package.module:function` -> the function."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class OpenAIAgent:
    """Runs your OpenAI-client function per sample and returns what the endpoint recorded."""

    def __init__(self, endpoint: OpenAIEndpoint, fn: UserAgent, reward_fn: RewardFn,
                 threads: int = 64) -> None:
        self.endpoint = endpoint
        self.fn = fn
        self.reward_fn = reward_fn
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="openai-agent")

    async def run(self, task: RolloutTask, llm: LLMClient) -> Rollout:
        await self.endpoint.start()
        session = self.endpoint.open(task, llm)
        messages = self.endpoint.chat.prompt_messages(task.prompt_ids)
        try:
            if inspect.iscoroutinefunction(self.fn):
                await self.fn(session.base_url, messages)
            else:
                await asyncio.get_running_loop().run_in_executor(self.pool, self.fn,
                                                                 session.base_url, messages)
        finally:
            self.endpoint.close(session.rid)
        if session.error is not None:
            raise session.error
        ids = session.traj.context()[len(task.prompt_ids):]
        reward, scores = await score(self.reward_fn, task.meta, ids)
        rollout = session.traj.rollout(reward, session.finish_reason())
        rollout.scores = scores
        return rollout
