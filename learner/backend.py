"""Training backends: own the model and optimizer; know nothing about RL.

The trainer (learner/trainer.py) asks a backend for token logprobs, hands it a loss to step on,
and asks for the full weights to publish: the `Backend` protocol below. `SingleProcessBackend`
is one process on one device; `FSDP2Backend` (learner/fsdp.py) implements the same calls over a
model sharded across torchrun ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from learner import checkpoint
from models.devices import compute
from models.logprobs import token_logprobs, token_logprobs_entropy
from models.tied import without_tied


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

    def logprobs(self, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
        """Token logprobs (rows, L-1) of this rank's rows, differentiable."""

    def logprobs_entropy(self, input_ids: torch.Tensor, temperature: float,
                         entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` and the per-token entropy (rows, L-1) from the same forward pass (the
        entropy differentiable only with `entropy_grad`)."""

    def step(self, loss: torch.Tensor, max_grad_norm: float) -> float:
        """Backward on this rank's share of the loss, gradients summed over data-parallel ranks,
        global-norm clipping, optimizer step; returns the global gradient norm before clipping."""

    def reduce_stats(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-rank shares of the loss statistics -> minibatch values (sum; max for `*_max`)."""

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full (unsharded) weights one tensor at a time, without tied duplicates."""

    def save_checkpoint(self, path: Path, extra: dict) -> None:
        """Model + optimizer into directory `path` (learner/checkpoint.py: one format for every
        backend); rank 0 also writes `extra` (state.json)."""

    def load_checkpoint(self, path: Path) -> dict:
        """Restore model + optimizer from `path` (written by any backend, any number of
        ranks); returns the `extra` saved with it."""

    def export_hf(self, path: Path) -> None:
        """The current policy as an HF model directory (rank 0 writes it)."""


class SingleProcessBackend:
    dp_rank = 0
    dp_size = 1

    def __init__(self, model_dir: Path, lr: float, weight_decay: float, seed: int,
                 device: torch.device = torch.device("cpu"),
                 dtype: torch.dtype = torch.float32, model: torch.nn.Module | None = None) -> None:
        """fp32 weights on `device`; forward passes in `dtype` (models/devices.py). `model`:
        train this module instead of the HF causal LM in `model_dir` (the critic)."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.device = device
        self.dtype = dtype
        self.model_dir = Path(model_dir)
        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32)
        self.model.to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr,
                                           weight_decay=weight_decay)

    def logprobs(self, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
        with compute(self.device, self.dtype):
            return token_logprobs(self.model, input_ids, temperature)

    def logprobs_entropy(self, input_ids: torch.Tensor, temperature: float,
                         entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        with compute(self.device, self.dtype):
            return token_logprobs_entropy(self.model, input_ids, temperature, entropy_grad)

    def step(self, loss: torch.Tensor, max_grad_norm: float) -> float:
        """Backward + optimizer step; returns the gradient norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        else:
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in self.model.parameters()
                                  if p.grad is not None))
        self.optimizer.step()
        return float(norm)

    def reduce_stats(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return stats

    def named_full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.state_dict().items()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights for publishing, without tied duplicates."""
        return {k: v.detach() for k, v in without_tied(self.model.state_dict().items(),
                                                        self.model.config.tie_word_embeddings)}

    def save_checkpoint(self, path: Path, extra: dict) -> None:
        path.mkdir(parents=True, exist_ok=True)
        checkpoint.save(path, self.model, self.optimizer, extra, "single", 0, 1)

    def load_checkpoint(self, path: Path) -> dict:
        return checkpoint.load(path, self.model, self.optimizer)

    def export_hf(self, path: Path) -> None:
        """The current policy as an HF model directory (safetensors + config + tokenizer)."""
        from models.tiny import load_tokenizer

        self.model.save_pretrained(path, safe_serialization=True)
        load_tokenizer(self.model_dir).save_pretrained(path)
