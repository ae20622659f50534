"""Check a decoded GroupResult against its lease before anything reaches the buffer.

msgspec already guaranteed the types; this checks meaning: array dtypes and lengths agree,
token ids are inside the vocabulary, logprobs are finite and <= 0, versions of model tokens
(loss_mask 1) lie between the lease's min_version and the current version, the lease's samples
are all there exactly once, every sample has at least one model token, and its `finish` is a
known end reason other than "error" (or "" from agents that do not say).

Tool/environment tokens (loss_mask 0) were sampled by no policy: they are never trained on and
do not count toward a group's min_version or staleness. Agents give them version -1 and logprob
0; the check only asks that their version is -1 or a version that existed (<= current).
Value checks run once per column over the whole group (the message is columnar); only a failure
looks for the sample.
"""

from __future__ import annotations

import numpy as np

from buffer.record import TOKEN_FIELDS, TokenField, TrajGroup
from learner.leases import LeaseRecord
from transport.messages import FINISH_REASONS, Array, GroupResult

CLEAN_ENDS = ("", *(r for r in FINISH_REASONS if r != "error"))
"""`Sample.finish` values a trajectory without an error may carry."""


class InvalidTrajectory(ValueError):
    """The trajectory cannot be trained on; the message says why."""


def to_group(msg: GroupResult, lease: LeaseRecord, vocab_size: int, latest_version: int,
             max_tokens: int) -> TrajGroup:
    """Convert and validate; raises InvalidTrajectory naming the first problem found.

    The message is columnar (transport/messages.py GroupResult): each token column is read in
    place from the received bytes as one array for the whole group, and every value check runs
    once over it. A column sent wider than its record dtype (int64 ids, int32 masks) is checked
    in int64 and narrowed afterwards, so that nothing wraps into range; a column sent in its
    record dtype (as actors send them) is never copied: the record's per-sample arrays are
    read-only views of the message. Only when a check fails does a second pass look for the
    sample to name."""
    if msg.prompt_id != lease.prompt.prompt_id:
        raise InvalidTrajectory(f"prompt_id {msg.prompt_id} != leased {lease.prompt.prompt_id}")
    samples = msg.samples
    indices = [s.sample_index for s in samples]
    expected = list(range(lease.num_samples))
    order = None  # positions in sample_index order, when the actor listed them otherwise
    if indices != expected:
        order = sorted(range(len(indices)), key=indices.__getitem__)
        if [indices[i] for i in order] != expected:
            raise InvalidTrajectory(f"sample indices {indices[:10]} are not "
                                    f"0..{lease.num_samples - 1}")
    for s in samples:
        if s.finish not in CLEAN_ENDS:
            raise InvalidTrajectory(f"sample {s.sample_index}: finish must be one of {CLEAN_ENDS} "
                                    f"when there is no error, got {s.finish!r}")
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int64)
    if not (lengths.min() >= 1 and lengths.max() <= max_tokens):
        i = int(np.argmax((lengths < 1) | (lengths > max_tokens)))
        raise InvalidTrajectory(f"sample {indices[i]}: num_tokens {int(lengths[i])} is not in "
                                f"1..{max_tokens} (the token limit)")
    bounds = np.cumsum(lengths)
    total = int(bounds[-1])
    sent = [_column(msg, f, total) for f in TOKEN_FIELDS]
    checked = [_widened(a, f) for a, f in zip(sent, TOKEN_FIELDS)]
    if not _values_ok(*checked, vocab_size, lease.min_version, latest_version):
        index, problem = _first_bad_value(*checked, vocab_size, lease.min_version, latest_version)
        sample = indices[int(np.searchsorted(bounds, index, side="right"))]
        raise InvalidTrajectory(f"sample {sample}: {problem}")
    starts = bounds - lengths
    model_tokens = np.maximum.reduceat(checked[3], starts)  # masks are 0/1 by now
    if not model_tokens.all():
        raise InvalidTrajectory(f"sample {indices[int(np.argmin(model_tokens))]}: no model tokens "
                                "(loss_mask 1) to train on")
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    if not np.isfinite(rewards).all():
        raise InvalidTrajectory(f"reward must be finite, got {rewards.tolist()}")
    starts, ends = starts.tolist(), bounds.tolist()
    if order is not None:
        starts, ends = [starts[i] for i in order], [ends[i] for i in order]
        rewards = rewards[order]
    columns = {}
    for f, a in zip(TOKEN_FIELDS, sent):
        a = a.astype(f.dtype, copy=False)  # a no-op for the dtypes actors send
        columns[f.name] = [a[i:j] for i, j in zip(starts, ends)]
    return TrajGroup.build(lease_id=lease.lease_id, prompt_id=lease.prompt.prompt_id,
                           actor_id=lease.actor_id, prompt_ids=lease.prompt.token_ids,
                           rewards=rewards, **columns)


