"""Sharded loading for FSDP2: no rank ever holds the whole model.

    AutoConfig -> the model on the meta device (no memory) -> fully_shard (learner/backends/fsdp2.py)
    -> `materialise`: to_empty (each rank allocates its shards only) -> for every parameter,
    this rank's rows read from the safetensors files (safe_open get_slice: only those bytes)
    -> the non-persistent buffers (rotary inv_freq) recomputed as transformers does

The values are exactly `from_pretrained(dtype=float32)`'s (the file's tensors cast to float32),
so a sharded run starts where a single-process run starts (tests/test_fsdp.py). Tied
embeddings stay one parameter (fully_shard shards it once; named_parameters yields it once,
under the embedding's name, which is the name in the files). LoRA runs load the same way: the
base's shards from the files (peft's names mapped to the files'), the adapters' shards from
their seeded starting values (learner/backends/base.py adapter_starts), which are the single
process's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


def meta_causal_lm(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The HF causal LM of `model_dir`, in `dtype`, on the meta device (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def is_meta(model: torch.nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def materialise(model: torch.nn.Module, model_dir: Path, device: torch.device,
                starts: dict[str, torch.Tensor] | None = None,
                file_name: Callable[[str], str] = str) -> None:
    """Give a meta-device (sharded) model real storage on `device` and load this rank's part of
    every parameter from the safetensors files in `model_dir`, where parameter `name` is
    `file_name(name)` (a peft model's base weights: models/lora.py hf_name). Parameters not in
    the files start at this rank's part of their full tensor in `starts` (the critic's value
    head: zeros; LoRA adapters: learner/backends/base.py adapter_starts). A parameter in
    neither is a ValueError naming it."""
    starts = starts or {}
    model.to_empty(device=device)
    with contextlib.ExitStack() as stack, torch.no_grad():
        handles = [stack.enter_context(safe_open(str(f)))
                   for f in sorted(Path(model_dir).glob("*.safetensors"))]
        where = {k: h for h in handles for k in h.keys()}
        for name, p in model.named_parameters():
            local, offset = _local_part(p)
            rows = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            if name in starts:
                local.copy_(starts[name][rows])
                continue
            key = file_name(name)
            if key not in where:
                raise ValueError(f"{model_dir} has no tensor {key!r} (sharded loading reads "
                                 "HF safetensors by parameter name)")
            if local.numel():  # a rank past the last row holds nothing of this tensor
                local.copy_(where[key].get_slice(key)[rows])
    _rebuild_buffers(model)


def safe_open(path: str):
    from safetensors import safe_open as open_

    return open_(path, framework="pt")


def _local_part(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's tensor of parameter `p` and its offset in the full tensor."""
    if not isinstance(p, DTensor):
        return p, (0,) * p.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local()
    assert tuple(local.shape) == tuple(shape), (local.shape, shape)
    return local, tuple(offset)


def _rebuild_buffers(model: torch.nn.Module) -> None:
    """Recompute the non-persistent buffers that `to_empty` left uninitialised: the rotary
    embeddings' inverse frequencies (as transformers' `_init_weights` does); any other buffer
    is a ValueError (this loader does not know how to rebuild it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    done = set()
    for name, module in model.named_modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
            fn = (module.compute_default_rope_parameters if module.rope_type == "default"
                  else ROPE_INIT_FUNCTIONS[module.rope_type])
            value, _ = fn(module.config)
            module.inv_freq.copy_(value)
            module.original_inv_freq.copy_(value)
            done |= {f"{name}.inv_freq".lstrip("."), f"{name}.original_inv_freq".lstrip(".")}
    other = [n for n, _ in model.named_buffers() if n not in done]
    if other:
        raise ValueError(f"sharded loading cannot rebuild the buffers {other}")
