"""Weight fan-out across network hosts: the learner's egress per version and the time until
every actor has loaded a new version, with and without relays.

    flock /work/coord/bigmem.lock .venv/bin/python lab/weight_fanout.py     # root; iproute2

Hosts are network namespaces on this machine, wired to one bridge (a "switch" namespace):

    learner ns 10.233.0.1 ──veth──┐
    host 1  ns 10.233.0.2 ──veth──┤ bridge (switch ns)      each host: its actors (and its relay)
    ...                           │
    host 4  ns 10.233.0.5 ──veth──┘

The learner is the real one (`python -m learner`) training SmolLM2-135M-Instruct with
model.dtype=bfloat16 (tiny steps: 2 prompts x 2 samples, a 2-prompt evaluation); the actors
run the simulated engine (named fake: random tokens, weights received, checked and dropped), so
the figures are the weight path's. Learner egress = tx_bytes of the learner's veth over the run
(all its traffic: weights, leases, acks) / versions that actors loaded (the last one published
may go unfetched when the run ends). Shaped runs put a 1 Gbit/s token
bucket (tc tbf) on both ends of every host's link. "Time to all loaded" for version v = the
latest actor's "loaded weights v" log time - the learner's "published v" log time (one clock).
CPU seconds per version (`cpu_s_per_version`, robust to other jobs on the machine, unlike the
times): each process kind's CPU (lab/proc_cpu.py: libzmq's I/O threads and the interpreter's
threads apart) from "published v" to the last "loaded weights v", summed over its processes
and averaged over v2 on (v1, the first after the initial weights, is apart in
`cpu_s_by_version`, with every version's).
Writes lab/results/weight_fanout.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import procs  # noqa: E402
from proc_cpu import CpuSampler  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
MODEL = ROOT / "runs" / "models" / "smollm2-135m-instruct"
NET = "10.233.0"


def sh(*args: str) -> str:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


class Hosts:
    """A learner namespace and `n` actor-host namespaces on one bridge."""

    def __init__(self, n: int, shape: str | None) -> None:
        tag = f"wf{os.getpid() % 10000}"
        self.switch = f"{tag}s"
        self.names = [f"{tag}l"] + [f"{tag}h{i}" for i in range(1, n + 1)]
        self.ips = [f"{NET}.{i + 1}" for i in range(n + 1)]
        self.veths = [f"{tag}v{i}" for i in range(n + 1)]
        self.procs: list[procs.Proc] = []
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for ns, ip, veth in zip(self.names, self.ips, self.veths):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "netns", ns, "type", "veth", "peer", "name",
               veth + "p", "netns", self.switch)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", veth, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", self.switch, "link", "set", veth + "p", "master", "br0")
            sh("ip", "-n", self.switch, "link", "set", veth + "p", "up")
            if shape:
                for where, dev in ((ns, veth), (self.switch, veth + "p")):
                    sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                       "tbf", "rate", shape, "burst", "512kb", "latency", "200ms")

    def tx_bytes(self, i: int) -> int:
        return int(sh("ip", "netns", "exec", self.names[i], "cat",
                      f"/sys/class/net/{self.veths[i]}/statistics/tx_bytes"))

    def start(self, i: int, args: list[str], log: Path) -> procs.Proc:
        p = procs.Proc(args, log, prefix=("ip", "netns", "exec", self.names[i]), python=PY)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for ns in (*self.names, self.switch):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                      text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _stamp(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def scenario(name: str, via: str, actors: int, hosts: int, shape: str | None, steps: int,
             out_dir: Path, preset: Path, model: Path) -> dict:
    run = out_dir / name
    h = Hosts(hosts, shape)
    cpu = CpuSampler({})
    try:
        lp = h.start(0, ["-m", "learner", "-c", str(preset),
                         f"run_dir={run}", f"model.path={model}", "model.dtype=bfloat16",
                         "actors.num_local=0", f"transport.host={h.ips[0]}",
                         f"transport.weights_via={via}", f"learner.max_steps={steps}",
                         "learner.prompts_per_step=2", "learner.group_size=2",
                         "task.eval_prompts=2", "task.max_new_tokens=8",
                         "max_staleness=0", "transport.peer_timeout_s=120"],
                     out_dir / f"{name}-learner.log")
        cpu.add("learner", lp.p.pid)  # (ip netns exec execs python: the same pid)
        cpu.start()
        lp.wait_for(r"learner listening", timeout=900)
        tx0 = h.tx_bytes(0)
        if via == "relay":
            for i in range(1, hosts + 1):
                r = h.start(i, ["-m", "transport.weightsrc.relay", "-c", str(run / "config.yaml"),
                                str(run / "endpoints.json"), "--relay-id", f"r{i}", "--bind",
                                h.ips[i], "--advertise", h.ips[i]],
                            out_dir / f"{name}-r{i}.log")
                cpu.add("relay", r.p.pid)
                r.wait_for(r"serving at", timeout=120)
        ac = []
        for a in range(actors):
            i = 1 + a % hosts
            ac.append(h.start(i, ["-m", "actors", "-c", str(run / "config.yaml"), "--actor-id",
                                  f"a{a}", str(run / "endpoints.json"),
                                  "actors.engine=simulated", "--host", h.ips[i]],
                              out_dir / f"{name}-a{a}.log"))
            cpu.add("actor", ac[-1].p.pid)
        rc = lp.finish(timeout=3600)
        tx = h.tx_bytes(0) - tx0
    finally:
        cpu.stop()
        h.close()
    summary = json.loads((run / "summary.json").read_text())
    published = {int(m.group(1)): _stamp(line) for line in lp.lines
                 if (m := re.search(r"published v(\d+) ", line))}
    full = [float(m.group(1)) * 1e6 for line in lp.lines
            if (m := re.search(r"published v\d+ \(full\): \d+ buckets, ([\d.]+) MB", line))][0]
    loaded: dict[int, list[float]] = {}
    for p in ac:
        for line in p.lines:
            if m := re.search(r"loaded weights v(\d+)", line):
                loaded.setdefault(int(m.group(1)), []).append(_stamp(line))
    # versions after the first that every actor loaded: time from publish to the last load
    times = {v: max(ts) - published[v] for v, ts in loaded.items()
             if v > 0 and len(ts) == actors and v in published}
    by_version = {v: cpu.between(published[v], published[v] + t) for v, t in times.items()}
    per_version: dict[str, dict[str, float]] = {}
    for v, kinds in by_version.items():
        if v == 1 and len(by_version) > 1:
            continue
        for kind, groups in kinds.items():
            for g, s in groups.items():
                per_version.setdefault(kind, {}).setdefault(g, 0.0)
                per_version[kind][g] += s / (len(by_version) - (len(by_version) > 1))
    return {"weights_via": via, "actors": actors, "hosts": hosts, "shape": shape,
            "learner_rc": rc, "versions_published": len(published),
            "model_bf16_bytes": full, "learner_tx_bytes": tx,
            "versions_loaded": len(loaded),
            "learner_tx_per_version_over_model": tx / len(loaded) / full,
            "weights_sent_bytes_app": summary.get("weights_sent_bytes"),
            "accounting_ok": summary["accounting_ok"],
            "time_to_all_loaded_s": times,
            "mean_time_to_all_loaded_s": sum(times.values()) / max(len(times), 1),
            "cpu_s_per_version": {k: {g: round(s, 3) for g, s in gs.items()}
                                  for k, gs in per_version.items()},
            "cpu_s_by_version": by_version}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", nargs="*", default=["egress", "shaped"])
    p.add_argument("--out", default=str(ROOT / "lab" / "results" / "weight_fanout.json"))
    p.add_argument("--preset", default=str(ROOT / "configs" / "smollm2_add.yaml"))
    p.add_argument("--model", default=str(MODEL), help="(a tiny model + its preset: a smoke run)")
    p.add_argument("--keep", action="store_true",
                   help="keep the runs' directories (logs, checkpoints: ~4 GB a run) in /tmp")
    ns = p.parse_args()
    work = Path("/tmp") / f"weight_fanout_{os.getpid()}"
    work.mkdir(parents=True)
    res: dict = {"model": Path(ns.model).name, "dtype": "bfloat16", "steps": ns.steps,
                 "machine": f"{os.cpu_count()} cores, shared", "runs": {}}
    groups = {"egress": [("egress_zmq_8", "zmq", 8, 1, None), ("egress_relay_8", "relay", 8, 4, None)],
              "shaped": [("shaped_relay_1", "relay", 1, 4, "1gbit"),
                         ("shaped_relay_8", "relay", 8, 4, "1gbit"),
                         ("shaped_zmq_8", "zmq", 8, 4, "1gbit")]}
    # --only names groups or single runs (e.g. shaped_relay_1 shaped_relay_8)
    plan = [run for g, runs in groups.items() for run in runs if g in ns.only or run[0] in ns.only]
    try:
        for name, via, actors, hosts, shape in plan:
            print(f"--- {name}", flush=True)
            res["runs"][name] = scenario(name, via, actors, hosts, shape, ns.steps, work,
                                         Path(ns.preset), Path(ns.model))
            print(json.dumps(res["runs"][name]), flush=True)
            Path(ns.out).write_text(json.dumps(res, indent=1))
    finally:
        if not ns.keep:
            shutil.rmtree(work, ignore_errors=True)
    r = res["runs"]
    if "egress_relay_8" in r:
        res["egress_per_version_over_bf16_relay_8"] = r["egress_relay_8"]["learner_tx_per_version_over_model"]
        res["egress_target"] = 2.5
    if "shaped_relay_8" in r and "shaped_relay_1" in r:
        res["shaped_8_over_1"] = (r["shaped_relay_8"]["mean_time_to_all_loaded_s"]
                                  / r["shaped_relay_1"]["mean_time_to_all_loaded_s"])
        res["shaped_target"] = 2.0
    Path(ns.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
