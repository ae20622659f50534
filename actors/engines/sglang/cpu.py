"""CPU-only redirect for SGLang's LoRA path: pinned host memory without a CUDA device.

SGLang's LoRA layers and its `torch_native` LoRA backend stage small index tensors in pinned
(page-locked) host memory for fast copies to the GPU: `torch.tensor(..., pin_memory=True)`,
`t.pin_memory()`. Without a CUDA driver torch refuses both ("Found no NVIDIA driver"). With no
device to copy to, pinned memory means nothing, so on a machine without CUDA the scheduler
process (the only one that runs the model) makes both plain host memory. Nothing else changes;
on a GPU machine this is never installed.
"""

from __future__ import annotations

import functools

import torch

_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like",
              "ones_like", "full_like")


def unpinned_host_memory() -> None:
    """In this process: `pin_memory=True` and `Tensor.pin_memory()` give plain host tensors.
    Refuses to run where CUDA exists (there pinning is real and must stay)."""
    if torch.cuda.is_available():
        raise RuntimeError("unpinned_host_memory is a CPU-only redirect; this machine has CUDA")
    for name in _FACTORIES:
        setattr(torch, name, _drop_pin(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def _drop_pin(factory):
    @functools.wraps(factory)
    def call(*args, pin_memory: bool = False, **kwargs):
        return factory(*args, **kwargs)

    return call
