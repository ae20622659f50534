"""Reward functions named by import path, run in a pool of worker processes with a timeout.

`task.reward` names a function as `package.module:function` or `path/to/file.py:function`:

    def my_reward(completion: str, completion_ids: list[int], label, metadata: dict,
                  **reward_kwargs) -> float | dict[str, float]      # or `async def`

`completion` is the decoded completion (special tokens skipped), `label` the row's label column
and `metadata` its metadata columns (JSON values, as in the data file); `reward_kwargs` are
`task.reward_kwargs`. A dict return value holds named scores: its `score` entry is the reward,
and every entry is logged (`score_<name>` in metrics.jsonl, sums in summary.json).

Each call runs in one of `task.reward_workers` worker processes (spawned, so a reward can use
signals, C libraries or its own event loop and cannot crash or block the actor). A call that
runs past `task.reward_timeout_s` has its worker killed and replaced; a call that raises, or
returns something that is not a finite number / a dict with a finite `score`, is an error. Both
score 0 and the rollout is kept; every result carries the flags `reward_timeout` and
`reward_error` (0 or 1), so the learner's sums account for every call. A worker ends with the
process that started it (an actor, or the learner for its evaluations), also when that one is
SIGKILLed while a reward hangs (transport/lifeline.py).

Calls reach the workers over a local multiprocessing pipe (pickled arguments: the completion,
its ids, the row's label and metadata), between this process and its own children only; nothing
from a socket is unpickled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import multiprocessing
import os
import queue
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from configs.imports import load_function
from transport.lifeline import die_with

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardResult:
    reward: float
    scores: dict[str, float] = field(default_factory=dict)
    """Named scores of the call, with the `reward_timeout` / `reward_error` flags."""


def normalize(value: Any) -> tuple[float, dict[str, float]]:
    """A reward function's return value -> (reward, named scores); ValueError if malformed."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a dict reward needs a 'score' entry, got keys {sorted(value)}")
        scores = {str(k): _finite(v, f"score {k!r}") for k, v in value.items()}
        return scores["score"], scores
    return _finite(value, "reward"), {}


def _finite(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{what} must be a finite number, got {v!r}")
    return float(v)


def _call(fn: Callable, args: tuple, kwargs: dict) -> Any:
    out = fn(*args, **kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def _worker_main(conn, spec: str, kwargs: dict, owner: int) -> None:
    """A reward worker: load the function once, then answer calls until the pipe closes. It
    ends with the process `owner` that started it, even while it is stuck in a reward (a closed
    pipe is only noticed between calls)."""
    die_with(owner)
    fn = load_function(spec, "task.reward")
    conn.send(("ready", None))
    while True:
        try:
            args = conn.recv()
        except EOFError:  # the pool (or its process) is gone
            return
        try:
            conn.send(("ok", normalize(_call(fn, args, kwargs))))
        except Exception as e:  # the user's reward failed: report it, keep serving
            conn.send(("error", f"{type(e).__name__}: {e}"[:300]))


LOG_FIRST, LOG_EVERY = 3, 100
"""A failing reward is logged on its first LOG_FIRST failures, then on every LOG_EVERY-th."""

STARTUP_S = 120.0
"""How long a new worker may take to start and import the reward (not counted as a call)."""


class _Worker:
    def __init__(self, ctx, spec: str, kwargs: dict) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, kwargs, os.getpid()),
                                daemon=True, name="tether-reward")
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        """Block until the worker has imported the reward (once); the call timeout starts after."""
        if self.ready:
            return
        if not self.conn.poll(STARTUP_S):
            raise RuntimeError(f"reward worker did not start within {STARTUP_S:g}s")
        self.conn.recv()
        self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class RewardPool:
    """`task.reward` in `workers` processes; `await pool.score(...)` never blocks the loop."""

    def __init__(self, spec: str, kwargs: dict, workers: int, timeout_s: float) -> None:
        load_function(spec, "task.reward")  # a bad path fails here, not in every call
        self.spec, self.kwargs, self.timeout_s = spec, dict(kwargs), timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(_Worker(self._ctx, spec, self.kwargs))
        self._threads = concurrent.futures.ThreadPoolExecutor(workers, "tether-reward")
        self.counts: Counter[str] = Counter()
        """Calls by outcome: ok / timeout / error."""

    async def score(self, completion: str, completion_ids: list[int], label: Any,
                    metadata: dict) -> RewardResult:
        loop = asyncio.get_running_loop()
        status, value = await loop.run_in_executor(
            self._threads, self._run, (completion, completion_ids, label, metadata))
        self.counts[status] += 1
        flags = {"reward_timeout": float(status == "timeout"), "reward_error": float(status == "error")}
        if status != "ok":
            failures = self.counts["timeout"] + self.counts["error"]
            if failures <= LOG_FIRST or failures % LOG_EVERY == 0:  # rate-limited
                log.warning("reward %s %s (scored 0): %s [%d failed calls so far: %d errors, "
                            "%d timeouts, of %d%s]", self.spec,
                            "timed out" if status == "timeout" else "failed", value, failures,
                            self.counts["error"], self.counts["timeout"],
                            sum(self.counts.values()),
                            f"; logging every {LOG_EVERY}th from now" if failures == LOG_FIRST
                            else "")
            return RewardResult(0.0, flags)
        reward, scores = value
        return RewardResult(reward, {**scores, **flags})

    def _run(self, args: tuple) -> tuple[str, Any]:
        """One call on an idle worker, in one of the pool's threads (there are as many threads
        as workers, so one is always idle here); a hung or dead worker is replaced."""
        worker = self._idle.get()
        worker.wait_ready()
        worker.conn.send(args)
        if not worker.conn.poll(self.timeout_s):
            worker.kill()
            self._idle.put(_Worker(self._ctx, self.spec, self.kwargs))
            return "timeout", f"no result after {self.timeout_s:g}s"
        try:
            status, value = worker.conn.recv()
        except EOFError:  # the worker died (e.g. the reward called os._exit or segfaulted)
            worker.kill()
            self._idle.put(_Worker(self._ctx, self.spec, self.kwargs))
            return "error", f"worker exited with code {worker.proc.exitcode}"
        self._idle.put(worker)
        return status, value

    def close(self) -> None:
        """Stop the workers (waits for running calls to end first)."""
        self._threads.shutdown(wait=True)
        while not self._idle.empty():
            self._idle.get().kill()
