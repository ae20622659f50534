"""Per-token log-probabilities, computed the same way by actors (behavior) and learner.

Rows are right-padded and the forward pass is purely causal (no attention mask), so a token's
logprob never depends on what follows it. Callers that need bitwise reproducibility also fix
the padded length: CPU kernels give ulp-level differences for different sequence lengths.
Packed rows (`position_ids` restarting at 0 at each row) are kept apart by the model's own
causal mask: transformers reads the row boundaries from the position ids.

The model's output head never produces the batch's full-vocabulary logits: for the duration of
the forward pass its `forward` is replaced by `models/chunked_logprobs.py`, which turns the
final hidden states into the chosen tokens' logprobs and the entropies a chunk of tokens at a
time (inside the model's own forward, so an FSDP2 root keeps its unsharded head for it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from models.chunked_logprobs import CHUNK_TOKENS, head_logprobs_entropy


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float,
                   chunk: int = CHUNK_TOKENS, position_ids: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) under softmax(logits / temperature).
    `position_ids`: packed rows (learner/algo/microbatch.py), each row's positions from 0.

    Returns a float32 tensor of shape (batch, seq_len - 1)."""
    return _forward(model, input_ids, temperature, False, chunk, position_ids)[0]


def token_logprobs_entropy(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float,
                           entropy_grad: bool = False, chunk: int = CHUNK_TOKENS,
                           position_ids: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` (bitwise the same values) and the entropy of each position's tempered
    next-token distribution, both (batch, seq_len - 1), from the same forward pass. Without
    `entropy_grad` the entropy carries no gradient."""
    lp, ent = _forward(model, input_ids, temperature, True, chunk, position_ids)
    return lp, (ent if entropy_grad else ent.detach())


def _forward(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float,
             with_entropy: bool, chunk: int,
             position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    head = model.get_output_embeddings()
    project = head.__dict__.get("forward") or type(head).forward.__get__(head)
    targets = input_ids[:, 1:]

    def chunked(hidden: torch.Tensor) -> torch.Tensor:  # (B, L, H) -> (B, L-1, 2)
        return torch.stack(head_logprobs_entropy(head, hidden[:, :-1], targets, temperature,
                                                 with_entropy, chunk, project),
                           dim=-1)

    if position_ids is not None:  # made beside the ids, which a backend may have moved
        position_ids = position_ids.to(input_ids.device)
    with _replaced_forward(head, chunked):
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return out[..., 0], out[..., 1]


@contextlib.contextmanager
def _replaced_forward(module: torch.nn.Module, forward) -> Iterator[None]:
    """`module(x)` calls `forward(x)` inside the block (an instance attribute over the class's
    method; the original `forward` stays reachable as `type(module).forward`)."""
    original = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if original is None:
            del module.forward
        else:
            module.forward = original
