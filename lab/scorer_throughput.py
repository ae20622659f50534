"""Classifier scorer throughput (samples/s), batching on vs off, measured in one run.

    .venv/bin/python lab/scorer_throughput.py [--samples 512] [--batch 32]

Builds the tests' tiny seven-classifier (tests/scorer_models.py: Qwen2ForSequenceClassification,
1 layer, hidden 128, the toy task's word-level tokenizer), then scores the same `--samples`
reversal-task samples (prompt of 7 tokens + a completion of 1-4 digits) with the scorer's own
code path (tasks/scorers/classifier.py `Classifier.score`: render, tokenize, pad, one forward
pass per batch) in batches of `--batch` and of 1, alternating three rounds each, one torch
thread. Writes lab/results/scorer_throughput.json with the best round of each, the model's
parameter count, the load average and the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args()
    import numpy as np
    import torch

    from configs.scorers import ClassifierScorer
    from scorer_models import build_seven_classifier, seven_examples
    from tasks.scorers.base import Item
    from tasks.scorers.classifier import Classifier

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        acc = build_seven_classifier(Path(tmp) / "rm", steps=80)
        clf = Classifier(ClassifierScorer(name="seven", path=str(Path(tmp) / "rm"),
                                          output="has7"))
        texts, _ = seven_examples(np.random.default_rng(7), ns.samples)
        items = [Item(t[: t.index("=") + 1], t[t.index("=") + 2:], None, {}, [], [])
                 for t in texts]

        async def rate(batch: int) -> float:
            t0 = time.perf_counter()
            for lo in range(0, len(items), batch):
                await clf.score(items[lo:lo + batch])
            return len(items) / (time.perf_counter() - t0)

        best = {ns.batch: 0.0, 1: 0.0}
        for _ in range(ns.rounds):
            for b in best:
                best[b] = max(best[b], asyncio.run(rate(b)))
        params = sum(x.numel() for x in clf.model.parameters())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    row = {"benchmark": "classifier scorer throughput", "commit": commit,
           "model": f"seven-classifier (Qwen2ForSequenceClassification, {params} params, "
                    f"held-out accuracy {acc:.3f})",
           "samples": ns.samples, "tokens_per_sample": "8-11", "torch_threads": 1,
           "samples_per_s_batched": round(best[ns.batch], 1), "batch_size": ns.batch,
           "samples_per_s_unbatched": round(best[1], 1),
           "speedup": round(best[ns.batch] / best[1], 2), "rounds": ns.rounds,
           "load_average_1m": os.getloadavg()[0]}
    out = ROOT / "lab" / "results" / "scorer_throughput.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
