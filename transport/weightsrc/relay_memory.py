"""glibc malloc settings for a relay process: receive buffers are reused, not mapped afresh.

libzmq receives each bucket (~32 MB, the largest tensor's bucket more) into one block it
mallocs. glibc maps blocks over its mmap threshold (at most 32 MiB) with mmap and unmaps them
when freed, so each version a relay received came into pages the kernel had to fault in and
zero again: one minor fault per 4 KiB received (65,685 a version for SmolLM2 bf16), about half
of the receiving thread's CPU (lab/notes/benchmarks.md, 2026-12-07 fourth session). A relay's
cache holds the newest `keep_versions` versions in steady state, and the version it evicts
frees the blocks the next one needs: with no mmapped blocks (`M_MMAP_MAX` 0), one arena and
no trimming, freed blocks stay in the heap and are reused, faulted in once. The resident set
then stays at its peak (the cache plus the version arriving) instead of dropping after an
eviction. Actors are left alone: their buckets are garbage once loaded, and an engine's host
would keep a model's worth of freed memory.

A `MALLOC_*` setting in the environment wins (the user chose); elsewhere than glibc this
does nothing.
"""

from __future__ import annotations

from transport.malloc import mallopt_unless_set

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = {"MALLOC_MMAP_MAX_": (M_MMAP_MAX, 0), "MALLOC_ARENA_MAX": (M_ARENA_MAX, 1),
            "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, 2**31 - 1)}
"""(a free top of the heap is given back only past 2 GiB)"""


def reuse_receive_buffers() -> dict[str, int]:
    """Apply the settings above that the environment does not set; returns what was set.
    Call before the relay's ZeroMQ context starts its I/O thread (which gets an arena of its
    own on its first malloc otherwise)."""
    return mallopt_unless_set(SETTINGS)
