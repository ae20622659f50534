"""Per-token log-probabilities, computed the same way by actors (behavior) and learner.

Rows are right-padded and the forward pass is purely causal (no attention mask), so a token's
logprob never depends on what follows it. Callers that need bitwise reproducibility also fix
the padded length: CPU kernels give ulp-level differences for different sequence lengths.
"""

from __future__ import annotations

import torch


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) under softmax(logits / temperature).

    Returns a float32 tensor of shape (batch, seq_len - 1)."""
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def token_logprobs_entropy(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float,
                           entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` (bitwise the same values) and the entropy of each position's tempered
    next-token distribution, both (batch, seq_len - 1), from the same forward pass. Without
    `entropy_grad` the entropy is computed without autograd (no vocabulary-sized tensors kept)."""
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1), entropy
