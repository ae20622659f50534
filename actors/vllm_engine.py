"""vLLM rollout engine: `AsyncLLM` streaming requests, with weight updates while they run.

Every `generate` call is its own vLLM request, submitted as soon as an agent asks (no batching
on our side: vLLM's scheduler does continuous batching). vLLM's EngineCore runs in a child
process; this object lives in the actor's event loop and never blocks it.

Weight updates (`actors.update_mode`), all without restarting the engine:

    wait   pause(mode="wait"): new requests queue, running ones finish; load; resume
    keep   pause(mode="keep"): running requests freeze; load; drop all KV (running requests
           recompute theirs with the new weights); resume. One sequence then holds tokens of
           two versions; vLLM labels each token with the version of the step that sampled it
           (`CompletionOutput.weight_versions`), which is what `Completion.versions` carries.
    abort  pause(mode="abort"): running requests end with their partial output; each is
           resubmitted as prompt + generated prefix and continues with the new weights.

Behavior logprobs are vLLM's `processed_logprobs`: the tempered distribution actually sampled.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path
from typing import Callable

import msgspec
import numpy as np

from actors.engine import Completion, versioned_seed

UPDATE_MODES = ("wait", "keep", "abort")


class VLLMEngine:
    def __init__(self, model_dir: str | Path, update_mode: str, seed: int, kv_cache_gb: float,
                 enforce_eager: bool, max_num_seqs: int, dtype: str = "float32") -> None:
        """Start vLLM with placeholder weights; nothing is generated before `load_*`.
        Blocks for the engine start-up (15-60 s on CPU): call it from a worker thread."""
        import json

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

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
        self._updating = asyncio.Lock()
        self._open = asyncio.Event()
        """Set while requests may be submitted (cleared during a weight update)."""
        self._open.set()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(model_dir), dtype=dtype, load_format="dummy", seed=seed,
            enforce_eager=enforce_eager, kv_cache_memory_bytes=int(kv_cache_gb * 2**30),
            max_num_seqs=max_num_seqs, logprobs_mode="processed_logprobs",
            generation_config="vllm", disable_log_stats=True,
            worker_extension_cls="actors.vllm_worker.TetherWorkerExtension"))
        if str(self.llm.model_config.dtype) != f"torch.{dtype}":  # behavior logprobs' dtype
            raise ValueError(f"vLLM runs the model in {self.llm.model_config.dtype}, "
                             f"model.dtype is {dtype}")

    async def generate(self, prompt_ids: np.ndarray, max_new_tokens: int, temperature: float,
                       seed: int) -> Completion:
        """Sample one completion; with update_mode "abort" it may span several vLLM requests."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompt = [int(t) for t in prompt_ids]
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        while True:
            await self._open.wait()
            params = SamplingParams(
                max_tokens=max_new_tokens - len(ids), temperature=temperature, logprobs=0,
                seed=versioned_seed(seed + len(ids), self.version),
                output_kind=RequestOutputKind.DELTA)
            final = None
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt + ids), params,
                                               request_id=f"t{next(self._ids)}"):
                c = out.outputs[0]
                ids.extend(c.token_ids)
                lps.extend(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))
                self.tokens_out += len(c.token_ids)
                if self.on_tokens is not None:
                    self.on_tokens(self.tokens_out)
                if out.finished:
                    final = c
                    vers.extend(_span_versions(c.weight_versions, len(ids) - len(vers)))
            if final.finish_reason != "abort" or len(ids) >= max_new_tokens:
                break
        return Completion(token_ids=np.asarray(ids, dtype=np.int32),
                          logprobs=np.asarray(lps, dtype=np.float32),
                          versions=np.asarray(vers, dtype=np.int32),
                          finish_reason="length" if final.finish_reason == "length" else "stop")

    async def load_packed(self, manifest, buckets: list) -> None:
        raw = msgspec.msgpack.encode(manifest)
        await self._update(manifest.version, "tether_load_packed", (raw, [bytes(b) for b in buckets]))

    async def load_file(self, path: str, version: int) -> None:
        await self._update(version, "tether_load_file", (path,))

    async def _update(self, version: int, method: str, args: tuple) -> None:
        async with self._updating:
            self._open.clear()
            if self.version < 0:  # first load: tie vLLM's processes to this one's lifetime
                await self.llm.collective_rpc("tether_die_with", args=(os.getpid(),))
            await self.llm.pause_generation(mode=self.update_mode, clear_cache=False)
            await self.llm.collective_rpc(method, args=args)
            await self.llm.reset_prefix_cache(reset_running_requests=True)
            await self.llm.update_weight_version(str(version))
            self.version = version
            self._open.set()
            await self.llm.resume_generation()

    def shutdown(self) -> None:
        """Stop vLLM's processes. (If this process is killed instead, they stop by themselves:
        the worker watches this pid, see actors/vllm_worker.py.)"""
        self.llm.shutdown()
        del self.llm  # let vLLM's finaliser run now, not during interpreter teardown


def _span_versions(spans, n_total: int) -> list[int]:
    """Per-token versions of one vLLM request from its version spans (all its output tokens)."""
    out: list[int] = []
    for span in spans or []:
        out.extend([int(span.version)] * (span.end - span.start))
    if len(out) != n_total:
        raise RuntimeError(f"vLLM labelled {len(out)} of {n_total} tokens with a weight version")
    return out
