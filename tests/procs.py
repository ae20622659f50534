"""Run Tether roles as real subprocesses and wait on what they log (no sleeps)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import select
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "configs" / "toy_reverse.yaml"
UNTIL_LEARNED = "learner.stop_at_reward=0.9"
"""The toy-reversal learning tests run until the task is learned (sampled reward averaged over
the last 20 steps >= 0.9; the 500-step toy run ends at 0.99 held-out) or until their max_steps,
whichever comes first. Their held-out bars are checked on the final evaluation, which follows
either end, and is not what stopped the run."""


class Proc:
    """A `python -m MODULE ...` child whose output lines are collected by a reader thread."""

    def __init__(self, args: list[str], log_path: Path, prefix: tuple[str, ...] = (),
                 python: str = sys.executable, env: dict[str, str] | None = None) -> None:
        """`prefix`: e.g. ("ip", "netns", "exec", NS); `env`: variables added to ours."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = subprocess.Popen([*prefix, python, *args], cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.eof = False
        self.cond = threading.Condition()
        self.log = open(log_path, "w")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.log.write(line)
            self.log.flush()
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Block until a line matches `pattern`; fail if the process ends or time runs out."""
        rx = re.compile(pattern)
        seen = 0
        deadline = time.monotonic() + timeout  # a process that keeps logging does not extend it
        with self.cond:
            while True:
                for line in self.lines[seen:]:
                    if mt := rx.search(line):
                        return mt
                seen = len(self.lines)
                if self.eof:
                    raise AssertionError(f"process ended before {pattern!r}:\n{self.tail()}")
                left = deadline - time.monotonic()
                if left <= 0 or not self.cond.wait(timeout=left):
                    raise AssertionError(f"timed out waiting for {pattern!r}:\n{self.tail()}")

    def finish(self, timeout: float) -> int:
        rc = self.p.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def learner(run_dir: Path, model_dir: Path, *overrides: str, preset: Path = PRESET,
            python: str = sys.executable) -> Proc:
    args = ["-m", "learner", "-c", str(preset), f"run_dir={run_dir}", f"model.path={model_dir}",
            *overrides]
    return Proc(args, run_dir.parent / f"{run_dir.name}-learner.log", python=python)


def actor(run_dir: Path, actor_id: str, *overrides: str, python: str = sys.executable,
          env: dict[str, str] | None = None) -> Proc:
    args = ["-m", "actors", "-c", str(run_dir / "config.yaml"), "--actor-id", actor_id,
            str(run_dir / "endpoints.json"), *overrides]
    return Proc(args, run_dir.parent / f"{run_dir.name}-{actor_id}.log", python=python, env=env)


def finish_clean(lp: Proc, run_dir: Path, steps: int, timeout: float) -> dict:
    """Wait for the learner to end (killing it if the wait fails) and check that the run was
    clean: exit code 0, all `steps` trained (or fewer, where UNTIL_LEARNED ended it), accounting
    balanced, no message rejected, no group dropped as invalid or for an agent error. Returns
    summary.json."""
    try:
        assert lp.finish(timeout=timeout) == 0, lp.tail()
    finally:
        lp.kill()
    s = summary(run_dir)
    assert trained(s, steps) and s["accounting_ok"], s
    assert s["rejected_messages"] == {}, s["rejected_messages"]
    assert not set(s["groups"]["dropped"]) & {"agent_error", "invalid"}, (
        s["groups"]["dropped"], agent_failures(run_dir))
    return s


def trained(s: dict, steps: int) -> bool:
    """The run of summary `s` trained its max_steps `steps`, or ended sooner on stop_at_reward."""
    if s["end_reason"] == "reward_reached":
        return 1 <= s["steps"] < steps
    return s["end_reason"] == "finished" and s["steps"] == steps


def agent_failures(run_dir: Path) -> list[str]:
    """The actors' `agent failed` log lines (with the exception), for an assertion's message."""
    return [line for p in sorted((run_dir / "logs").glob("actor-*.log"))
            for line in p.read_text().splitlines() if "agent failed" in line]


class ThreadLog(logging.Handler):
    """Log records of this process, collected per thread (in-process actors are threads)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: dict[str, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.setdefault(record.threadName, []).append(record.getMessage())


def run_inproc(run_dir: Path, model_dir: Path, *overrides: str,
               preset: Path = PRESET) -> tuple[dict, ThreadLog]:
    """Learner and its actors.num_local actors in this process (transport.kind=inproc: actor
    threads over ZeroMQ's in-process transport); returns the summary and the log per thread."""
    from configs.loader import load_config
    from learner.main import run

    cfg = load_config(preset, [f"run_dir={run_dir}", f"model.path={model_dir}",
                               "transport.kind=inproc", *overrides])
    handler, root = ThreadLog(), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        summary_ = run(cfg)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return summary_, handler


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def learning_curve(run_dir: Path, every: int = 25) -> str:
    """The run's sampled reward, entropy, mean staleness and wall time every `every` steps, one
    line per step: the message of a failed learning bar, so a run that did not learn can be read
    afterwards (these runs are not bitwise repeatable)."""
    rows = [r for r in metrics(run_dir) if r["step"] % every == 0]
    return "\n".join(f"step {r['step']:4d} reward {r['reward_mean']:.3f} entropy {r['entropy']:.3f} "
                     f"staleness {r['staleness_mean']:.2f} t {r['time_s']:.0f}s" for r in rows)


def wait_pid_exit(pid: int, timeout: float) -> bool:
    """Block until process `pid` (any process, not only a child) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def end_actor(ap: Proc, sig: int, timeout: float = 30) -> tuple[list[str], list[str]]:
    """Send signal `sig` to actor `ap` and wait until it and every process it had started
    (engine processes, the keeper of its scratch directory) have exited. Returns the names of
    those processes, and of those still running after `timeout` seconds."""
    import psutil

    kids = {k.pid: k.name() for k in psutil.Process(ap.p.pid).children(recursive=True)}
    kids |= {k.pid: "keeper" for k in psutil.process_iter(["cmdline"])  # no descendant of it
             if (k.info["cmdline"] or [])[-3:-1] == ["actors.scratch", str(ap.p.pid)]}
    ap.p.send_signal(sig)
    ap.p.wait(timeout=timeout)
    return list(kids.values()), [name for pid, name in kids.items()
                                 if not wait_pid_exit(pid, timeout)]
