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
import operator

import numpy as np

from buffer.record import TOKEN_FIELDS, TokenField, TrajGroup
from learner.leases import LeaseRecord
from transport.messages import FINISH_REASONS, NUMPY_DTYPES, GroupResult, Sample

CLEAN_ENDS = ("", *(r for r in FINISH_REASONS if r != "error"))
"""`Sample.finish` values a trajectory without an error may carry."""


class InvalidTrajectory(ValueError):
    """The trajectory cannot be trained on; the message says why."""


def to_group(msg: GroupResult, lease: LeaseRecord, vocab_size: int, latest_version: int,
             max_tokens: int) -> TrajGroup:
    """Convert and validate; raises InvalidTrajectory naming the first problem found.

    Dtype names, shapes and byte counts are compared column by column as lists; each column is
    then read in place from the message and cast once, into one array of its record dtype
    (buffer/record.py TOKEN_FIELDS; int64 for an integer column sent wider than that) for the
    whole group, and every value check runs once over that array (the casts are exact for
    every accepted dtype, so the checks see the values that were sent). Only when a check
    fails does a per-sample pass look for the sample to name. The samples' arrays in the record
    are views of these columns, or, in a group of `_VIEW_TOKENS` or more, of the message."""
    if msg.prompt_id != lease.prompt.prompt_id:
        raise InvalidTrajectory(f"prompt_id {msg.prompt_id} != leased {lease.prompt.prompt_id}")
    samples = msg.samples
    expected = list(range(lease.num_samples))
    if [s.sample_index for s in samples] != expected:
        samples = sorted(samples, key=lambda s: s.sample_index)
        indices = [s.sample_index for s in samples]
        if indices != expected:
            raise InvalidTrajectory(f"sample indices {indices[:10]} are not "
                                    f"0..{lease.num_samples - 1}")
    for s in samples:
        if s.finish not in CLEAN_ENDS:
            raise InvalidTrajectory(f"sample {s.sample_index}: finish must be one of {CLEAN_ENDS} "
                                    f"when there is no error, got {s.finish!r}")
    lengths = _uniform_lengths(samples, max_tokens)
    if lengths is None:  # mixed dtypes, or a problem that _check_sample names
        lengths = [_check_sample(s, max_tokens) for s in samples]
    ids, lps, vers, masks = (_column(samples, f) for f in TOKEN_FIELDS)
    bounds = np.cumsum(lengths)
    if not _values_ok(ids, lps, vers, masks, vocab_size, lease.min_version, latest_version):
        index, problem = _first_bad_value(ids, lps, vers, masks, vocab_size, lease.min_version,
                                          latest_version)
        sample = int(np.searchsorted(bounds, index, side="right"))
        raise InvalidTrajectory(f"sample {sample}: {problem}")
    model_tokens = np.maximum.reduceat(masks, bounds - lengths)  # masks are 0/1 by now
    if not model_tokens.all():
        raise InvalidTrajectory(f"sample {int(np.argmin(model_tokens))}: no model tokens "
                                "(loss_mask 1) to train on")
    rewards = np.array([s.reward for s in samples], dtype=np.float64)
    if not np.isfinite(rewards).all():
        raise InvalidTrajectory(f"reward must be finite, got {rewards.tolist()}")
    starts = (bounds - lengths).tolist()
    ends = bounds.tolist()

    large = int(bounds[-1]) >= _VIEW_TOKENS
    columns = {}
    for f, a in zip(TOKEN_FIELDS, (ids, lps, vers, masks)):
        views = _in_place(samples, f) if large else None
        columns[f.name] = views if views is not None else [a[i:j] for i, j in zip(starts, ends)]
    return TrajGroup.build(lease_id=lease.lease_id, prompt_id=lease.prompt.prompt_id,
                           actor_id=lease.actor_id, prompt_ids=lease.prompt.token_ids,
                           rewards=rewards, **columns)


COLUMNS = tuple(f.wire for f in TOKEN_FIELDS)
"""The per-token arrays of a Sample, in the order the checks use them."""

KINDS = {f.wire: f.kinds for f in TOKEN_FIELDS}
"""dtype kinds each column may have (all of them one length per sample)."""

_DTYPES = NUMPY_DTYPES


_GET = {name: operator.attrgetter(name) for name in COLUMNS}
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DATA = operator.attrgetter("data")


def _uniform_lengths(samples: list[Sample], max_tokens: int) -> list[int] | None:
    """Token count per sample when every column has one allowed dtype of the right kind, 1-D
    shapes equal across the columns, 1..max_tokens tokens and the right byte counts; None
    otherwise (then `_check_sample` accepts mixed dtypes or names the problem)."""
    shapes = list(map(_SHAPE, map(_GET["completion_ids"], samples)))
    lengths = [sh[0] for sh in shapes if len(sh) == 1]
    if len(lengths) != len(shapes) or min(lengths) < 1 or max(lengths) > max_tokens:
        return None
    for name in COLUMNS:
        arrays = list(map(_GET[name], samples))
        dtypes = set(map(_DTYPE, arrays))
        dt = _DTYPES.get(dtypes.pop()) if len(dtypes) == 1 else None
        if dt is None or dt.kind not in KINDS[name] or list(map(_SHAPE, arrays)) != shapes:
            return None
        if [len(a.data) for a in arrays] != [n * dt.itemsize for n in lengths]:
            return None
    return lengths


