"""A real one-node Slurm cluster started by a test: munged, slurmctld and slurmd (Debian's
slurm-wlm), each with its own key, socket, state and spool directories under one temporary
directory and free ports on 127.0.0.1, so nothing of the machine's own set-up is used or
changed. `Cluster.start` raises `Unavailable` with the reason when it cannot run here.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class Unavailable(RuntimeError):
    """Slurm cannot be started here."""


def free_ports(n: int) -> int:
    """A base port such that base .. base+n-1 are free on 127.0.0.1 right now, below the
    kernel's ephemeral range: a port in that range can be taken between this check and the
    learner's bind by any connection's source port (seen with the test lanes running at once:
    the sbatch learner's port was in use, its actor reached another process)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random(os.getpid())
    for _ in range(200):
        base = rng.randrange(10000, low - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


def until(cond, timeout: float, what: str, interval: float = 0.2,
          explain: Callable[[], str] = str):
    """Poll `cond()` until it returns something truthy (returned); fail after `timeout`,
    adding `explain()` (say, the job's output) to the message."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{explain()}")
        time.sleep(interval)  # a poll interval with a deadline, not synchronisation


CONF = """\
ClusterName=tether
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.node = socket.gethostname().split(".")[0]
        self.conf = directory / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: list[subprocess.Popen] = []

    @classmethod
    def start(cls, directory: Path) -> Cluster:
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            raise Unavailable(f"{', '.join(missing)} not installed (scripts/env_slurm.sh "
                              "installs slurm-wlm and munge with apt-get)")
        if os.geteuid() != 0:
            raise Unavailable(f"slurmd runs jobs as root here and needs root (euid {os.geteuid()})")
        c = cls(directory)
        try:
            c._start()
        except BaseException:
            c.stop()
            raise
        return c

    def _start(self) -> None:
        d = self.dir
        d.chmod(0o700)
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        base = free_ports(2)
        self.conf.write_text(CONF.format(node=self.node, ctld_port=base, slurmd_port=base + 1,
                                         d=d, cpus=os.cpu_count()))
        self._daemon(["munged", "-F", "-f", f"--socket={d}/munge.sock", f"--key-file={key}",
                      f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed",
                      f"--log-file={d}/munged.log"], "munged")
        until(lambda: (d / "munge.sock").exists(), 20, "munged's socket")
        self._daemon(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        self._daemon(["slurmd", "-D", "-f", str(self.conf), "-N", self.node], "slurmd")
        until(lambda: self._node_state() in ("idle", "mixed"), 60,
              f"node {self.node} idle (see {d}/slurmctld.log, {d}/slurmd.log)")

    def _daemon(self, args: list[str], name: str) -> None:
        out = open(self.dir / f"{name}.out", "wb")
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        out.close()
        self.daemons.append(p)

    def _node_state(self) -> str:
        for p in self.daemons:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[0]} exited with {p.returncode}: "
                                     f"{(self.dir / (p.args[0] + '.out')).read_text()[-2000:]}")
        r = self.run("sinfo", "-h", "-o", "%t", check=False)
        return r.stdout.strip()

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r

    def submit(self, *args: str, env: dict[str, str]) -> str:
        """sbatch ARGS with extra environment `env`; returns the job id."""
        r = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                           env={**self.env, **env}, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, job_id: str, timeout: float) -> dict[str, str]:
        """Block until the job reaches a terminal state; returns its scontrol record."""
        return until(lambda: (j := self.job(job_id))["JobState"] in TERMINAL and j, timeout,
                     f"job {job_id} to end", interval=0.5)

    def stop(self) -> None:
        """Cancel what is still running, then stop the daemons (munged last)."""
        if self.conf.exists() and any(p.poll() is None for p in self.daemons):
            self.run("scancel", "--full", "--signal=KILL", "-u", "root", check=False)
        for p in reversed(self.daemons):
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.daemons.clear()
