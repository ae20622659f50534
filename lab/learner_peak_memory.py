"""The learner process's peak memory (VmHWM, MiB) over a short run of a preset, with its actors
in their own processes (issue #40: the learner no longer holds an evaluation copy of the policy).

    python lab/learner_peak_memory.py --root TREE --out lab/results/X.json -- -c PRESET key=value...

Runs `python -m learner`'s main in this process, from the Tether tree TREE (so the same script
measures an older commit's tree too), and reads this process's VmHWM from /proc/self/status at
the end. Writes one JSON: the tree's commit, the arguments, VmHWM and VmRSS, the summary's
evaluation figures and steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("learner_args", nargs="+")
    ns = p.parse_args()
    root = ns.root.resolve()
    sys.path.insert(0, str(root))
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or root.name
    from learner.__main__ import main as learner_main

    t0 = time.monotonic()
    code = learner_main(ns.learner_args)
    wall = time.monotonic() - t0
    from configs.loader import load_config

    cfg_args = ns.learner_args
    cfg = load_config(cfg_args[cfg_args.index("-c") + 1],
                      [a for a in cfg_args if "=" in a])
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    out = {"tree": str(root), "commit": commit, "args": ns.learner_args, "exit_code": code,
           "learner_vmhwm_mib": round(status_mib("VmHWM"), 1),
           "learner_vmrss_end_mib": round(status_mib("VmRSS"), 1), "wall_s": round(wall, 1),
           "steps": summary["steps"], "eval_reward_start": summary["eval_reward_start"],
           "eval_reward_end": summary["eval_reward_end"]}
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return code


if __name__ == "__main__":
    sys.exit(main())
