"""The rollout engine interface every backend (HF, vLLM, SGLang) implements.

An engine generates completions for a batch of requests and loads weights at a version. It is
synchronous and not re-entrant: `EngineClient` serializes calls and runs them in a worker
thread, so a weight update always waits for the running batch (update_mode "wait").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class GenerateRequest:
    prompt_ids: np.ndarray
    max_new_tokens: int
    temperature: float
    seed: int
    """Agent-chosen base seed; the engine mixes in the weight version it samples with."""


@dataclass(frozen=True)
class Completion:
    token_ids: np.ndarray   # int32, generated tokens (ends with EOS if it stopped)
    logprobs: np.ndarray    # float32, behavior logprob of each token under the tempered policy
    versions: np.ndarray    # int32, weight version that sampled each token
    finish_reason: str      # "stop" (EOS) or "length"


class Engine(Protocol):
    version: int
    """Weight version currently loaded (-1 before the first load)."""
    vocab_size: int

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]: ...

    def load_packed(self, manifest, buckets: list) -> None:
        """Load weight version `manifest.version` from its raw buckets (transport/weights.py)."""


def sample_seed(seed: int, prompt_id: int, sample_index: int, turn: int = 0) -> int:
    """Base seed of one sample's turn: a pure function of the run seed, prompt and sample index."""
    x = ((seed * 1_000_003 + prompt_id) * 1_000_033 + sample_index) * 1_000_037 + turn
    return x % (2**62)


def versioned_seed(seed: int, version: int) -> int:
    """The generator seed actually used: base seed mixed with the sampling weight version."""
    return (seed * 1_000_039 + version) % (2**62)
