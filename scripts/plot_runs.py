"""Render PNGs for one or more run directories (several runs are overlaid).

    .venv/bin/python scripts/plot_runs.py runs/toy_reverse [runs/other ...] --out runs/plots

Writes reward_vs_step.png, reward_vs_time.png, staleness_hist.png, is_weights.png,
throughput.png from each run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def load(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def smooth(y: list[float], k: int = 10) -> np.ndarray:
    y = np.asarray(y, dtype=float)
    if len(y) < k:
        return y
    return np.convolve(y, np.ones(k) / k, mode="valid")


def line_plot(runs: dict[str, list[dict]], x: str, ys: list[str], title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in runs.items():
        for y in ys:
            vals = smooth([r[y] for r in rows])
            xs = [r[x] for r in rows][len(rows) - len(vals):]
            ax.plot(xs, vals, label=f"{name}: {y}" if len(ys) > 1 or len(runs) > 1 else y)
    ax.set_xlabel(x)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def staleness_hist(runs: dict[str, list[dict]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(runs)
    most = 0
    for i, (name, rows) in enumerate(runs.items()):
        keys = sorted({k for r in rows for k in r if k.startswith("staleness_hist_")},
                      key=lambda k: int(k.rsplit("_", 1)[1]))
        counts = [sum(r.get(k, 0) for r in rows) for k in keys]
        total = max(sum(counts), 1)
        offset = (i - (len(runs) - 1) / 2) * width
        ax.bar(np.arange(len(keys)) + offset, [c / total for c in counts], width, label=name)
        most = max(most, len(keys))
    ax.set_xticks(range(most))
    ax.set_xlabel("token staleness (versions behind the learner)")
    ax.set_ylabel("fraction of trained tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("runs/plots"))
    ns = p.parse_args()
    runs = {r.name: load(r) for r in ns.runs}
    ns.out.mkdir(parents=True, exist_ok=True)
    line_plot(runs, "step", ["reward_mean"], "train reward vs step", ns.out / "reward_vs_step.png")
    line_plot(runs, "time_s", ["reward_mean"], "train reward vs wall time (s)", ns.out / "reward_vs_time.png")
    staleness_hist(runs, ns.out / "staleness_hist.png")
    line_plot(runs, "step", ["is_weight_mean", "is_weight_max", "is_truncated_frac"],
              "importance weights", ns.out / "is_weights.png")
    line_plot(runs, "step", ["tokens_per_s"], "trained tokens per second", ns.out / "throughput.png")
    print(f"wrote 5 plots to {ns.out}")


if __name__ == "__main__":
    main()
