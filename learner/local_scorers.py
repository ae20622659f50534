"""The scorers a learner starts on its own node (`scoring.num_local`, when task.scorers has
model scorers): `python -m actors.scorer` children (logs in run_dir/logs/scorer-N.log) that
exit with the learner, or with `transport.kind=inproc` threads of the learner's process, each on
its own event loop. They stop when the learner sends Shutdown; `reap` waits for that and kills a
process that does not exit. A scorer that dies is not restarted: its batches go to the others
(learner/scoring.py), and scorers started by hand may join at any time.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

from configs.placement import Placement, child_env
from configs.schema import TetherConfig, model_scorers

log = logging.getLogger(__name__)


class LocalScorers:
    def __init__(self, procs: list[subprocess.Popen], threads: list[threading.Thread]) -> None:
        self.procs = procs
        self.threads = threads

    @classmethod
    def start(cls, cfg: TetherConfig, endpoint: str, run_dir: Path,
              placement: Placement | None = None) -> LocalScorers:
        n = cfg.scoring.num_local if model_scorers(cfg) else 0
        if cfg.transport.kind == "inproc":
            threads = [threading.Thread(target=_run_thread, daemon=True, name=f"scorer-local-{i}",
                                        args=(cfg, endpoint, f"local-scorer-{i}", run_dir))
                       for i in range(n)]
            for t in threads:
                t.start()
            return cls([], threads)
        logs = run_dir / "logs"
        logs.mkdir(exist_ok=True)
        procs = []
        for i in range(n):
            with open(logs / f"scorer-{i}.log", "ab") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "actors.scorer", "-c", str(run_dir / "config.yaml"),
                     "--scorer-id", f"local-scorer-{i}", "--exit-with-parent", endpoint],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env=child_env(placement.scorers[i] if placement is not None
                                  and i < len(placement.scorers) else ())))
        if procs:
            log.info("started %d local scorer process(es); logs in %s", n, logs)
        return cls(procs, [])

    def reap(self, timeout: float = 15.0) -> None:
        """Wait up to `timeout` for every scorer to end after Shutdown; kill those that do not."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("scorer pid %d did not exit; killing it", p.pid)
                p.kill()
                p.wait()
        for t in self.threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))


def _run_thread(cfg: TetherConfig, endpoint: str, scorer_id: str, run_dir: Path) -> None:
    from actors.scorer import Scorer

    asyncio.run(Scorer(cfg, endpoint, scorer_id, run_dir / "scorer_cache").run())