_WIDE = np.dtype(np.int64)
"""What an integer column its record dtype cannot hold is checked in (every allowed integer
dtype, transport/messages.py ALLOWED_DTYPES, fits)."""


def _column(msg: GroupResult, field: TokenField, total: int) -> np.ndarray:
    """`field`'s column as sent: a read-only view of the received bytes (`Array.to_numpy`
    checks that its dtype is allowed and its byte count fits its shape), of a dtype kind the
    field accepts and 1-D with `total` entries (the sum of the samples' num_tokens)."""
    a = getattr(msg, field.wire)
    try:
        column = a.to_numpy()
    except ValueError as e:
        raise InvalidTrajectory(f"{field.wire}: {e}") from e
    if column.dtype.kind not in field.kinds:
        raise InvalidTrajectory(
            f"{field.wire}: logprobs must be floating point, got {a.dtype}" if field.kinds == "f"
            else f"{field.wire}: ids/versions/mask must be integer arrays, got {a.dtype}")
    if column.shape != (total,):
        raise InvalidTrajectory(f"{field.wire}: shape {a.shape}, but the samples' num_tokens "
                                f"add up to {total}: every column must be 1-D of that length")
    return column


def _widened(a: np.ndarray, field: TokenField) -> np.ndarray:
    """What the value checks read: `a` itself, or, for an integer column its record dtype
    cannot hold exactly (int64 ids, int32 masks), `a` in int64, so that the checks see the
    values that were sent (a cast to int32 first could wrap an out-of-range id into the
    vocabulary, a mask of 257 to 1)."""
    if field.dtype.kind in "iu" and not np.can_cast(a.dtype, field.dtype):
        return a.astype(_WIDE)
    return a


def _values_ok(ids, lps, vers, masks, vocab_size: int, min_version: int,
               latest_version: int) -> bool:
    """True if every value check passes: reductions only, no per-token temporaries. (A NaN
    logprob makes min/max NaN, and every comparison with NaN is False.) A range [0, n) of an
    integer column is one pass: read as unsigned, a negative value is larger than any n."""
    if not _unsigned(ids).max() < vocab_size:
        return False
    if not (lps.min() > -np.inf and lps.max() <= 1e-3):
        return False
    if not _unsigned(masks).max() <= 1:
        return False
    if vers.max() > latest_version:
        return False
    lowest = vers.min()
    if lowest >= max(min_version, -1):
        return True
    # some token is older than the lease: fine only for tool tokens (mask 0) at -1 or later
    return lowest >= -1 and vers[masks == 1].min(initial=min_version) >= min_version


def _unsigned(a: np.ndarray) -> np.ndarray:
    """An integer or bool column read as the unsigned integers of its width (a view, no copy)."""
    return a.view(f"u{a.itemsize}") if a.dtype.kind in "ib" else a


def _first_bad_value(ids, lps, vers, masks, vocab_size: int, min_version: int,
                     latest_version: int) -> tuple[int, str]:
    """(token index, problem) of the first value check that fails (called after `_values_ok`
    found one)."""
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
    raise AssertionError("_values_ok and _first_bad_value disagree")


def sample_ids(a: Array, vocab_size: int, max_tokens: int) -> np.ndarray:
    """A streamed sample's completion ids (transport/messages.py SampleDone), checked as a
    GroupResult's are: 1-D integers, 1..max_tokens of them, inside the vocabulary. Raises
    InvalidTrajectory naming the problem."""
    try:
        ids = a.to_numpy()
    except ValueError as e:
        raise InvalidTrajectory(f"completion_ids: {e}") from e
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        raise InvalidTrajectory(f"completion_ids must be a 1-D integer array, got {a.dtype} "
                                f"of shape {a.shape}")
    if not 1 <= len(ids) <= max_tokens:
        raise InvalidTrajectory(f"{len(ids)} completion ids, not in 1..{max_tokens} (the token "
                                "limit)")
    if not _unsigned(ids).max() < vocab_size:
        raise InvalidTrajectory(f"token id outside vocabulary [0, {vocab_size})")
    return ids
