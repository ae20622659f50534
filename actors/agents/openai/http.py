"""The endpoint's HTTP server: aiohttp's `web` on the actor's event loop.

    POST /rollout/RID/v1/chat/completions   (or /v1/chat/completions with "user": RID)
      body > MAX_BODY_BYTES -> 413 | not JSON / wrong fields -> 400 | unknown RID -> 404
      connection lost before the body was read -> nothing applied (one warning line)
      -> OpenAIEndpoint.complete under the session's lock
      -> 200 chat.completion JSON, or (stream) text/event-stream chunks + data: [DONE]

aiohttp does the HTTP/1.1 parsing (keep-alive, chunked request bodies, the size limit). Every
error, aiohttp's own (404, 405, 413) included, is an OpenAI-style JSON error body.
"""

from __future__ import annotations

import asyncio
import json
import logging

import msgspec
from aiohttp import web

from actors.agents.openai.wire import HTTPError, ChatRequest, completion_body, error_body, stream_chunks

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20


@web.middleware
async def json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except HTTPError as e:
        return web.json_response(error_body(e.status, str(e)), status=e.status)
    except web.HTTPException as e:  # aiohttp's: no route, wrong method, body too large
        if e.status < 400:
            raise
        return web.json_response(error_body(e.status, f"{e.reason}: {e.text}"), status=e.status)


class HTTPServer:
    def __init__(self, endpoint, port: int) -> None:
        """`endpoint`: the actors.agents.openai.server.OpenAIEndpoint whose sessions it serves."""
        self.endpoint = endpoint
        self.port = port
        self.runner: web.AppRunner | None = None
        self._starting = asyncio.Lock()
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[json_errors])
        app.router.add_post("/rollout/{rid}/v1/chat/completions", self.chat)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.app = app

    async def start(self) -> None:
        """Listen (once: concurrent and later calls wait for the first, then return)."""
        async with self._starting:
            if self.runner is None:
                await self._listen()

    async def _listen(self) -> None:
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.runner = runner
        self.port = runner.addresses[0][1]
        log.info("OpenAI-compatible endpoint on http://127.0.0.1:%s/rollout/<id>/v1", self.port)

    async def close(self) -> None:
        """Stop listening and close open connections (clean shutdown)."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.read()
        except ConnectionResetError as e:  # nothing of this call was applied: a retry is new
            log.warning("a client went away before its request body was read (%s): the call "
                        "was not applied", e)
            return web.Response(status=400)  # to a closed connection: never sent
        try:
            req = msgspec.json.decode(body, type=ChatRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise HTTPError(400, f"bad request body: {e}") from None
        session = self.endpoint.session(request.match_info.get("rid", req.user))
        async with session.lock:
            turn = await self.endpoint.complete(session, req)
        if not req.stream:
            return web.json_response(completion_body(turn.cid, turn.message, turn.finish,
                                                     turn.usage, turn.sampling))
        usage = turn.usage if req.stream_options is None or req.stream_options.include_usage \
            else None
        return await self._stream(request, session, turn, usage)

    async def _stream(self, request: web.Request, session, turn, usage) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        chunks = stream_chunks(turn.cid, self.endpoint.deltas(turn), turn.message, turn.finish,
                               usage)
        try:
            await resp.prepare(request)
            for chunk in chunks:
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError as e:  # the client went away mid-stream
            session.error = ConnectionResetError(
                f"rollout {session.rid}: the client disconnected mid-stream ({e}); the turn it "
                "did not receive is in the trajectory, so the rollout fails")
            log.warning("%s", session.error)
        return resp
