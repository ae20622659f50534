"""A process ends when another one ends, however that one ends (SIGKILL included).

Used by the processes an actor or the learner starts and that must not outlive it: engine
processes (actors/lifeline.py, actors/engines/sglang/engine.py) and reward workers (tasks/rewards.py),
which may be stuck in a user's reward when their owner dies.

PR_SET_PDEATHSIG is not enough: it fires when the *thread* that started a child exits, not the
process, and an engine's own process tree can start children from threads that end early. A pidfd
on the owner does not depend on who started whom: it becomes readable once the owner has exited.
"""

from __future__ import annotations

import os
import select
import threading


def die_with(pid: int) -> None:
    """End this process once process `pid` has exited. Returns at once (a daemon thread
    waits); raises ProcessLookupError if `pid` is already gone (the caller is orphaned)."""
    fd = os.pidfd_open(pid)

    def watch() -> None:
        select.select([fd], [], [])  # readable once `pid` has exited
        os._exit(1)

    threading.Thread(target=watch, name="tether-die-with", daemon=True).start()