def _check_sample(s: Sample, max_tokens: int) -> int:
    """Scalar checks of one sample's arrays (dtype, 1-D, one length, byte count); its length."""
    arrays = [getattr(s, name) for name in COLUMNS]
    where = f"sample {s.sample_index}"
    for a in arrays:
        dt = _DTYPES.get(a.dtype)
        if dt is None:
            raise InvalidTrajectory(f"{where}: array dtype {a.dtype!r} is not one of "
                                    f"{tuple(NUMPY_DTYPES)}")
        if any(d < 0 for d in a.shape):
            raise InvalidTrajectory(f"{where}: array shape {a.shape} has a negative dimension")
        need = math.prod(a.shape) * dt.itemsize
        if need != len(a.data):
            raise InvalidTrajectory(f"{where}: array of dtype {a.dtype} and shape {a.shape} "
                                    f"needs {need} bytes, got {len(a.data)}")
    shapes = [a.shape for a in arrays]
    n = shapes[0][0] if len(shapes[0]) == 1 else -1
    if n < 1 or any(sh != (n,) for sh in shapes[1:]):
        raise InvalidTrajectory(f"{where}: arrays must be 1-D of one length >= 1, got shapes "
                                + ", ".join(str(sh) for sh in shapes))
    if n > max_tokens:
        raise InvalidTrajectory(f"{where}: {n} tokens > limit {max_tokens}")
    for name, a in zip(COLUMNS, arrays):
        if _DTYPES[a.dtype].kind not in KINDS[name]:
            raise InvalidTrajectory(
                f"{where}: logprobs must be floating point, got {a.dtype}" if name == "logprobs"
                else f"{where}: ids/versions/mask must be integer arrays")
    return n


_JOIN_BYTES = 64 * 1024
"""Below this many bytes a column is joined first (one numpy call instead of one per sample)."""


_WIDE = np.dtype(np.int64)
"""What an integer column its record dtype cannot hold is checked in (every allowed integer
dtype, transport/messages.py ALLOWED_DTYPES, fits)."""

def _column(samples: list[Sample], field: TokenField) -> np.ndarray:
    """One column of the whole group, cast to its record dtype, read straight from the received
    bytes (every array's dtype, shape and byte count were checked before). A small column of
    one dtype is joined and cast (one copy when the wire dtype is the record's, as actors send
    it); a large one is cast from each sample's bytes in place (one copy).

    An integer column that arrives in a dtype its record dtype cannot hold (int64 ids, int32
    masks) is read as int64 instead, so that the value checks see what was sent (a cast to
    int32 first could wrap an out-of-range id into the vocabulary, a mask of 257 to 1);
    `TrajGroup.build` narrows it once the checks have bounded every value."""
    arrays = list(map(_GET[field.wire], samples))
    dtypes = set(map(_DTYPE, arrays))
    target = field.dtype
    if target.kind in "iu" and not all(np.can_cast(_DTYPES[d], target) for d in dtypes):
        target = _WIDE
    if len(dtypes) == 1 and sum(map(len, map(_DATA, arrays))) < _JOIN_BYTES:
        joined = np.frombuffer(b"".join(map(_DATA, arrays)), _DTYPES[dtypes.pop()])
        return joined.astype(target, copy=False)
    return np.concatenate([np.frombuffer(a.data, _DTYPES[a.dtype]) for a in arrays],
                          dtype=target, casting="unsafe")


_VIEW_TOKENS = 4096
"""From this many tokens in a group on, the record keeps views of the received message
(`_in_place`); below it, slices of the checked columns: a view costs ~1.7 us to make, more
than copying a few KB (measured per group on this machine: equal at 512 and 2048 tokens, views
40 % faster at 8192 and 2-3x at 131072)."""


def _in_place(samples: list[Sample], field: TokenField) -> list[np.ndarray] | None:
    """The samples' arrays of `field` as read-only views of the received message, when every
    one was sent in the record dtype (as actors send ids, logprobs and versions); else None.

    The record then keeps the message's memory (which ZeroMQ allocated as it received it)
    instead of a copy: the checked column is a temporary whose memory the allocator reuses
    for the next group, where a kept copy would be fresh memory, a page fault per 4 KB.
    Called after the checks, so the views hold exactly the values that were checked."""
    arrays = list(map(_GET[field.wire], samples))
    if set(map(_DTYPE, arrays)) != {field.dtype.name}:
        return None
    return [np.frombuffer(a.data, field.dtype) for a in arrays]



def _values_ok(ids, lps, vers, masks, vocab_size: int, min_version: int,
               latest_version: int) -> bool:
    """True if every value check passes: reductions only, no per-token temporaries. (A NaN
    logprob makes min/max NaN, and every comparison with NaN is False.)"""
    if not (ids.min() >= 0 and ids.max() < vocab_size):
        return False
    if not (lps.min() > -np.inf and lps.max() <= 1e-3):
        return False
    if not (masks.min() >= 0 and masks.max() <= 1):
        return False
    if vers.max() > latest_version:
        return False
    lowest = vers.min()
    if lowest >= max(min_version, -1):
        return True
    # some token is older than the lease: fine only for tool tokens (mask 0) at -1 or later
    return lowest >= -1 and vers[masks == 1].min(initial=min_version) >= min_version


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
