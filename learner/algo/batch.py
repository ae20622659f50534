"""Turn a list of TrajGroups into padded tensors aligned with next-token logprobs.

Row i is prompt + completion, right-padded. Column t of the (rows, L-1) tensors refers to the
token at position t+1 (the one predicted from position t), so completion token j of a row with
prompt length P sits in column P-1+j.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from buffer.record import TrajGroup


@dataclass
class TokenBatch:
    input_ids: torch.Tensor      # (rows, L) int64
    mask: torch.Tensor           # (rows, L-1) float32: 1 where a trained token is predicted
    behavior: torch.Tensor       # (rows, L-1) float32: mu, 0 off-mask
    versions: torch.Tensor       # (rows, L-1) int64: policy version that sampled each token
    rewards: torch.Tensor        # (groups, n) float32
    num_groups: int
    lengths: torch.Tensor | None = None  # (rows,) int64: prompt + completion tokens per row

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(input_ids=self.input_ids.to(device), mask=self.mask.to(device),
                          behavior=self.behavior.to(device), versions=self.versions.to(device),
                          rewards=self.rewards.to(device), num_groups=self.num_groups,
                          lengths=self.lengths)


def padded_length(groups: list[TrajGroup]) -> int:
    """The row length `collate` pads `groups` to: the longest prompt + completion."""
    return max(len(g.prompt_ids) + len(c) for g in groups for c in g.completions)


def collate(groups: list[TrajGroup], pad_id: int, length: int | None = None) -> TokenBatch:
    """Pad to `length` (default: `padded_length(groups)`); a data-parallel shard passes its whole
    minibatch's length so that its rows are exactly the single-process rows."""
    rows = [(g.prompt_ids, c, lp, v, lm) for g in groups
            for c, lp, v, lm in zip(g.completions, g.logprobs, g.versions, g.loss_masks)]
    length = padded_length(groups) if length is None else length
    ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), length - 1), dtype=np.float32)
    behavior = np.zeros((len(rows), length - 1), dtype=np.float32)
    versions = np.zeros((len(rows), length - 1), dtype=np.int64)
    for i, (p, c, lp, v, lm) in enumerate(rows):
        P, T = len(p), len(c)
        ids[i, :P] = p
        ids[i, P:P + T] = c
        mask[i, P - 1:P - 1 + T] = lm
        behavior[i, P - 1:P - 1 + T] = lp * lm
        versions[i, P - 1:P - 1 + T] = v
    rewards = np.stack([g.rewards for g in groups])
    lengths = torch.tensor([len(p) + len(c) for p, c, *_ in rows], dtype=torch.int64)
    return TokenBatch(input_ids=torch.from_numpy(ids), mask=torch.from_numpy(mask),
                      behavior=torch.from_numpy(behavior), versions=torch.from_numpy(versions),
                      rewards=torch.from_numpy(rewards), num_groups=len(groups), lengths=lengths)
