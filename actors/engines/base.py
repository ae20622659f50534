"""The two engine interfaces: what agents and the actor call, and what batch engines implement.

`LLMClient` is what an agent gets as `llm` and what the actor loads weights into: async,
one request per call, safe to call concurrently. Two kinds of backend provide it:

* batch engines (HF transformers: hf.py, the simulated engine: simulated.py) implement the
  synchronous `Engine` protocol below; `EngineClient` (client.py) gathers concurrent requests
  into batches and runs them in a worker thread. A weight update waits for the running batch.
* streaming engines (vLLM: vllm/, SGLang: sglang/) implement `LLMClient` directly on
  `StreamingEngine` (streaming.py): requests stream continuously and take weights mid-request.

Each kind's module has a `make(section, ctx: EngineContext)`; registry.py picks the one
`actors.engine` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from configs.schema import TetherConfig

if TYPE_CHECKING:
    import torch


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


class LLMClient(Protocol):
    version: int
    """Weight version new requests are sampled with (-1 before the first load)."""
    vocab_size: int

    async def generate(self, prompt_ids: np.ndarray, max_new_tokens: int, temperature: float,
                       seed: int) -> Completion:
        """Sample one completion of `prompt_ids`; `seed` is the agent's base seed."""

    async def load_packed(self, manifest, buckets: list) -> None:
        """Load weight version `manifest.version` from raw buckets (transport/weights.py)."""

    async def load_file(self, path: str, version: int) -> None:
        """Load weight version `version` from a safetensors file (shared-filesystem weights)."""

    async def begin_load(self, manifest) -> None:
        """Start loading full version `manifest.version` bucket by bucket (`transport.
        weight_load: streamed`, transport/weightsrc/base.py WeightSink): nothing is generated
        and `version` is -1 until `end_load`, or a later whole load, completes a version."""

    async def load_bucket(self, manifest, index: int, bucket) -> None:
        """Load bucket `index` (buckets come in index order)."""

    async def end_load(self, manifest) -> None:
        """Every bucket is in: `version` becomes `manifest.version`, generation goes on."""


class Engine(Protocol):
    version: int
    """Weight version currently loaded (-1 before the first load)."""
    vocab_size: int

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]: ...

    def load_packed(self, manifest, buckets: list) -> None:
        """Load weight version `manifest.version` from its raw buckets (transport/weights.py)."""

    def load_weights(self, state: dict, version: int) -> None:
        """Load weight version `version` from a state dict of tensors."""

    def begin_load(self, manifest) -> None:
        """Start loading full version `manifest.version` bucket by bucket (no generation runs
        until `end_load`: EngineClient sees to that)."""

    def load_bucket(self, manifest, index: int, bucket) -> None: ...

    def end_load(self, manifest) -> None: ...


class CollectBuckets:
    """The bucket-by-bucket load of an engine that can only load a version whole: it keeps
    each bucket until the last and then calls `load_packed`, so it holds the whole version
    as staged loading does (the simulated engine, which reads no weights; an engine that
    loads large models should copy each bucket in as it comes, as hf.py does)."""

    _collected: list | None = None

    def begin_load(self, manifest) -> None:
        self._collected = [None] * manifest.num_buckets

    def load_bucket(self, manifest, index: int, bucket) -> None:
        self._collected[index] = bucket

    def end_load(self, manifest) -> None:
        buckets, self._collected = self._collected, None
        self.load_packed(manifest, buckets)


def sample_seed(seed: int, prompt_id: int, sample_index: int, turn: int = 0) -> int:
    """Base seed of one sample's turn: a pure function of the run seed, prompt and sample index."""
    x = ((seed * 1_000_003 + prompt_id) * 1_000_033 + sample_index) * 1_000_037 + turn
    return x % (2**62)


def versioned_seed(seed: int, version: int) -> int:
    """The generator seed actually used: base seed mixed with the sampling weight version."""
    return (seed * 1_000_039 + version) % (2**62)


@dataclass
class EngineContext:
    """What an engine's factory gets besides its section."""

    model_dir: Path
    """The learner's model files (config, tokenizer; the weights arrive later)."""
    cfg: TetherConfig
    """The run's config (seed, model.dtype, learner.lora)."""
    threads: int = 1
    """The actor's cores: torch threads of a CPU engine."""
    on_sigterm: Callable[[], None] | None = None
    """The actor's stop, for an engine that installs signal handlers of its own."""
    closers: list[Callable[[], None]] = field(default_factory=list)
    """A factory appends what stops its engine's processes; the actor calls them at its end."""
    device: torch.device | None = None
    """Where the engine computes (the actor resolves it without initialising CUDA); None for
    the simulated engine."""
    dtype: str = ""
    """What the engine computes in: model.dtype with `auto` resolved for `device`."""
