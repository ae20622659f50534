"""Check a decoded GroupResult against its lease before anything reaches the buffer.

msgspec already guaranteed the types; this checks meaning: array dtypes and lengths agree,
token ids are inside the vocabulary, logprobs are finite and <= 0, versions are not from the
future, the lease's samples are all there exactly once.
"""

from __future__ import annotations

import math

import numpy as np

from buffer.replay import TrajGroup
from learner.leases import LeaseRecord
from transport.messages import GroupResult


class InvalidTrajectory(ValueError):
    """The trajectory cannot be trained on; the message says why."""


def to_group(msg: GroupResult, lease: LeaseRecord, vocab_size: int, latest_version: int,
             max_tokens: int) -> TrajGroup:
    """Convert and validate; raises InvalidTrajectory naming the first problem found."""
    if msg.prompt_id != lease.prompt.prompt_id:
        raise InvalidTrajectory(f"prompt_id {msg.prompt_id} != leased {lease.prompt.prompt_id}")
    indices = sorted(s.sample_index for s in msg.samples)
    if indices != list(range(lease.num_samples)):
        raise InvalidTrajectory(f"sample indices {indices[:10]} are not 0..{lease.num_samples - 1}")
    comps, lps, vers, masks, rewards = [], [], [], [], []
    for s in sorted(msg.samples, key=lambda s: s.sample_index):
        where = f"sample {s.sample_index}"
        try:
            ids = s.completion_ids.to_numpy()
            lp = s.logprobs.to_numpy()
            ver = s.versions.to_numpy()
            mask = s.loss_mask.to_numpy()
        except ValueError as e:
            raise InvalidTrajectory(f"{where}: {e}") from None
        n = ids.shape[0] if ids.ndim == 1 else -1
        if n < 1 or any(a.shape != (n,) for a in (lp, ver, mask)):
            raise InvalidTrajectory(f"{where}: arrays must be 1-D of one length >= 1, got shapes "
                                    f"{ids.shape}, {lp.shape}, {ver.shape}, {mask.shape}")
        if n > max_tokens:
            raise InvalidTrajectory(f"{where}: {n} tokens > limit {max_tokens}")
        if ids.dtype.kind not in "iu" or ver.dtype.kind not in "iu" or mask.dtype.kind not in "iub":
            raise InvalidTrajectory(f"{where}: ids/versions/mask must be integer arrays")
        if lp.dtype.kind != "f":
            raise InvalidTrajectory(f"{where}: logprobs must be floating point, got {lp.dtype}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise InvalidTrajectory(f"{where}: token id outside vocabulary [0, {vocab_size})")
        if not np.all(np.isfinite(lp)) or lp.max() > 1e-3:
            raise InvalidTrajectory(f"{where}: logprobs must be finite and <= 0")
        if ver.min() < lease.min_version or ver.max() > latest_version:
            raise InvalidTrajectory(f"{where}: versions must lie in [{lease.min_version} (the "
                                    f"lease's min_version), {latest_version}]")
        if not np.all((mask == 0) | (mask == 1)):
            raise InvalidTrajectory(f"{where}: loss_mask must be 0 or 1")
        if not math.isfinite(s.reward):
            raise InvalidTrajectory(f"{where}: reward must be finite, got {s.reward}")
        comps.append(ids.astype(np.int64))
        lps.append(lp.astype(np.float32))
        vers.append(ver.astype(np.int64))
        masks.append(mask.astype(np.float32))
        rewards.append(s.reward)
    return TrajGroup(lease_id=lease.lease_id, prompt_id=lease.prompt.prompt_id,
                     actor_id=lease.actor_id, prompt_ids=lease.prompt.token_ids.astype(np.int64),
                     completions=comps, logprobs=lps, versions=vers, loss_masks=masks,
                     rewards=np.asarray(rewards, dtype=np.float32))
