"""What the streaming engines (vLLM, SGLang) share: requests streamed as agents ask, new weights
while they run, and LoRA adapter versions.

Every `generate` call is its own engine request, submitted as soon as an agent asks (the
engine's scheduler does the continuous batching); `StreamingEngine` lives in the actor's event
loop and never blocks it. A subclass says how one request runs and how the engine pauses,
resumes and loads; this module holds the protocol around them:

    generate      wait while an update holds the engine closed; sample with the current
                  version's seed (and adapter); with update_mode abort, a request the update
                  stopped is resubmitted as prompt + generated prefix until the completion ends
    update        close; pause(mode); load; version = new; open; resume     (one at a time)
    stream        (transport.weight_load: streamed) begin_load: close; pause(mode); version = -1;
                  load_bucket × N as the buckets arrive; end_load: version = new; open; resume.
                  The engine stays paused for the whole transfer: vLLM and SGLang load in place,
                  so a live engine cannot keep generating during the stream without sampling
                  from a mix of two versions. A stream that stops part-way (`_stream` set, no
                  end_load) leaves the engine closed and paused, version -1; the next load
                  (streamed or whole) first finishes the engine side of the broken one, then
                  loads a whole version and only then opens.
    update_mode   wait   running requests finish first
                  keep   running requests freeze and recompute their KV with the new weights:
                         one sequence then holds tokens of two versions, each token labelled by
                         the engine with the version that sampled it
                  abort  running requests end with their partial output and are resubmitted
    adapters      (LoRA runs) the base arrives once and loads like full weights (the version
                  stays: tokens are labelled by adapter); each adapter version is added under a
                  fresh id and new requests use it at once; a request keeps the adapter it was
                  submitted with, so all its tokens carry that adapter's version (`wait` and
                  `keep` let running requests finish on theirs; `abort` stops them and resubmits
                  them on the new one); an adapter no request runs on any more is removed.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import numpy as np

from actors.engines.base import Completion, versioned_seed

UPDATE_MODES = ("wait", "keep", "abort")


@dataclass
class Piece:
    """What one engine request produced (all of it, or up to an abort)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int] | None
    """Per-token weight versions from the engine's labels; None for a request on an adapter
    (its tokens are that adapter's version)."""
    finish_reason: str
    """"stop", "length" or "abort" (an update stopped it)."""


