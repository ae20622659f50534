"""Two network hosts on one machine: two network namespaces joined by a veth pair.

    namespace tth<id>a (learner)                    namespace tth<id>b (actors)
      tth<id>va  10.231.0.1/24  <═══ veth pair ═══>  tth<id>vb  10.231.0.2/24
      lo down                                         lo down

The two addresses exist only inside these namespaces, nothing is routed anywhere else, and
the loopback interfaces stay down, so a process that dialled 127.0.0.1 would fail at once.
`partition()` takes the link down (both directions: a veth end without its peer has no
carrier) and brings it back. Needs root (CAP_NET_ADMIN); `TwoHosts.create` raises
`Unavailable` with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time

import procs

LEARNER_IP = "10.231.0.1"
ACTOR_IP = "10.231.0.2"
_ids = itertools.count()


class Unavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no `ip`, no netns support)."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")


class TwoHosts:
    def __init__(self, tag: str) -> None:
        self.a, self.b = f"{tag}a", f"{tag}b"
        self.veth_a, self.veth_b = f"{tag}va", f"{tag}vb"
        self.made: list[str] = []
        self.procs: list[procs.Proc] = []

    @classmethod
    def create(cls) -> TwoHosts:
        if os.geteuid() != 0:
            raise Unavailable(f"network namespaces need root (euid is {os.geteuid()})")
        if shutil.which("ip") is None:
            raise Unavailable("the `ip` command (iproute2) is not installed")
        hosts = cls(f"tth{os.getpid() % 100000}{next(_ids)}")
        r = subprocess.run(["ip", "netns", "add", hosts.a], capture_output=True, text=True)
        if r.returncode != 0:
            raise Unavailable(f"`ip netns add` failed: {r.stderr.strip()}")
        hosts.made.append(hosts.a)
        try:
            hosts._wire()
        except BaseException:
            hosts.close()
            raise
        return hosts

    def _wire(self) -> None:
        _ip("netns", "add", self.b)
        self.made.append(self.b)
        _ip("link", "add", self.veth_a, "netns", self.a, "type", "veth",
            "peer", "name", self.veth_b, "netns", self.b)
        _ip("-n", self.a, "addr", "add", f"{LEARNER_IP}/24", "dev", self.veth_a)
        _ip("-n", self.b, "addr", "add", f"{ACTOR_IP}/24", "dev", self.veth_b)
        self.link(up=True)

    def start(self, ns: str, args: list[str], log_path) -> procs.Proc:
        """`python ARGS` inside namespace `ns` (killed by `close`)."""
        p = procs.Proc(args, log_path, prefix=("ip", "netns", "exec", ns))
        self.procs.append(p)
        return p

    def link(self, up: bool) -> None:
        state = "up" if up else "down"
        _ip("-n", self.a, "link", "set", self.veth_a, state)
        _ip("-n", self.b, "link", "set", self.veth_b, state)

    @contextlib.contextmanager
    def partition(self):
        """Link down inside the block, up again after it (also when the block fails); yields a
        dict with "since" (monotonic time the link went down) and, on exit, "seconds" (how
        long it was down)."""
        self.link(up=False)
        held = {"since": time.monotonic()}
        try:
            yield held
        finally:
            self.link(up=True)
            held["seconds"] = time.monotonic() - held["since"]

    def close(self) -> None:
        """Kill what we started in the namespaces, then delete them (the veth pair goes with
        them). Safe to call twice."""
        for p in self.procs:
            p.kill()
        for ns in self.made:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():  # children of ours (e.g. a torch worker) still inside
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()
