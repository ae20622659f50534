"""Check a decoded GroupResult against its lease before anything reaches the buffer.

msgspec already guaranteed the types; this checks meaning: array dtypes and lengths agree,
token ids are inside the vocabulary, logprobs are finite and <= 0, versions of model tokens
(loss_mask 1) lie between the lease's min_version and the current version, the lease's samples
are all there exactly once, every sample has at least one model token, and its `finish` is a
known end reason other than "error" (or "" from agents that do not say).

Tool/environment tokens (loss_mask 0) were sampled by no policy: they are never trained on and
do not count toward a group's min_version or staleness. Agents give them version -1 and logprob
0; the check only asks that their version is -1 or a version that existed (<= current).
Value checks run once over the whole group (concatenated); only a failure looks for the sample.
"""

from __future__ import annotations

import math

import numpy as np

from buffer.replay import TrajGroup
from learner.leases import LeaseRecord
from transport.messages import FINISH_REASONS, GroupResult

CLEAN_ENDS = ("", *(r for r in FINISH_REASONS if r != "error"))
"""`Sample.finish` values a trajectory without an error may carry."""


class InvalidTrajectory(ValueError):
    """The trajectory cannot be trained on; the message says why."""


def to_group(msg: GroupResult, lease: LeaseRecord, vocab_size: int, latest_version: int,
             max_tokens: int) -> TrajGroup:
    """Convert and validate; raises InvalidTrajectory naming the first problem found."""
    if msg.prompt_id != lease.prompt.prompt_id:
        raise InvalidTrajectory(f"prompt_id {msg.prompt_id} != leased {lease.prompt.prompt_id}")
    samples = sorted(msg.samples, key=lambda s: s.sample_index)
    indices = [s.sample_index for s in samples]
    if indices != list(range(lease.num_samples)):
        raise InvalidTrajectory(f"sample indices {indices[:10]} are not 0..{lease.num_samples - 1}")
    cols: list[list[np.ndarray]] = [[], [], [], []]
    for s in samples:
        if s.finish not in CLEAN_ENDS:
            raise InvalidTrajectory(f"sample {s.sample_index}: finish must be one of {CLEAN_ENDS} "
                                    f"when there is no error, got {s.finish!r}")
        try:
            arrays = (s.completion_ids.to_numpy(), s.logprobs.to_numpy(), s.versions.to_numpy(),
                      s.loss_mask.to_numpy())
        except ValueError as e:
            raise InvalidTrajectory(f"sample {s.sample_index}: {e}") from None
        _check_shapes(s.sample_index, arrays, max_tokens)
        for col, a in zip(cols, arrays):
            col.append(a)
    ids, lps, vers, masks = (np.concatenate(c) for c in cols)
    bad = _first_bad_value(ids, lps, vers, masks, vocab_size, lease.min_version, latest_version)
    if bad is not None:
        index, problem = bad
        sample = int(np.searchsorted(np.cumsum([len(a) for a in cols[0]]), index, side="right"))
        raise InvalidTrajectory(f"sample {sample}: {problem}")
    rewards = np.asarray([s.reward for s in samples], dtype=np.float32)
    if not all(math.isfinite(s.reward) for s in samples):
        raise InvalidTrajectory(f"reward must be finite, got {rewards.tolist()}")
    return TrajGroup(lease_id=lease.lease_id, prompt_id=lease.prompt.prompt_id,
                     actor_id=lease.actor_id, prompt_ids=lease.prompt.token_ids.astype(np.int64),
                     completions=[a.astype(np.int64) for a in cols[0]],
                     logprobs=[a.astype(np.float32) for a in cols[1]],
                     versions=[a.astype(np.int64) for a in cols[2]],
                     loss_masks=[a.astype(np.float32) for a in cols[3]], rewards=rewards)


def _check_shapes(index: int, arrays: tuple[np.ndarray, ...], max_tokens: int) -> None:
    ids, lp, ver, mask = arrays
    where = f"sample {index}"
    n = ids.shape[0] if ids.ndim == 1 else -1
    if n < 1 or any(a.shape != (n,) for a in (lp, ver, mask)):
        raise InvalidTrajectory(f"{where}: arrays must be 1-D of one length >= 1, got shapes "
                                f"{ids.shape}, {lp.shape}, {ver.shape}, {mask.shape}")
    if n > max_tokens:
        raise InvalidTrajectory(f"{where}: {n} tokens > limit {max_tokens}")
    if mask.dtype.kind in "iub" and not (mask == 1).any():
        raise InvalidTrajectory(f"{where}: no model tokens (loss_mask 1) to train on")
    if ids.dtype.kind not in "iu" or ver.dtype.kind not in "iu" or mask.dtype.kind not in "iub":
        raise InvalidTrajectory(f"{where}: ids/versions/mask must be integer arrays")
    if lp.dtype.kind != "f":
        raise InvalidTrajectory(f"{where}: logprobs must be floating point, got {lp.dtype}")


def _first_bad_value(ids, lps, vers, masks, vocab_size: int, min_version: int,
                     latest_version: int) -> tuple[int, str] | None:
    """(token index, problem) of the first value check that fails, or None."""
    model = masks == 1
    checks = (
        ((ids < 0) | (ids >= vocab_size), f"token id outside vocabulary [0, {vocab_size})"),
        (~np.isfinite(lps) | (lps > 1e-3), "logprobs must be finite and <= 0"),
        ((masks != 0) & (masks != 1), "loss_mask must be 0 or 1"),
        (model & ((vers < min_version) | (vers > latest_version)),
         f"versions of model tokens must lie in [{min_version} (the lease's min_version), "
         f"{latest_version}]"),
        (~model & ((vers < -1) | (vers > latest_version)),
         f"versions of tool tokens (loss_mask 0) must lie in [-1, {latest_version}]"),
    )
    for bad, problem in checks:
        if bad.any():
            return int(np.argmax(bad)), problem
    return None
