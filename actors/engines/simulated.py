"""A simulated engine: no model, no torch. Named fake for load tests and pipeline benchmarks.

It returns uniformly random tokens with the matching uniform logprob, after a latency drawn per
request from a lognormal distribution (long-tailed, like real generation lengths); a batch takes
as long as its slowest request. Weight loads only record the version (streamed ones by the
default of base.py `CollectBuckets`).
"""

from __future__ import annotations

import json
import math
import time

import numpy as np

from actors.engines.base import (CollectBuckets, Completion, EngineContext, GenerateRequest,
                                 versioned_seed)
from actors.engines.client import EngineClient
from configs.engines import SimulatedEngineConfig
from transport.messages import WeightManifest


class SimulatedEngine(CollectBuckets):
    def __init__(self, vocab_size: int, latency_mean_s: float, latency_sigma: float) -> None:
        self.vocab_size = vocab_size
        self.latency_mean_s = latency_mean_s
        self.latency_sigma = latency_sigma
        self.version = -1

    def load_packed(self, manifest: WeightManifest, buckets: list) -> None:
        self.version = manifest.version

    def load_weights(self, state: dict, version: int) -> None:
        self.version = version

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        out, longest = [], 0.0
        for r in requests:
            rng = np.random.default_rng(versioned_seed(r.seed, self.version))
            n = int(rng.integers(1, r.max_new_tokens + 1))
            out.append(Completion(
                token_ids=rng.integers(0, self.vocab_size, n).astype(np.int32),
                logprobs=np.full(n, -math.log(self.vocab_size), dtype=np.float32),
                versions=np.full(n, self.version, dtype=np.int32), finish_reason="length"))
            if self.latency_mean_s > 0:
                # lognormal with the requested mean: mu = ln(mean) - sigma^2 / 2
                mu = math.log(self.latency_mean_s) - self.latency_sigma ** 2 / 2
                longest = max(longest, float(rng.lognormal(mu, self.latency_sigma)))
        if longest:
            time.sleep(longest)  # the simulated generation time, not synchronisation
        return out


def make(section: SimulatedEngineConfig, ctx: EngineContext) -> EngineClient:
    """`actors.engine: simulated`: random tokens of the model's vocabulary, behind the batching
    client."""
    vocab = json.loads((ctx.model_dir / "config.json").read_text())["vocab_size"]
    return EngineClient(SimulatedEngine(vocab, section.latency_mean_s, section.latency_sigma))
