"""Megatron-core on CPU: the CUDA-only spots the Megatron backend meets, redirected to the CPU.

Megatron-core has no CPU path. Tether's Megatron lane (gloo under torchrun, tests/test_megatron.py)
runs it on CPU with these redirects, which `cpu_redirects()` applies only while no CUDA device
exists; with CUDA it changes nothing. File and line numbers are megatron-core 0.16.1's.

1. `torch.cuda.current_device()` returns "cpu" (a CPU-only torch raises "Torch not compiled with
   CUDA enabled"):
     models/common/embeddings/rotary_pos_embedding.py:162  RotaryEmbedding.get_emb moves
         `inv_freq` to the current CUDA device on the first forward;
     pipeline_parallel/p2p_communication.py:313, 321       receive buffers of pipeline p2p.
2. Tensor factories called with `device="cuda"` build on the CPU, and `Tensor.cuda()` returns the
   tensor itself (a TorchFunctionMode):
     pipeline_parallel/schedules.py:596, 2138  `total_num_tokens = torch.zeros(..., device="cuda")`
         in forward_backward_no_pipelining / forward_backward_pipelining_without_interleaving;
     models/common/language_module/language_module.py:244  `weight.data.cuda()` before the
         all-reduce that copies tied embeddings from the first to the last pipeline stage.
3. The model-parallel RNG tracker: tensor_parallel/random.py:235 `CudaRNGStatesTracker.add` calls
   torch.cuda.get_rng_state. `initialize_rng_tracker(inference_rng_tracker=True)` (public API)
   makes add/fork no-ops; valid only because the backend runs with dropout 0.
Not redirected, avoided by the backend's own settings:
   transformer/utils.py:35 `get_default_causal_mask` builds on "cuda": the backend always passes
       an explicit causal mask;
   pipeline_parallel/p2p_communication.py:398 `torch.cuda.synchronize()` after batched p2p:
       `batch_p2p_sync=False` in the model config.
tests/test_megatron.py checks that each of these still fails on CPU without its redirect (so an
upgrade that fixes one shows up) and works with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class CudaFactoriesOnCpu(TorchFunctionMode):
    """Any torch call with a `device="cuda"` (or cuda:N) keyword runs with device="cpu" instead;
    `Tensor.cuda()` is the identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _cpu_current_device() -> str:
    return "cpu"


@contextlib.contextmanager
def cpu_redirects() -> Iterator[None]:
    """Redirects 1 and 2 while the block runs, if there is no CUDA device; else nothing."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device
    try:
        with CudaFactoriesOnCpu():
            yield
    finally:
        torch.cuda.current_device = original


def init_rng_tracker(seed: int) -> None:
    """Redirect 3 (only without CUDA; with CUDA the ordinary tracker is seeded)."""
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