class StreamingEngine(abc.ABC):
    """The `LLMClient` of an engine that streams requests and takes weights mid-request.

    Subclasses implement the abstract methods below (the adapter ones are called in LoRA runs
    only)."""

    BASE_UPDATE_MODE: str | None = None
    """How a LoRA run's base (once per learner run) reaches running requests: None = as
    update_mode says."""

    def __init__(self, model_dir: str | Path, update_mode: str) -> None:
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {UPDATE_MODES}, got {update_mode!r}")
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.update_mode = update_mode
        self.version = -1
        self.tokens_out = 0
        """Tokens received so far (a progress counter)."""
        self.on_tokens: Callable[[int], None] | None = None
        """Called with `tokens_out` whenever tokens arrive (progress displays, tests)."""
        self._ids = itertools.count()
        """Request ids."""
        self._updating = asyncio.Lock()
        self._open = asyncio.Event()
        """Set while requests may be submitted (cleared during a weight update)."""
        self._open.set()
        self._running = 0
        self._idle = asyncio.Condition()
        """Notified whenever a request ends (an update that waits for none running)."""
        self._adapter: object | None = None
        """LoRA runs: the engine's handle of the adapter new requests use (None before the
        first)."""
        self._adapter_id: int | None = None
        self._adapters: dict[int, object] = {}
        """LoRA runs: adapter id -> the engine's handle, for every adapter the engine holds."""
        self._users: Counter[int] = Counter()
        """LoRA runs: adapter id -> requests running on it."""
        self._lora_ids = itertools.count(1)
        self._stream = None
        """The manifest of a stream begun and not ended (the engine holds a mix of versions:
        closed, paused, version -1); None while the engine holds a whole version (or none)."""

    # ------------------------------------------------------------ what a kind implements
    @abc.abstractmethod
    async def _request(self, prompt: list[int], max_new_tokens: int, temperature: float,
                       seed: int, adapter: object | None) -> Piece:
        """Run one engine request to its end (or an abort), calling `_received` as tokens
        arrive."""

    @abc.abstractmethod
    async def _pause(self, mode: str) -> None:
        """Pause generation as update_mode `mode` asks."""

    @abc.abstractmethod
    async def _resume(self) -> None:
        """Continue generating after `_pause`."""

    @abc.abstractmethod
    async def _begin_stream(self, manifest) -> None:
        """Start loading `manifest` bucket by bucket (the engine is paused)."""

    @abc.abstractmethod
    async def _stream_bucket(self, manifest, index: int, bucket) -> None:
        """Load bucket `index` of `manifest` (after `_begin_stream`, in index order)."""

    @abc.abstractmethod
    async def _end_stream(self, manifest, label: bool) -> None:
        """Finish the engine side of a stream and drop the KV cache; `label`: the buckets
        were all loaded, new tokens carry `manifest.version` (False: a stream that stopped
        part-way, or a LoRA base, which keeps the version)."""

    @abc.abstractmethod
    async def _load_from_file(self, path: str, version: int) -> None:
        """Load a version from a safetensors file (the engine is paused)."""

    @abc.abstractmethod
    async def _prepare_adapter(self, adapter_id: int, manifest, buckets: list) -> object:
        """Whatever an adapter needs before the update (outside the update lock)."""

    @abc.abstractmethod
    async def _add_adapter(self, prepared: object) -> object:
        """Add the prepared adapter to the engine; returns the handle requests name it by."""

    @abc.abstractmethod
    async def _remove_adapter(self, handle: object) -> None:
        """Remove an adapter no request runs on any more."""

    # ------------------------------------------------------------ shared
    def _received(self, n: int) -> None:
        self.tokens_out += n
        if self.on_tokens is not None:
            self.on_tokens(self.tokens_out)

    async def generate(self, prompt_ids: np.ndarray, max_new_tokens: int, temperature: float,
                       seed: int) -> Completion:
        """Sample one completion; with update_mode "abort" it may span several requests."""
        prompt = [int(t) for t in prompt_ids]
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        while True:
            await self._open.wait()
            version, adapter_id, adapter = self.version, self._adapter_id, self._adapter
            self._running += 1
            if adapter_id is not None:
                self._users[adapter_id] += 1
            try:
                piece = await self._request(prompt + ids, max_new_tokens - len(ids), temperature,
                                            versioned_seed(seed + len(ids), version), adapter)
            finally:
                self._running -= 1
                if adapter_id is not None:
                    self._users[adapter_id] -= 1
                async with self._idle:
                    self._idle.notify_all()
            if adapter_id is not None:
                await self._drop_unused_adapters()
            ids.extend(piece.token_ids)
            lps.extend(piece.logprobs)
            vers.extend([version] * len(piece.token_ids) if adapter is not None
                        else piece.versions)
            if piece.finish_reason != "abort" or len(ids) >= max_new_tokens:
                break
        return Completion(token_ids=np.asarray(ids, dtype=np.int32),
                          logprobs=np.asarray(lps, dtype=np.float32),
                          versions=np.asarray(vers, dtype=np.int32),
                          finish_reason="length" if piece.finish_reason == "length" else "stop")

    async def _until_idle(self) -> None:
        """Wait until none of our requests runs."""
        async with self._idle:
            await self._idle.wait_for(lambda: self._running == 0)

    async def load_packed(self, manifest, buckets: list) -> None:
        """Full weights, a LoRA run's base (the version stays), or an adapter (added
        alongside)."""
        match manifest.kind:
            case "adapter":
                await self._load_adapter(manifest, buckets)
            case "base":
                await self._update(None, self._load_whole(manifest, buckets, label=False),
                                   self.BASE_UPDATE_MODE or self.update_mode)
            case _:
                await self._update(manifest.version,
                                   self._load_whole(manifest, buckets, label=True),
                                   self.update_mode)

    async def _load_whole(self, manifest, buckets: list, label: bool) -> None:
        """Full weights or a LoRA run's base that arrived whole (the engine is paused): the
        calls a streamed load makes as the buckets arrive, so the same weights bit for bit."""
        await self._begin_stream(manifest)
        for i, bucket in enumerate(buckets):
            await self._stream_bucket(manifest, i, bucket)
        await self._end_stream(manifest, label)

    async def load_file(self, path: str, version: int) -> None:
        """Load a version from a safetensors file (shared-filesystem weights)."""
        await self._update(version, self._load_from_file(path, version), self.update_mode)

    async def begin_load(self, manifest) -> None:
        """Start streaming full version `manifest.version` in (`load_bucket` per bucket, then
        `end_load`): close and pause as update_mode says; no whole version until end_load."""
        async with self._updating:
            await self._close(self.update_mode)
            self._stream, self.version = manifest, -1
            await self._begin_stream(manifest)

    async def load_bucket(self, manifest, index: int, bucket) -> None:
        """Bucket `index` of the version `begin_load` started (buckets come in index order)."""
        async with self._updating:
            await self._stream_bucket(manifest, index, bucket)

    async def end_load(self, manifest) -> None:
        """Every bucket is in: label new tokens with the version, open, resume."""
        async with self._updating:
            await self._end_stream(manifest, label=True)
            self._stream, self.version = None, manifest.version
            self._open.set()
            await self._resume()

    async def _close(self, mode: str) -> None:
        """Close and pause for a load; after a broken stream (closed and paused already),
        finish its engine side instead."""
        if self._stream is None:
            self._open.clear()
            await self._pause(mode)
        else:
            await self._end_stream(self._stream, label=False)
            self._stream = None

    async def _update(self, version: int | None, load: Awaitable[None], mode: str) -> None:
        """Pause as `mode` asks, load, label new tokens `version` (None: keep the version)."""
        async with self._updating:
            await self._close(mode)
            await load
            if version is not None:
                self.version = version
            self._open.set()
            await self._resume()

    async def _load_adapter(self, manifest, buckets: list) -> None:
        """Add version `manifest.version`'s adapter; new requests use it from now on."""
        adapter_id = next(self._lora_ids)
        prepared = await self._prepare_adapter(adapter_id, manifest, buckets)
        async with self._updating:
            handle = await self._add_adapter(prepared)
            self._adapters[adapter_id] = handle
            self._adapter, self._adapter_id = handle, adapter_id
            abort = self.update_mode == "abort" and self.version >= 0
            if abort:  # running requests end now and are resubmitted with this adapter
                self._open.clear()
                await self._pause("abort")
            self.version = manifest.version
            self._open.set()
            if abort:
                await self._resume()
        await self._drop_unused_adapters()

    async def _drop_unused_adapters(self) -> None:
        """Remove every adapter older than the current one that no request runs on."""
        while (old := next((i for i in self._adapters if i != self._adapter_id
                            and self._users[i] == 0), None)) is not None:
            handle = self._adapters.pop(old)  # before the await: no other caller takes it too
            await self._remove_adapter(handle)
