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

By default this is padding-free by bucketing: each micro-batch's rows are right-padded to its
longest row and the forward pass is purely causal, so a row never sees another row's tokens.
With `learner.pack_rows` the rows are packed instead:

    rows sorted by length, longest first -> first fit: a row joins the first micro-batch whose
    rows' own tokens + its own <= budget (a row longer than the budget goes alone) -> the rows'
    tokens concatenated into ONE sequence (1, tokens), position ids from 0 at each row

transformers reads the row boundaries from the position ids when no attention mask is given
(masking_utils.find_packed_sequence_indices) and masks attention across them; the trainer checks
this at start-up (models/packing.py). Each row's per-token outputs are the next-token ones
within the row: the output at a row's last token (which would predict the next row's first) is
dropped, and the rest go back into the share's (rows, L-1) layout (`MicroBatch.outputs`), so the
loss code is the same for both.
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
    packed: torch.Tensor | None = None
    """`learner.pack_rows`: each row's own length (int64, in `rows` order); the rows run as one
    sequence of their sum. None: rows of `length`, right-padded."""

    def take(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This micro-batch's part of a per-row (rows,) or per-token (rows, L-1) tensor."""
        if t is None or t.dim() == 0:
            return t
        t = t.index_select(0, self.rows.to(t.device))
        return t if t.dim() == 1 else t[:, :self.length - 1]

    def inputs(self, mb: TokenBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's input ids and position ids: its rows (rows, length) and None, or packed,
        the rows' own tokens as one sequence (1, tokens) and each row's positions from 0."""
        ids = mb.input_ids.index_select(0, self.rows.to(mb.input_ids.device))[:, :self.length]
        if self.packed is None:
            return ids, None
        keep = self._within(ids.device, 0)
        pos = torch.arange(self.length, device=ids.device).expand_as(ids)
        return ids[keep][None], pos[keep][None]

    def outputs(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A per-token output of `inputs` ((rows, length-1), or packed (1, tokens-1)) in the
        rows' layout (rows, length-1); packed: zeros past each row's end, and the output at a
        row's last token (a prediction of the next row's first) dropped."""
        if t is None or self.packed is None:
            return t
        keep = self._within(t.device, 0)
        # packed output j predicts token j+1: kept where that token is in the same row
        same_row = torch.nn.functional.pad(keep[:, 1:], (0, 1))[keep][:-1]
        return t.new_zeros(len(self.rows), self.length - 1).masked_scatter(
            self._within(t.device, 1), t[0][same_row])

    def run(self, fn: Callable, mb: TokenBatch):
        """`fn(input_ids, position_ids)` on this micro-batch's `inputs`; its per-token output
        (or each of a tuple's) in the rows' layout (`outputs`)."""
        out = fn(*self.inputs(mb))
        return tuple(map(self.outputs, out)) if isinstance(out, tuple) else self.outputs(out)

    def _within(self, device: torch.device, cut: int) -> torch.Tensor:
        """(rows, length - cut) bool: column c is within its row (c < the row's length - cut)."""
        cols = torch.arange(self.length - cut, device=device)
        return cols[None] < (self.packed.to(device) - cut)[:, None]

    def batch(self, mb: TokenBatch) -> TokenBatch:
        """Its rows of `mb`, cut to `length`; `rewards` stays the share's (per group, used at
        step start only)."""
        ids = mb.input_ids.index_select(0, self.rows.to(mb.input_ids.device))
        return TokenBatch(input_ids=ids[:, :self.length].contiguous(),
                          mask=self.take(mb.mask), behavior=self.take(mb.behavior),
                          versions=self.take(mb.versions), rewards=mb.rewards,
                          num_groups=mb.num_groups, lengths=self.take(mb.lengths))


def plan(lengths: torch.Tensor, budget: int, pack: bool = False) -> list[MicroBatch]:
    """Split rows of these lengths into micro-batches of at most `budget` padded tokens, or
    with `pack`, of packed rows of at most `budget` tokens in all (module docstring)."""
    lens = lengths.cpu().numpy()
    order = np.argsort(-lens, kind="stable")
    groups: list[list[int]] = []
    used: list[int] = []  # packed: each group's tokens
    for i in order:
        n = int(lens[i])
        if pack:
            k = next((k for k, u in enumerate(used) if u + n <= budget), len(groups))
        elif groups and (len(groups[-1]) + 1) * int(lens[groups[-1][0]]) <= budget:
            k = len(groups) - 1
        else:
            k = len(groups)
        if k == len(groups):
            groups.append([])
            used.append(0)
        groups[k].append(int(i))
        used[k] += n
    parts = [sorted(g) for g in groups]
    return [MicroBatch(rows=torch.tensor(g, dtype=torch.int64), length=int(lens[g].max()),
                       packed=torch.tensor(lens[g], dtype=torch.int64) if pack else None)
            for g in parts]


def padded(parts: list[MicroBatch], count: int) -> list[MicroBatch]:
    """`parts` and stand-ins (`padding`) up to `count` micro-batches (the largest count of any
    rank): one row of the last part, cut to that part's length (packed: to its own)."""
    last = parts[-1]
    stand_in = MicroBatch(rows=last.rows[:1], length=last.length, padding=True,
                          packed=None if last.packed is None else last.packed[:1])
    return parts + [stand_in] * (count - len(parts))


def per_token(parts: list[MicroBatch], mb: TokenBatch,
              fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """`fn(input_ids, position_ids)` -> per-token outputs, computed a micro-batch at a time (no
    gradient) and put back in the share's (rows, L-1) layout; columns past a row's micro-batch
    length are 0 (masked)."""
    out = torch.zeros(mb.mask.shape, dtype=torch.float32, device=mb.mask.device)
    for part in parts:
        got = part.run(fn, mb)
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
