"""Training backends: own the model and optimizer; know nothing about RL.

The trainer (learner/algo/trainer.py) asks a backend for token logprobs, hands it a loss to step
on, and asks for the full weights to publish: the `Backend` protocol below. With `learner.lora`
the backend trains a peft model (models/lora.py `wrap`): only the adapters have gradients and
AdamW state; it publishes the frozen base once and the adapter tensors every version. The kinds
(`learner.backend`): `single` (single.py, one process on one device), `fsdp2` (fsdp2.py, the
model sharded across torchrun ranks), `megatron` (megatron/, tensor and pipeline parallel);
registry.py builds the one a config names.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from configs.schema import LoraConfig
from models import lora as lora_lib
from transport.messages import LoraSpec


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` in `dtype` when it is floating point and `dtype` is given, else `t` itself."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


class Backend(Protocol):
    """What the trainer and the learner loop need from a training backend.

    Every call is made on every rank of the learner in the same order (the collective calls
    of a distributed backend rely on it); only rank 0 writes files other than its shards."""

    device: torch.device
    """Where batches go before `logprobs`."""
    dp_rank: int
    """This rank's index among the data-parallel ranks (they split each minibatch)."""
    dp_size: int
    """Number of data-parallel ranks; 1 = the trainer does not split batches."""
    lora: LoraSpec | None
    """The adapter's shape when training LoRA adapters (None: full weights train)."""
    autocast_dtype: torch.dtype
    """The autocast dtype a forward of `.model` needs to compute in model.dtype (float32: none;
    FSDP2's MixedPrecisionPolicy casts by itself)."""

    def logprobs(self, input_ids: torch.Tensor, temperature: float,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token logprobs (rows, L-1) of this rank's rows, differentiable. `position_ids`:
        rows packed into one sequence, positions from 0 at each row (`learner.pack_rows`)."""

    def logprobs_entropy(self, input_ids: torch.Tensor, temperature: float,
                         entropy_grad: bool = False, position_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` and the per-token entropy (rows, L-1) from the same forward pass (the
        entropy differentiable only with `entropy_grad`)."""

    def step(self, loss: torch.Tensor, max_grad_norm: float) -> float:
        """Backward on this rank's share of the loss, gradients summed over data-parallel ranks,
        global-norm clipping, optimizer step; returns the global gradient norm before clipping.
        The same as `zero_grad`, `backward(loss)`, `apply_gradients(max_grad_norm)`."""

    def zero_grad(self) -> None:
        """Forget the gradients (before the first `backward` of an update)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward on a share of the loss; gradients add up (micro-batches), summed over
        data-parallel ranks."""

    def apply_gradients(self, max_grad_norm: float) -> float:
        """Global-norm clipping and the optimizer step on the accumulated gradients; returns
        the global gradient norm before clipping."""

    def reduce_stats(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-rank shares of the loss statistics -> minibatch values (sum; max for `*_max`)."""

    def named_full_tensors(self, dtype: torch.dtype | None = None
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The full (unsharded) weights one tensor at a time, without tied duplicates; with
        LoRA the frozen base (HF names, no adapters). `dtype`: floating tensors cast to it (a
        sharded backend casts its shard before gathering: bf16 gathers half the bytes and no
        rank holds a tensor's full fp32 copy)."""

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the adapter tensors (unsharded; models/lora.py wire names)."""

    def save_checkpoint(self, path: Path, extra: dict) -> None:
        """Model + optimizer into directory `path` (learner/checkpoint.py: one format for every
        backend); rank 0 also writes `extra` (state.json)."""

    def load_checkpoint(self, path: Path) -> dict:
        """Restore model + optimizer from `path` (written by any backend, any number of
        ranks); returns the `extra` saved with it."""

    def export_hf(self, path: Path) -> None:
        """The current policy as an HF model directory (rank 0 writes it); with LoRA the merged
        model, and the PEFT adapter directory in `path/adapter`."""

    def gather_export(self, path: Path) -> Callable[[], None]:
        """`export_hf` in two parts: what every rank must do together now (the gathers), and
        rank 0's writing of the files, returned as a function to call later, when the other
        ranks no longer wait on a collective (a no-op on the other ranks)."""


ADAPTER_DIR = "adapter"
"""Subdirectory of an exported model holding the PEFT adapter (LoRA runs)."""


def with_lora(model: torch.nn.Module, lora: LoraConfig | None,
              seed: int = 0) -> tuple[torch.nn.Module, LoraSpec | None]:
    """`model` wrapped in trainable adapters when `lora.rank > 0`, with their spec. Each A
    starts at models/lora.py `initial_a(seed)`; on a meta-device model that is left to the
    sharded load (`adapter_starts`)."""
    if lora is None or lora.rank == 0:
        return model, None
    targets = lora.target_list()
    model = lora_lib.wrap(model, lora.rank, lora.alpha, lora.dropout, targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if lora_lib.is_a(name) and not p.is_meta:
                p.copy_(lora_lib.initial_a(name, tuple(p.shape), seed, p.dtype))
    return model, LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=targets)


def adapter_starts(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter's full starting value by parameter name (A: `initial_a`, B: zero), for
    a sharded load to copy each rank's part from (adapters are small)."""
    return {name: (lora_lib.initial_a(name, tuple(p.shape), seed, p.dtype) if lora_lib.is_a(name)
                   else torch.zeros(p.shape, dtype=p.dtype))
            for name, p in model.named_parameters() if lora_lib.is_adapter(name)}


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Activation checkpointing: each decoder layer's activations are recomputed in the
    backward instead of kept (HF's per-layer torch.utils.checkpoint, non-reentrant; the
    state dict's names do not change). `model`: an HF causal LM, a peft model of one, or a
    module whose `.model` is an HF backbone (the critic)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base = base if hasattr(base, "gradient_checkpointing_enable") else base.model
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def param_torch_dtype(param_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the trained weights (the backend section's `param_dtype`); bf16
    weights compute in bf16, so they need `dtype` (model.dtype) bf16 too."""
    weights = {"float32": torch.float32, "bfloat16": torch.bfloat16}[param_dtype]
    if weights == torch.bfloat16 and dtype != torch.bfloat16:
        raise ValueError(f"learner.backend.param_dtype=bfloat16 needs model.dtype=bfloat16 "
                         f"(the compute dtype is {str(dtype).removeprefix('torch.')})")
    return weights


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every parameter, or the adapters only under LoRA."""
    return [p for p in model.parameters() if p.requires_grad]
