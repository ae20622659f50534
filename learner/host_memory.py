"""glibc malloc settings for the learner process, set before torch allocates.

On the host, tensors are allocated and freed by glibc's malloc. Its defaults fit a learner
badly: the mmap threshold starts at 128 KiB and *rises* to the size of each mmapped block
that is freed (up to 32 MiB), so after the first freed megabyte-sized tensor every later one
comes from the heap, where freed memory is rarely returned; and each thread that allocates
(the packer, the I/O thread, gloo's) gets an arena of its own. A learner that gathers,
casts and packs every tensor of the model once per step thus keeps up to a model's worth
of freed memory resident. A fixed threshold (blocks of `MMAP_THRESHOLD` or more are mapped
and unmapped: returned to the kernel when freed) and `ARENA_MAX` arenas keep the resident
set near what is live (lab/results/memory.json, "allocator": the measurements).

A `MALLOC_MMAP_THRESHOLD_` or `MALLOC_ARENA_MAX` in the environment wins (the user chose);
elsewhere than glibc this does nothing.
"""

from __future__ import annotations

from transport.malloc import mallopt_unless_set

M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 256 << 10
ARENA_MAX = 2


def tune_malloc() -> dict[str, int]:
    """Apply the settings above that the environment does not set; returns what was set."""
    return mallopt_unless_set({"MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                               "MALLOC_ARENA_MAX": (M_ARENA_MAX, ARENA_MAX)})
