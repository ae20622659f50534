"""The building blocks of the config schema: sections, per-kind sections and the common field types.

A family that a user picks from (the rollout engine, the agent, the learner backend) is one field
whose type is a tagged union of `Kind` sections: `actors.engine: {kind: vllm, kv_cache_gb: 0.5}`.
Each kind's section holds only that kind's fields, so a field of another kind is an unknown key,
and a field a kind cannot do without has no default. A kind's name alone (`actors.engine: vllm`)
stands for that kind with its defaults (`configs.loader` expands it).
"""

from __future__ import annotations

import typing
from typing import Annotated

import msgspec
from msgspec import Meta

Count = Annotated[int, Meta(ge=1)]
"""An int >= 1."""
NonNegative = Annotated[int, Meta(ge=0)]
"""An int >= 0."""
Positive = Annotated[float, Meta(gt=0)]
"""A float > 0."""
Port = Annotated[int, Meta(ge=0, le=65535)]
"""A TCP port; 0 = pick a free one."""
ImportPath = Annotated[str, Meta(pattern=":", description="module:function")]
"""An import path `package.module:function` (or `path/to/file.py:function`)."""


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A config section: keyword-only, and an unknown key is an error."""


class Kind(Section, tag_field="kind"):
    """One kind's section of a family: the tag `kind` names the kind (`tag=` on each subclass)."""

    @property
    def kind(self) -> str:
        """The kind's name, the section's `kind:` tag."""
        return self.__struct_config__.tag


def kinds_of(hint: object) -> dict[str, type[Kind]] | None:
    """{kind name: section} when `hint` is a tagged union of `Kind` sections, else None."""
    args = typing.get_args(hint)
    if not args or not all(isinstance(a, type) and issubclass(a, Kind) for a in args):
        return None
    return {a.__struct_config__.tag: a for a in args}
