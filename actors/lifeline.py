"""vLLM's processes end when the actor that owns them ends, however it ends (SIGKILL included):
a vLLM plugin (below) makes each of them `die_with` the actor (transport/lifeline.py)."""

from __future__ import annotations

import os

from transport.lifeline import die_with


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
