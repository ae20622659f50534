"""CPU seconds of running processes over time windows, from /proc (robust to other jobs on the
machine, unlike wall times).

    s = CpuSampler({"relay": [pid, ...], "actor": [...]}); s.start()
    ... run ...
    s.stop(); s.between(t0, t1)  # {"relay": {"zmq_io": 0.4, "python": 1.1}, ...}

A thread reads every process's threads (/proc/PID/task/TID/stat: utime + stime, in clock
ticks) every `period_s` and keeps (time.time(), totals); a window's CPU is interpolated
between the samples around its ends. Threads are grouped by what they do: "zmq_io" (libzmq's
I/O threads: receiving and sending frames, i.e. the kernel's socket copies) and "python"
(the interpreter's threads, asyncio.to_thread workers included: decoding, hashing, copies);
"sys" is the kernel's share of both, "minor_faults" a count (pages first touched). Kind
"machine": the whole machine's busy CPU (other jobs included), its softirq share, and its
allocations that stalled to reclaim or compact memory.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import defaultdict

TICK = os.sysconf("SC_CLK_TCK")


def _group(comm: str) -> str:
    return "zmq_io" if comm.startswith("ZMQbg") else "python"


def read(pid: int) -> dict[str, float]:
    """CPU seconds of `pid`'s live threads by group (exited threads are not counted)."""
    out: dict[str, float] = defaultdict(float)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                raw = f.read()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[_group(comm)] += (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
        out["sys"] += int(fields[12]) / TICK
        out["minor_faults"] += int(fields[7])
    return out


def machine() -> dict[str, float]:
    """The whole machine's busy CPU seconds (every process, kernel threads and interrupts
    included: all but idle and iowait), and of those in softirq (network processing); counts
    of allocations that stalled to reclaim or compact memory (/proc/vmstat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    out = {"busy": (sum(v[:8]) - v[3] - v[4]) / TICK, "softirq": v[6] / TICK,
           "reclaim_stalls": 0.0, "compact_stalls": 0.0}
    with open("/proc/vmstat") as f:
        for line in f:
            name, n = line.split()
            if name.startswith("allocstall_"):
                out["reclaim_stalls"] += int(n)
            elif name == "compact_stall":
                out["compact_stalls"] += int(n)
    return out


class CpuSampler:
    def __init__(self, pids: dict[str, list[int]], period_s: float = 0.05) -> None:
        """`pids`: process kind -> pids (may grow while sampling: `add`)."""
        self.pids = {k: list(v) for k, v in pids.items()}
        self.period_s = period_s
        self.times: list[float] = []
        self.samples: list[dict[tuple[str, str], float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lock = threading.Lock()

    def add(self, kind: str, pid: int) -> None:
        with self._lock:
            self.pids.setdefault(kind, []).append(pid)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):  # the sampling period, not synchronisation
            tot: dict[tuple[str, str], float] = defaultdict(float)
            with self._lock:
                pids = [(k, p) for k, ps in self.pids.items() for p in ps]
            for kind, pid in pids:
                for group, s in read(pid).items():
                    tot[(kind, group)] += s
            for group, s in machine().items():
                tot[("machine", group)] = s
            self.times.append(time.time())
            self.samples.append(tot)

    def _at(self, t: float) -> dict[tuple[str, str], float]:
        i = bisect.bisect_left(self.times, t)
        if i == 0 or i == len(self.times):
            return self.samples[min(i, len(self.times) - 1)]
        t0, t1 = self.times[i - 1], self.times[i]
        a, b = self.samples[i - 1], self.samples[i]
        w = (t - t0) / (t1 - t0)
        return {k: a.get(k, 0.0) + w * (b.get(k, 0.0) - a.get(k, 0.0)) for k in set(a) | set(b)}

    def between(self, t0: float, t1: float) -> dict[str, dict[str, float]]:
        """CPU seconds from t0 to t1 by kind and thread group."""
        a, b = self._at(t0), self._at(t1)
        out: dict[str, dict[str, float]] = defaultdict(dict)
        for (kind, group) in sorted(set(a) | set(b)):
            out[kind][group] = round(b.get((kind, group), 0.0) - a.get((kind, group), 0.0), 3)
        return dict(out)
