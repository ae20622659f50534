"""Micro-batches by token budget (`learner.max_tokens_per_microbatch`): a rank's share of a
minibatch goes through the model a few rows at a time.

    rows sorted by length, longest first -> greedy: a micro-batch takes rows while
    rows x its longest row <= budget (a row longer than the budget goes alone) -> each
    micro-batch's rows are cut to its own longest row (no padding to the minibatch's longest)

The per-token tensors of the whole share (mask, behavior, pi_prox, advantages...; rows x
tokens, no vocabulary or hidden dimension) stay whole; only the model's forward and backward
see micro-batches. A loss computed on a micro-batch with the whole minibatch's `LossNorm` is
that micro-batch's share of the minibatch loss, so the shares' gradients, accumulated, are the
one-batch gradient (tests/test_microbatch.py); their statistics combine like ranks' (`combine`).

Under FSDP2 (and Megatron's data parallelism) every forward and backward is a collective, so
every rank must run as many micro-batches as the others: ranks agree on the largest count
(the trainer all-reduces it, `padded`) and a rank with fewer adds stand-ins
(`padding`): one of its rows, run forward and backward like any micro-batch, with its results
dropped and its loss multiplied by 0. Unequal counts would leave one rank in an all-gather
while another is in a reduce-scatter: a hang, not an error.

This is padding-free by bucketing: rows are not packed into one sequence (the forward pass has
no attention mask and the rows are right-padded, so a row never sees another row's tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from learner.algo.batch import TokenBatch


@dataclass(frozen=True)
class MicroBatch:
    rows: torch.Tensor
    """Indices of its rows in the share (int64)."""
    length: int
    """Its padded row length: its longest row's prompt + completion."""
    padding: bool = False
    """A stand-in that only keeps this rank's collectives in step with the others' (its
    results are dropped, its loss counts 0)."""

    def take(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This micro-batch's part of a per-row (rows,) or per-token (rows, L-1) tensor."""
        if t is None or t.dim() == 0:
            return t
        t = t.index_select(0, self.rows.to(t.device))
        return t if t.dim() == 1 else t[:, :self.length - 1]

    def batch(self, mb: TokenBatch) -> TokenBatch:
        """Its rows of `mb`, cut to `length`; `rewards` stays the share's (per group, used at
        step start only)."""
        ids = mb.input_ids.index_select(0, self.rows.to(mb.input_ids.device))
        return TokenBatch(input_ids=ids[:, :self.length].contiguous(),
                          mask=self.take(mb.mask), behavior=self.take(mb.behavior),
                          versions=self.take(mb.versions), rewards=mb.rewards,
                          num_groups=mb.num_groups, lengths=self.take(mb.lengths))


def plan(lengths: torch.Tensor, budget: int) -> list[MicroBatch]:
    """Split rows of these lengths into micro-batches of at most `budget` padded tokens."""
    lens = lengths.cpu().numpy()
    order = np.argsort(-lens, kind="stable")
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * int(lens[groups[-1][0]]) <= budget:
            groups[-1].append(int(i))
        else:
            groups.append([int(i)])
    return [MicroBatch(rows=torch.tensor(sorted(g), dtype=torch.int64),
                       length=int(lens[g].max())) for g in groups]


def padded(parts: list[MicroBatch], count: int) -> list[MicroBatch]:
    """`parts` and stand-ins (`padding`) up to `count` micro-batches (the largest count of any
    rank): one row of the last part, the shortest, cut to that part's length."""
    last = parts[-1]
    stand_in = MicroBatch(rows=last.rows[:1], length=last.length, padding=True)
    return parts + [stand_in] * (count - len(parts))


def per_token(parts: list[MicroBatch], mb: TokenBatch,
              fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fn(input_ids)` -> (rows, L-1), computed a micro-batch at a time (no gradient) and put
    back in the share's layout; columns past a row's micro-batch length are 0 (masked)."""
    out = torch.zeros(mb.mask.shape, dtype=torch.float32, device=mb.mask.device)
    for part in parts:
        got = fn(part.batch(mb).input_ids)
        if not part.padding:
            out[part.rows.to(out.device), :part.length - 1] = got.to(out.device, out.dtype)
    return out


def combine(shares: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Micro-batches' statistics (shares of the minibatch's) -> the share's: the sum, the max
    for `*_max` keys (as a backend's reduce_stats combines ranks)."""
    out = {}
    for k in shares[0]:
        vals = torch.stack([s[k].detach().float() for s in shares])
        out[k] = vals.max() if k.endswith("_max") else vals.sum()
    return out
