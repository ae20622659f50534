"""The chosen token's logprob and the entropy from hidden states, a chunk of tokens at a time.

The full-vocabulary logits of a batch are never held: for each chunk of `chunk` tokens the head
projects the hidden states to (chunk, vocab) logits in float32, takes the tempered log-softmax,
keeps the chosen token's logprob and the entropy, and drops the logits. Peak memory is
O(chunk x vocab) in the forward and in the backward, instead of O(tokens x vocab).

    plain Linear head (tied or not)  `LinearLogprobEntropy`: a custom autograd Function whose
                                     backward recomputes each chunk's softmax and returns the
                                     gradients of the hidden states and of the head's weight
                                     analytically (d logp / dz = onehot - p;
                                     d H / dz = -p (log p + H); both / temperature)
    any other head (a LoRA head)     `torch.utils.checkpoint` per chunk: the chunk's logits are
                                     recomputed by the head module in the backward

Each chunk's values are computed exactly as the unchunked code did (log_softmax, gather,
-(exp(lsm) lsm).sum), so a batch whose tokens fit in one chunk gives the same numbers; with or
without a gradient, with or without the entropy, the logprobs are bitwise the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 512
"""Tokens projected to the vocabulary at once (fp32 logits of 512 tokens x 152k: 0.3 GB)."""


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float,
            dtype: torch.dtype) -> torch.Tensor:
    """(n, H) -> tempered float32 logits (n, V), the matmul in `dtype` (the autocast dtype)."""
    with torch.autocast(hidden.device.type, enabled=False):
        z = F.linear(hidden.to(dtype), weight.to(dtype)).float()
    return z / temperature if temperature != 1.0 else z


def _values(z: torch.Tensor, targets: torch.Tensor,
            with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    lsm = torch.log_softmax(z, dim=-1)
    lp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, (-(lsm.exp() * lsm).sum(-1) if with_entropy else None)


class LinearLogprobEntropy(torch.autograd.Function):
    """(hidden (n, H), weight (V, H), targets (n,)) -> logprobs (n,) and entropies (n,) (zeros
    without `with_entropy`), float32; the backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int,
                dtype: torch.dtype, with_entropy: bool):
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            a, b = _values(_logits(hidden[s:s + chunk], weight, temperature, dtype),
                           targets[s:s + chunk], with_entropy)
            lp[s:s + chunk] = a
            if with_entropy:
                ent[s:s + chunk] = b
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets = ctx.saved_tensors
        T, chunk, dtype = ctx.temperature, ctx.chunk, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_hidden = torch.empty_like(hidden) if need_h else None
        g_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            lsm = torch.log_softmax(_logits(h, weight, T, dtype), dim=-1)
            p = lsm.exp()
            dz = torch.zeros_like(lsm)
            if g_lp is not None:
                gl = g_lp[s:s + chunk].float()
                dz = -p * gl[:, None]
                dz.scatter_add_(-1, targets[s:s + chunk, None], gl[:, None])
            if g_ent is not None:
                H = -(p * lsm).sum(-1, keepdim=True)
                dz = dz - g_ent[s:s + chunk, None].float() * p * (lsm + H)
            if T != 1.0:
                dz = dz / T
            with torch.autocast(hidden.device.type, enabled=False):
                dzc = dz.to(dtype)
                if need_h:
                    g_hidden[s:s + chunk] = (dzc @ weight.to(dtype)).to(hidden.dtype)
                if need_w:
                    g_weight += (dzc.t() @ h.to(dtype)).float()
        return (g_hidden, None if g_weight is None else g_weight.to(weight.dtype),
                None, None, None, None, None)


def head_logprobs_entropy(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                          temperature: float, with_entropy: bool = True,
                          chunk: int = CHUNK_TOKENS, project=None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (..., H), targets (...) -> logprobs and entropies (...), float32, through the
    output head `head` in chunks of `chunk` tokens (entropies are zeros without
    `with_entropy`). The matmul runs in the autocast dtype when autocast is on. `project`: how
    a head that is not a plain bias-free Linear maps hidden states to logits (default: call
    it)."""
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    chunk = chunk if chunk > 0 else max(h.shape[0], 1)
    if type(head) is torch.nn.Linear and head.bias is None:
        dev = h.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
        lp, ent = LinearLogprobEntropy.apply(h, head.weight, t, temperature, chunk, dtype,
                                             with_entropy)
        return lp.reshape(shape), ent.reshape(shape)
    project = head if project is None else project
    lps, ents = [], []
    for s in range(0, h.shape[0], chunk):
        def part(x, tt=t[s:s + chunk]):
            z = project(x).float()
            a, b = _values(z / temperature if temperature != 1.0 else z, tt, with_entropy)
            return a, (b if with_entropy else torch.zeros_like(a))
        if torch.is_grad_enabled():
            a, b = checkpoint(part, h[s:s + chunk], use_reentrant=False)
        else:
            a, b = part(h[s:s + chunk])
        lps.append(a)
        ents.append(b)
    return torch.cat(lps).reshape(shape), torch.cat(ents).reshape(shape)
