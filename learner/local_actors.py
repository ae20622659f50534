"""The actors a learner starts on its own node (`actors.num_local`).

With `transport.kind=zmq` each is a `python -m actors` child process (logs in
run_dir/logs/actor-N.log) that exits with the learner. With `transport.kind=inproc` each is a
thread of the learner's process running the same `Actor` on its own event loop, over ZeroMQ's
in-process transport: no process start-up, no TCP, one debugger sees everything.

Each process gets the GPUs the placement gives it (configs/placement.py) in
CUDA_VISIBLE_DEVICES ("" on the CPU) and none of torchrun's rendezvous environment: a local
actor of a torchrun learner is not a rank. `node_placement` computes this node's placement
when the learner starts (before any CUDA call: NVML counts the GPUs).

Actor processes run in sessions of their own: a Ctrl-C at the terminal, or torchrun passing a
signal to its ranks' process groups, reaches the learner only, which checkpoints, has the actors
evaluate the final version, and then tells them to shut down (they also exit when the learner's
process dies: --exit-with-parent).

Either way an actor stops when the learner sends Shutdown; `reap` waits for that and kills a
process that does not exit (a thread that does not is reported; threads cannot be killed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from configs.placement import Placement, child_env, plan
from configs.schema import TetherConfig, engine_gpus

log = logging.getLogger(__name__)


class LocalActors:
    def __init__(self, procs: list[subprocess.Popen], threads: list[threading.Thread]) -> None:
        self.procs = procs
        self.threads = threads
        self.exit_codes: dict[str, int] = {}
        """Thread actors that returned: actor id -> the code `Actor.run` returned."""

    @classmethod
    def start(cls, cfg: TetherConfig, endpoint: str, run_dir: Path,
              cpus: list[list[int]] | None = None,
              placement: Placement | None = None) -> LocalActors:
        """Start `actors.num_local` actors: threads (inproc transport) or processes, the i-th
        process pinned to `cpus[i]` if given (learner.cpu_placement split) and given the GPUs
        `placement.actors[i]` (none without a placement)."""
        n = cfg.actors.num_local
        if cfg.transport.kind == "inproc":
            actors = cls([], [])
            actors.threads = [threading.Thread(target=actors._run_thread, daemon=True,
                                               name=f"actor-local-{i}",
                                               args=(cfg, endpoint, f"local-{i}", run_dir))
                              for i in range(n)]
            for t in actors.threads:
                t.start()
            if n:
                log.info("started %d in-process actor thread(s)", n)
            return actors
        logs = run_dir / "logs"
        logs.mkdir(exist_ok=True)
        procs = []
        for i in range(n):
            with open(logs / f"actor-{i}.log", "ab") as out:
                pinned = ["--cpus", ",".join(map(str, cpus[i]))] if cpus else []
                gpus = placement.actors[i] if placement is not None else ()
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "actors", "-c", str(run_dir / "config.yaml"),
                     "--actor-id", f"local-{i}", "--exit-with-parent", *pinned, endpoint],
                    stdout=out, stderr=subprocess.STDOUT, env=child_env(gpus),
                    start_new_session=True))
        if procs:
            log.info("started %d local actor process(es); logs in %s", n, logs)
        return cls(procs, [])

    def _run_thread(self, cfg: TetherConfig, endpoint: str, actor_id: str, run_dir: Path) -> None:
        from actors.actor import Actor

        actor = Actor(cfg, endpoint, actor_id, run_dir / "actor_cache")
        self.exit_codes[actor_id] = asyncio.run(actor.run())  # a crash: logged, no code

    def __len__(self) -> int:
        return len(self.procs) + len(self.threads)

    def exited(self) -> list[str]:
        """The actors that are no longer running (pids or thread names)."""
        return ([str(p.pid) for p in self.procs if p.poll() is not None]
                + [t.name for t in self.threads if not t.is_alive()])

    def reap(self, timeout: float = 15.0) -> None:
        """Wait up to `timeout` for every actor to end after Shutdown; kill processes that
        do not."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("actor pid %d did not exit; killing it", p.pid)
                p.kill()
                p.wait()
        for t in self.threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("actor thread %s did not stop within %.0fs", t.name, timeout)


def node_placement(cfg: TetherConfig, learner_on_cuda: bool) -> Placement:
    """This node's placement: `placement.gpus_per_node` GPUs (0: as many as NVML counts, in
    CUDA_VISIBLE_DEVICES' numbering), LOCAL_WORLD_SIZE learner ranks on GPUs when the learner
    runs on CUDA, `actors.num_local` actors. Raises PlacementError (one line)."""
    from models.devices import cuda_count

    P = cfg.placement
    gpus = P.gpus_per_node or max(cuda_count(), 0)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if learner_on_cuda else 0
    return plan(gpus, ranks, str(P.learner), cfg.actors.num_local, engine_gpus(cfg, gpus),
                [str(a) for a in P.actors], [str(a) for a in P.scorers])
