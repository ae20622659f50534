"""Load test: N simulated actors (real protocol, no model) against a real learner process.

    .venv/bin/python lab/load_test.py --actors 64 --seconds 60 --out runs/load

The actors run as asyncio tasks in this one process (each with its own sockets and identity).
Reports learner memory over time, throughput and the accounting check; writes load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def steps_done(run_dir: Path) -> int:
    """Steps the learner has finished: metrics.jsonl has one flushed line per step."""
    path = run_dir / "metrics.jsonl"
    return sum(1 for _ in path.open()) if path.exists() else 0


async def drive(cfg, endpoint: str, n: int, seconds: float, learner: subprocess.Popen,
                min_steps: int = 0, max_seconds: float = 300.0) -> dict:
    """Run `n` simulated actors for `seconds`, and on until the learner finished `min_steps`
    (a slow machine gets the same traffic, not a shorter run; at most `max_seconds`)."""
    from actors.actor import Actor

    actors = [Actor(cfg, endpoint, f"sim-{i}", Path(cfg.run_dir) / "sim_cache") for i in range(n)]
    tasks = [asyncio.create_task(a.run()) for a in actors]
    samples = []
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(1.0)  # sampling period of the memory probe
        elapsed = time.monotonic() - t0
        samples.append((round(elapsed, 1), rss_mb(learner.pid), rss_mb(os.getpid())))
        if elapsed >= seconds and (steps_done(Path(cfg.run_dir)) >= min_steps
                                   or elapsed >= max_seconds):
            break
    learner.send_signal(signal.SIGTERM)  # checkpoint, Shutdown to every actor
    codes = await asyncio.gather(*tasks)
    return {"memory": samples, "actor_exit_codes": sorted(set(codes)),
            "groups_generated": sum(a.groups_done for a in actors)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actors", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--min-steps", type=int, default=0,
                   help="go on past --seconds until the learner finished this many steps")
    p.add_argument("--out", default="runs/load")
    p.add_argument("overrides", nargs="*")
    ns = p.parse_args()
    from configs.loader import load_config

    out = Path(ns.out)
    overrides = [f"run_dir={out}", "actors.num_local=0", "actors.engine=simulated",
                 "learner.max_steps=1000000", "learner.log_every=100", "learner.checkpoint_every=0",
                 "transport.peer_timeout_s=30", *ns.overrides]
    cfg = load_config(ROOT / "configs" / "toy_reverse.yaml", overrides)
    out.mkdir(parents=True, exist_ok=True)
    (out / "endpoints.json").unlink(missing_ok=True)
    log = open(out / "learner.log", "w")
    learner = subprocess.Popen([sys.executable, "-m", "learner", "-c", str(ROOT / "configs" / "toy_reverse.yaml"),
                                *overrides], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    while not (out / "endpoints.json").exists():  # the learner writes it once its sockets are bound
        assert learner.poll() is None, "learner exited; see learner.log"
        time.sleep(0.2)
    endpoint = json.loads((out / "endpoints.json").read_text())["control"]
    t0 = time.monotonic()
    result = asyncio.run(drive(cfg, endpoint, ns.actors, ns.seconds, learner, ns.min_steps))
    seconds = time.monotonic() - t0
    learner.wait(timeout=120)
    summary = json.loads((out / "summary.json").read_text())
    mem = result["memory"]
    report = {
        "actors": ns.actors, "seconds": round(seconds, 1), "steps": summary["steps"],
        "steps_per_s": summary["steps"] / seconds,
        "groups_consumed": summary["groups"]["consumed"],
        "groups_generated": result["groups_generated"],
        "accounting_ok": summary["accounting_ok"], "groups": summary["groups"],
        "rejected_messages": summary["rejected_messages"],
        "learner_rss_mb_first_last_max": [mem[0][1], mem[-1][1], max(m[1] for m in mem)],
        "actors_process_rss_mb_first_last_max": [mem[0][2], mem[-1][2], max(m[2] for m in mem)],
        "actor_exit_codes": result["actor_exit_codes"], "memory_samples": mem,
    }
    (out / "load.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "memory_samples"}, indent=1))


if __name__ == "__main__":
    main()
