"""glibc's `mallopt` for a process's own settings (learner/host_memory.py for the learner,
transport/weightsrc/relay_memory.py for relays). A `MALLOC_*` variable in the environment wins
over the process's setting (the user chose); elsewhere than glibc this does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import os


def mallopt_unless_set(settings: dict[str, tuple[int, int]]) -> dict[str, int]:
    """`settings`: environment variable -> (mallopt parameter, value). Applies those whose
    variable is not set; returns what was set."""
    path = ctypes.util.find_library("c")
    if path is None:
        return {}
    libc = ctypes.CDLL(path)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return {}
    done = {}
    for env, (param, value) in settings.items():
        if env not in os.environ and libc.mallopt(param, value) == 1:
            done[env] = value
    return done
