"""Run under torchrun (one rank) by tests/test_gpu.py: FSDP2 on DEVICE vs the single-process
backend on DEVICE, same batches (tests/fsdp_worker.py's), weights compared after each step.

    torchrun --standalone --nproc_per_node 1 tests/gpu_fsdp_worker.py OUT MODEL_DIR cuda

Writes OUT/fsdp_vs_single.json: process group backend, device, the largest weight difference,
and how far the weights moved from the start.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fsdp_worker
from configs.schema import FSDP2BackendConfig
from learner import distributed
from learner.backends.registry import make_backend
from learner.backends.single import SingleProcessBackend
from learner.algo.trainer import Trainer


def main() -> None:
    out, model_dir, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    ranks = distributed.start(FSDP2BackendConfig(), device)
    cfg = fsdp_worker.config(model_dir)
    L = cfg.learner
    fsdp = make_backend(FSDP2BackendConfig(), model_dir, L.lr, L.weight_decay, L.seed, ranks.device)
    single = SingleProcessBackend(model_dir, L.lr, L.weight_decay, L.seed, ranks.device)
    start = {k: v.detach().clone() for k, v in single.named_full_tensors()}
    trainers = [Trainer(cfg, fsdp, pad_id=0), Trainer(cfg, single, pad_id=0)]
    worst = 0.0
    for step in range(fsdp_worker.STEPS):
        for t in trainers:
            t.step(fsdp_worker.synthetic_groups(cfg, step), step)
        a, b = dict(fsdp.named_full_tensors()), dict(single.named_full_tensors())
        worst = max(worst, max((a[k] - b[k]).abs().max().item() for k in b))
    moved = max((b[k] - start[k]).abs().max().item() for k in b)
    (out / "fsdp_vs_single.json").write_text(json.dumps({
        "process_group": dist.get_backend(), "device": str(ranks.device),
        "max_weight_diff": worst, "moved": moved, "steps": fsdp_worker.STEPS}))
    distributed.close(ranks)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
    distributed.exit_rank(0)  # gloo's threads race interpreter finalization (learner/distributed.py)
