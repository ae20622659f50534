"""Lossless weight deltas on the SmolLM2 preset in bf16: how many bf16 elements change per
optimizer step, and how many bytes the XOR + zstd delta of a version takes against the full
bf16 version (target: <= 25 % on average over 20 steps). Also: what publishing costs the trainer
thread (gather + cast + queue) against what the packer thread does beside it.

    .venv/bin/python -m models.fetch smollm2-135m-instruct      # once
    flock /work/coord/bigmem.lock .venv/bin/python lab/weight_deltas.py [--steps 20]

The steps are real AdamW steps of the learner's backend at the preset's learning rate
(configs/smollm2_add.yaml: lr 2e-5) on a REINFORCE-style loss: the additions task's prompts
with random completions and random +-1 advantages, 16 sequences of 48 tokens per step (the
update's size is set by AdamW's normalisation and the lr, not by the data). Writes
lab/results/weight_deltas.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "lab" / "results" / "weight_deltas.json"))
    ns = p.parse_args()

    import torch

    from configs.loader import load_config
    from learner.backends.single import SingleProcessBackend
    from learner.publisher import Publisher
    from transport.weightsrc import delta

    torch.set_num_threads(2)
    cfg = load_config(ROOT / "configs" / "smollm2_add.yaml",
                      [f"model.path={ROOT / 'runs/models/smollm2-135m-instruct'}",
                       "model.dtype=bfloat16"])
    L = cfg.learner
    backend = SingleProcessBackend(Path(cfg.model.path), L.lr, L.weight_decay, L.seed,
                                   dtype=torch.bfloat16)
    vocab = backend.model.config.vocab_size
    published: deque = deque(maxlen=2)  # the previous version and the new one
    pub = Publisher(cfg.transport.weight_bucket_bytes, full_every=10**9,
                    deliver=published.append)
    g = torch.Generator().manual_seed(0)
    rows = []
    t0 = time.perf_counter()
    pub.publish(0, backend.named_full_tensors(), dtype=torch.bfloat16)
    first_publish_s = time.perf_counter() - t0
    pub.wait()
    for step in range(1, ns.steps + 1):
        ids = torch.randint(0, vocab, (16, 48), generator=g)
        adv = torch.randint(0, 2, (16, 1), generator=g).float() * 2 - 1
        lp = backend.logprobs(ids, 1.0)
        loss = -(adv * lp).mean()
        backend.step(loss, L.max_grad_norm)
        t1 = time.perf_counter()
        pub.publish(step, backend.named_full_tensors(), dtype=torch.bfloat16)
        trainer_s = time.perf_counter() - t1
        new = pub.wait()
        packer_s = time.perf_counter() - t1
        full = new.full.manifest.total_bytes
        rows.append({"step": step, "full_bf16_bytes": full,
                     "delta_bytes": new.delta.manifest.total_bytes,
                     "delta_over_full": new.delta.manifest.total_bytes / full,
                     "changed_bf16_fraction": delta.changed_fraction(new.full, published[-2].full),
                     "trainer_publish_s": round(trainer_s, 3),
                     "publish_to_announce_s": round(packer_s, 3)})
        print(json.dumps(rows[-1]), flush=True)
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    out = {
        "model": "SmolLM2-135M-Instruct", "engine_dtype": "bfloat16", "steps": ns.steps,
        "lr": L.lr, "weight_decay": L.weight_decay, "batch": "16 x 48 tokens",
        "bucket_bytes": cfg.transport.weight_bucket_bytes, "codec": "xor-zstd level 1",
        "full_bf16_bytes": rows[-1]["full_bf16_bytes"],
        "mean_delta_bytes": mean("delta_bytes"),
        "mean_delta_over_full": mean("delta_over_full"),
        "mean_changed_bf16_fraction": mean("changed_bf16_fraction"),
        "target_delta_over_full": 0.25,
        "met": mean("delta_over_full") <= 0.25,
        "mean_trainer_publish_s": mean("trainer_publish_s"),
        "mean_publish_to_announce_s": mean("publish_to_announce_s"),
        "first_publish_trainer_s": round(first_publish_s, 3),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rows": rows,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
