"""Engine processes end when the actor that owns them ends, however it ends (SIGKILL included).

PR_SET_PDEATHSIG is not enough: it fires when the *thread* that started a child exits, not the
process, and an engine's own process tree can start children from threads that end early. A pidfd
on the actor does not depend on who started whom: it becomes readable once the actor has exited.
"""

from __future__ import annotations

import os
import select
import signal
import threading


def die_with(pid: int, also: tuple[int, ...] = ()) -> None:
    """SIGKILL the processes `also`, then end this one, once process `pid` has exited.
    Returns at once (a daemon thread waits); if `pid` has already exited, this process ends now."""
    fd = os.pidfd_open(pid)  # ProcessLookupError if `pid` is gone: the caller is orphaned already

    def watch() -> None:
        select.select([fd], [], [])  # readable once `pid` has exited
        for other in also:
            os.kill(other, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="tether-die-with-actor", daemon=True).start()


VLLM_ACTOR_PID = "TETHER_VLLM_ACTOR_PID"
"""Set by a vLLM actor before it starts its engine: the pid vLLM's processes die with."""

VLLM_PLUGIN = "tether_die_with_actor"
"""This package's entry point in the `vllm.general_plugins` group (pyproject.toml)."""


def vllm_die_with_actor() -> None:
    """vLLM general plugin, run by vLLM in each of its processes as it starts (EngineCore before
    it spawns its workers, each worker before it loads the model): such a process ends when the
    actor in VLLM_ACTOR_PID ends. Does nothing where that is unset or is this process (the actor
    itself, or vLLM used outside an actor)."""
    pid = os.environ.get(VLLM_ACTOR_PID)
    if pid is not None and int(pid) != os.getpid():
        die_with(int(pid))
