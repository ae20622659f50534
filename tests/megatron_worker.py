"""Run under torchrun by tests/test_megatron.py: the Megatron backend + Trainer on the fixed batch
sequence of tests/fsdp_worker.py (the same batches the single-process reference trains on).

    torchrun --standalone --nproc_per_node N tests/megatron_worker.py train  OUT MODEL_DIR TPxPP ...
    torchrun --standalone --nproc_per_node N tests/megatron_worker.py resume OUT MODEL_DIR TPxPP ...

Each layout TPxPP (e.g. 2x1, 1x2) runs in turn in the same process group (Megatron's model-parallel
groups are rebuilt for each) and writes to OUT/TPxPP:
train:  (1) for each loss aggregation, one step with clipping off on batch 0: the loss metrics
        and the full gradients (HF names) go to OUT/grads_{agg}.*; (2) STEPS steps on batches
        0..STEPS-1, a DCP checkpoint after step CKPT_AT, the published weights after every step,
        an HF export to OUT/hf, the dtypes of rank 0's parameters and AdamW state.
resume: a fresh process group loads OUT/ckpt and trains batches CKPT_AT..STEPS-1.
Arguments K=V among the layouts: config overrides for every run (e.g. model.dtype=bfloat16).
Only rank 0 writes files (besides the checkpoint's shards).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from fsdp_worker import CKPT_AT, LOSS_AGGS, STEPS, config, synthetic_groups, write
from configs.schema import MegatronBackendConfig
from learner import distributed
from learner.backends.registry import make_backend
from learner.algo.trainer import Trainer
from models.devices import torch_dtype


def make(cfg, ranks, tp: int, pp: int):
    L = cfg.learner
    backend = make_backend(MegatronBackendConfig(tp=tp, pp=pp), Path(cfg.model.path), L.lr,
                           L.weight_decay, L.seed, ranks.device, torch_dtype(cfg.model.dtype))
    return backend, Trainer(cfg, backend, pad_id=0)


def train(out: Path, model_dir: Path, ranks, tp: int, pp: int, overrides: list[str]) -> None:
    for agg in LOSS_AGGS:
        cfg = config(model_dir, "learner.max_grad_norm=0", "learner.minibatches=1",
                     f"learner.loss_agg={agg}", *overrides)
        backend, trainer = make(cfg, ranks, tp, pp)
        metrics = trainer.step(synthetic_groups(cfg, 0), 0)
        write(out, f"grads_{agg}.safetensors", dict(backend.named_full_tensors(grads=True)))
        if ranks.rank == 0:
            (out / f"grads_{agg}.json").write_text(json.dumps(metrics))
    cfg = config(model_dir, *overrides)
    backend, trainer = make(cfg, ranks, tp, pp)
    rows, times = [], []
    for step in range(STEPS):
        t0 = time.perf_counter()
        rows.append(trainer.step(synthetic_groups(cfg, step), step))
        times.append(time.perf_counter() - t0)
        write(out, f"train_{step + 1}.safetensors", dict(backend.named_full_tensors()))
        if step + 1 == CKPT_AT:
            backend.save_checkpoint(out / "ckpt", {"version": CKPT_AT})
    backend.export_hf(out / "hf")
    kept = {"params": sorted({str(p.dtype) for p in backend.model.parameters()}),
            "optimizer": sorted({str(v.dtype) for state in backend.optimizer.state.values()
                                 for v in state.values()})}
    if ranks.rank == 0:
        (out / "dtypes.json").write_text(json.dumps(kept))
        (out / "device.json").write_text(json.dumps({"device": ranks.device.type,
                                                     "dist": torch.distributed.get_backend()}))
        (out / "train_metrics.json").write_text(json.dumps(rows))
        (out / "step_seconds.json").write_text(json.dumps(times))


def resume(out: Path, model_dir: Path, ranks, tp: int, pp: int, overrides: list[str]) -> None:
    cfg = config(model_dir, *overrides)
    backend, trainer = make(cfg, ranks, tp, pp)
    state = backend.load_checkpoint(out / "ckpt")
    for step in range(state["version"], STEPS):
        trainer.step(synthetic_groups(cfg, step), step)
    write(out, "resume_final.safetensors", dict(backend.named_full_tensors()))


def main() -> None:
    mode, out, model_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    ranks = distributed.start(MegatronBackendConfig())
    overrides = [a for a in sys.argv[4:] if "=" in a]
    for layout in (a for a in sys.argv[4:] if "=" not in a):
        tp, pp = (int(x) for x in layout.split("x"))
        (out / layout).mkdir(exist_ok=True)
        {"train": train, "resume": resume}[mode](out / layout, model_dir, ranks, tp, pp, overrides)
    distributed.close(ranks)


if __name__ == "__main__":
    main()
    distributed.exit_rank(0)  # gloo's threads race interpreter finalization (learner/distributed.py)
