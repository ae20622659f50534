"""`EngineClient`: the `LLMClient` (actors/engines/base.py) for synchronous batch engines.

Requests issued concurrently (e.g. the n samples of a group, or many agents' turns) are gathered
into one engine batch. The engine runs in a worker thread, so the actor's event loop keeps
heartbeating while it generates. Weight loads go through the same lock as generation batches:
an update waits for the running batch and the next batch uses the new weights. A streamed
load (`begin_load` ... `end_load`) holds every batch back for the whole stream, and for good
after a stream that stopped part-way, until a whole version is loaded (`_whole`).
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from actors.engines.base import Completion, Engine, GenerateRequest


class EngineClient:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pending: list[tuple[GenerateRequest, asyncio.Future]] = []
        self._lock = asyncio.Lock()
        self._scheduled = False
        self._whole = asyncio.Event()
        """Set while the engine holds a whole version (or none yet): batches may run."""
        self._whole.set()

    @property
    def version(self) -> int:
        """The engine's version; -1 from `begin_load` until a version is whole again."""
        return self.engine.version if self._whole.is_set() else -1

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    async def generate(self, prompt_ids: np.ndarray, max_new_tokens: int, temperature: float,
                       seed: int) -> Completion:
        """Sample one completion. Resolves when the batch containing it finishes."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((GenerateRequest(np.asarray(prompt_ids), max_new_tokens, temperature,
                                              seed), fut))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._run_batch()))
        return await fut

    @contextlib.asynccontextmanager
    async def _engine_whole(self):
        """The engine's lock, taken at a moment it holds a whole version (`begin_load` clears
        `_whole` only under this lock)."""
        while True:
            await self._whole.wait()
            await self._lock.acquire()
            if self._whole.is_set():
                break
            self._lock.release()
        try:
            yield
        finally:
            self._lock.release()

    async def _run_batch(self) -> None:
        async with self._engine_whole():
            batch, self._pending = self._pending, []
            self._scheduled = False
            if not batch:
                return
            try:
                results = await asyncio.to_thread(self.engine.generate, [r for r, _ in batch])
            except Exception as e:  # the agents awaiting these requests get the error
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                return
            for (_, fut), res in zip(batch, results):
                if not fut.done():  # cancelled meanwhile: its rollout was abandoned (rejoin)
                    fut.set_result(res)

    async def load_packed(self, manifest, buckets: list) -> None:
        """Load new weights once the running batch (if any) has finished."""
        async with self._lock:
            await asyncio.to_thread(self.engine.load_packed, manifest, buckets)
            if manifest.kind != "base":  # (a base alone is no version)
                self._whole.set()

    async def load_file(self, path: str, version: int) -> None:
        """Load a safetensors file once the running batch (if any) has finished."""
        from safetensors.torch import load_file

        async with self._lock:
            state = await asyncio.to_thread(load_file, path)
            await asyncio.to_thread(self.engine.load_weights, state, version)
            self._whole.set()

    async def begin_load(self, manifest) -> None:
        """Start a streamed load once the running batch (if any) has finished; no batch runs
        until a version is whole again."""
        async with self._lock:
            self._whole.clear()
            await asyncio.to_thread(self.engine.begin_load, manifest)

    async def load_bucket(self, manifest, index: int, bucket) -> None:
        async with self._lock:
            await asyncio.to_thread(self.engine.load_bucket, manifest, index, bucket)

    async def end_load(self, manifest) -> None:
        async with self._lock:
            await asyncio.to_thread(self.engine.end_load, manifest)
            self._whole.set()
