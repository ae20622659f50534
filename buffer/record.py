"""The training record of one finished lease, and its one array codec.

Every path that keeps or moves trajectories on the learner side uses this module:

    wire GroupResult ──learner/validate.py──▶ TrajGroup.build ──▶ ReplayBuffer ──▶ Trainer
    in-process loop (learner/sync_loop.py) ──▶ TrajGroup.build
    FSDP command broadcast, checkpoint buffer.npz ──▶ to_arrays / from_arrays

The per-token columns are declared once, in `TOKEN_FIELDS`: a record attribute, the
`GroupResult` column it comes from on the wire, and its dtype. The codec and validation iterate
that table and the actor's wire conversion iterates the wire's columns
(transport.messages.TOKEN_COLUMNS), so a new per-token field is an Array field of
`transport.messages.GroupResult` (and the agents' `Rollout` attribute of that name), a line in
`TOKEN_FIELDS` and an attribute of `TrajGroup`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TokenField:
    name: str
    """Attribute of TrajGroup (a list with one array per sample)."""
    wire: str
    """Column of transport.messages.GroupResult it arrives in."""
    dtype: np.dtype
    """What the record stores (values arrive in any allowed dtype of `kinds` and are cast)."""
    kinds: str
    """numpy dtype kinds accepted on the wire."""


TOKEN_FIELDS: tuple[TokenField, ...] = (
    TokenField("completions", "completion_ids", np.dtype(np.int32), "iu"),
    TokenField("logprobs", "logprobs", np.dtype(np.float32), "f"),
    TokenField("versions", "versions", np.dtype(np.int32), "iu"),
    TokenField("loss_masks", "loss_mask", np.dtype(np.uint8), "iub"),
)
"""The per-token columns, aligned token for token within a sample. Each is stored in the dtype
actors send it in (ids and versions int32: vocabularies and version counters stay far below
2**31; masks 0/1 as uint8): intake copies nothing it need not (the record keeps views of the
received bytes, learner/validate.py) and a buffered token takes 13 bytes (24 with int64 ids and
versions and float32 masks). The trainer's batch (learner/algo/batch.py) widens them to int64 and float32."""


@dataclass
class TrajGroup:
    """One finished lease: `len(completions)` rollouts of one prompt.

    Build it with `TrajGroup.build`, which casts every column to its `TOKEN_FIELDS` dtype;
    the arrays are never written to afterwards."""

    lease_id: int
    prompt_id: int
    actor_id: str
    prompt_ids: np.ndarray
    completions: list[np.ndarray]
    logprobs: list[np.ndarray]
    versions: list[np.ndarray]
    loss_masks: list[np.ndarray]
    rewards: np.ndarray
    uses: int = field(default=0)
    """How many batches this group has been served in."""

    @classmethod
    def build(cls, *, lease_id: int, prompt_id: int, actor_id: str, prompt_ids, rewards,
              uses: int = 0, **columns: list[np.ndarray]) -> TrajGroup:
        """The one constructor: every column of TOKEN_FIELDS, one array per sample."""
        names = {f.name for f in TOKEN_FIELDS}
        if set(columns) != names:
            raise TypeError(f"TrajGroup.build needs the columns {sorted(names)}, got "
                            f"{sorted(columns)}")
        cast = {f.name: [np.asarray(a, dtype=f.dtype) for a in columns[f.name]]
                for f in TOKEN_FIELDS}
        return cls(lease_id=int(lease_id), prompt_id=int(prompt_id), actor_id=actor_id,
                   prompt_ids=np.asarray(prompt_ids, dtype=np.int64),
                   rewards=np.asarray(rewards, dtype=np.float32), uses=int(uses), **cast)

    @functools.cached_property
    def min_version(self) -> int:
        """Oldest version among model tokens (loss_mask 1); tool tokens were sampled by no policy.
        Computed once (the arrays never change): `take` asks for it on every wake-up."""
        return min((int(v[m > 0].min()) for v, m in zip(self.versions, self.loss_masks)
                    if (m > 0).any()), default=0)

    @functools.cached_property
    def max_version(self) -> int:
        return max((int(v[m > 0].max()) for v, m in zip(self.versions, self.loss_masks)
                    if (m > 0).any()), default=0)

    @property
    def num_tokens(self) -> int:
        return sum(int(c.size) for c in self.completions)


# ---------------------------------------------------------------- the codec

SCHEMA: dict[str, np.dtype] = {
    "groups": np.dtype(np.int64),        # per group: lease_id, prompt_id, uses, samples
    "prompt_lengths": np.dtype(np.int64),
    "prompt_ids": np.dtype(np.int64),
    "sample_lengths": np.dtype(np.int64),
    "rewards": np.dtype(np.float32),
    "actor_ids": np.dtype(np.uint8),     # UTF-8, one line per group
    **{f.name: f.dtype for f in TOKEN_FIELDS},
}
"""The flat 1-D arrays `to_arrays` returns, in this order and with these dtypes (a receiver
that knows the sizes can allocate them before the data arrives: the FSDP broadcast does)."""

_GROUP_COLUMNS = 4


def to_arrays(groups: list[TrajGroup]) -> dict[str, np.ndarray]:
    """Groups -> the flat arrays of `SCHEMA` (no pickle: np.savez- and broadcast-able)."""
    table = np.array([[g.lease_id, g.prompt_id, g.uses, len(g.completions)] for g in groups],
                     np.int64).reshape(-1)
    out = {
        "groups": table,
        "prompt_lengths": np.array([len(g.prompt_ids) for g in groups], np.int64),
        "prompt_ids": _concat([g.prompt_ids for g in groups], np.int64),
        "sample_lengths": np.array([len(c) for g in groups for c in g.completions], np.int64),
        "rewards": _concat([g.rewards for g in groups], np.float32),
        "actor_ids": np.frombuffer("\n".join(g.actor_id for g in groups).encode(), np.uint8),
    }
    for f in TOKEN_FIELDS:
        out[f.name] = _concat([a for g in groups for a in getattr(g, f.name)], f.dtype)
    return {k: out[k] for k in SCHEMA}


def from_arrays(arrays) -> list[TrajGroup]:
    """Inverse of `to_arrays` (`arrays`: any mapping of the SCHEMA names, e.g. an NpzFile)."""
    table = np.asarray(arrays["groups"]).reshape(-1, _GROUP_COLUMNS)
    prompts = _split(arrays["prompt_ids"], arrays["prompt_lengths"])
    lengths = np.asarray(arrays["sample_lengths"])
    columns = {f.name: _split(arrays[f.name], lengths) for f in TOKEN_FIELDS}
    rewards = np.asarray(arrays["rewards"])
    text = np.asarray(arrays["actor_ids"]).tobytes().decode()
    actor_ids = text.split("\n") if len(table) else []
    groups, s = [], 0
    for (lease_id, prompt_id, uses, n), prompt, actor in zip(table, prompts, actor_ids):
        n = int(n)
        groups.append(TrajGroup.build(
            lease_id=lease_id, prompt_id=prompt_id, actor_id=actor, prompt_ids=prompt,
            rewards=rewards[s:s + n], uses=uses,
            **{name: col[s:s + n] for name, col in columns.items()}))
        s += n
    return groups


def _concat(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def _split(flat, lengths) -> list[np.ndarray]:
    flat = np.asarray(flat)
    ends = np.cumsum(lengths)
    return [flat[e - int(n):e] for e, n in zip(ends, lengths)]
