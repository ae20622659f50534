"""learner.device / actors.engine.device / model.dtype: resolution, config errors, the float32 path
unchanged, bfloat16 on CPU, and the learner refusing an actor whose dtype differs."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import procs
from configs.loader import ConfigError, load_config
from models import devices


def test_auto_is_cpu_without_cuda_and_cuda_without_a_gpu_names_the_field():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert devices.resolve_device("auto", "learner.device") == torch.device("cpu")
    with pytest.raises(ValueError, match="actors.engine.device is cuda but this machine has no usable CUDA"):
        devices.resolve_device("cuda", "actors.engine.device")
    with pytest.raises(ValueError, match="learner.device must be auto, cpu or cuda, got 'tpu'"):
        devices.resolve_device("tpu", "learner.device")


@pytest.mark.parametrize("key,value", [("model.dtype", "float16"), ("learner.device", "gpu"),
                                       ("actors.engine.device", "cuda:1")])
def test_bad_device_or_dtype_is_a_config_error_naming_the_field(key, value):
    with pytest.raises(ConfigError, match=f"{key} must be one of"):
        load_config(procs.PRESET, [f"{key}={value}"])


def test_defaults_keep_the_cpu_float32_path():
    """model.dtype defaults to auto: float32 on the CPU (the path unchanged), bfloat16 on CUDA;
    a stated dtype is kept on either."""
    cfg = load_config(procs.PRESET, [])
    assert (cfg.model.dtype, cfg.learner.device, cfg.actors.engine.device) == ("auto", "auto", "auto")
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert devices.torch_dtype(cfg.model.dtype, cpu) == torch.float32
    assert devices.resolve_dtype("auto", gpu) == "bfloat16"
    assert devices.resolve_dtype("float32", gpu) == "float32"
    assert isinstance(devices.compute(cpu, devices.torch_dtype(cfg.model.dtype)),
                      contextlib.nullcontext)


def test_float32_learner_logprobs_are_the_plain_forward(tiny_model_dir):
    from learner.backends.single import SingleProcessBackend
    from models.logprobs import token_logprobs

    b = SingleProcessBackend(tiny_model_dir, 1e-3, 0.0, 0)
    ids = torch.randint(0, 16, (4, 10), generator=torch.Generator().manual_seed(0))
    assert torch.equal(b.logprobs(ids, 1.0), token_logprobs(b.model, ids, 1.0))
    assert next(b.model.parameters()).dtype == torch.float32


def test_bfloat16_engine_and_learner_on_cpu_agree_to_bf16_precision(tiny_model_dir):
    """HF engine weights in bf16 vs the learner's fp32 weights under bf16 autocast: the same
    policy within bf16 rounding, and measurably not float32."""
    from actors.engines.base import GenerateRequest
    from actors.engines.hf import HFEngine
    from learner.backends.single import SingleProcessBackend

    learner = SingleProcessBackend(tiny_model_dir, 1e-3, 0.0, 0, torch.device("cpu"),
                                   torch.bfloat16)
    engine = HFEngine(tiny_model_dir, "cpu", torch.bfloat16)
    engine.load_weights(dict(learner.named_full_tensors()), 1)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 16, size=6).astype(np.int32) for _ in range(16)]
    outs = engine.generate([GenerateRequest(p, 5, 1.0, seed=i) for i, p in enumerate(prompts)])
    gaps = []
    with torch.no_grad():
        for p, c in zip(prompts, outs):
            ids = torch.from_numpy(np.concatenate([p, c.token_ids]).astype(np.int64))[None]
            gaps.append(np.abs(learner.logprobs(ids, 1.0)[0, len(p) - 1:].numpy() - c.logprobs))
    g = np.concatenate(gaps)
    print(f"bf16 CPU gap engine vs learner: mean {g.mean():.2e} max {g.max():.2e} ({g.size} tokens)")
    assert 0 < g.max() and g.mean() < 0.05


def test_learner_refuses_an_actor_with_another_dtype(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "actors.num_local=0", "learner.max_steps=2",
                       "task.eval_prompts=8")
    try:
        lp.wait_for(r"learner listening", timeout=180)
        a = procs.actor(run, "bf16-actor", "model.dtype=bfloat16")
        assert a.finish(timeout=120) != 0
        assert "computes in model.dtype=bfloat16, the learner in float32" in "".join(a.lines), a.tail()
        lp.wait_for(r"rejected message #1 \(dtype\)", timeout=30)
    finally:
        lp.kill()


@pytest.mark.parametrize("cpus, ranks, actors, want", [
    ([0, 1], 1, 2, ([[0]], [[1], [1]])),                      # this machine: learner | actors
    (list(range(8)), 2, 2, ([[0, 1], [2, 3]], [[4, 5], [6, 7]])),
    ([0, 1, 2], 1, 4, ([[0]], [[1], [2], [1], [2]])),         # more actors than cores
    ([3], 1, 2, ([[3]], [[3], [3]])),                          # one core: everyone shares it
    ([0, 1], 1, 0, ([[0, 1]], [])),                            # no local actors: all to the learner
])
def test_split_cpus_gives_learner_and_actors_disjoint_cores(cpus, ranks, actors, want):
    assert devices.split_cpus(cpus, ranks, actors) == want


def test_split_placement_pins_the_learner_and_its_actor_processes(tmp_path, tiny_model_dir):
    import os

    cpus = sorted(os.sched_getaffinity(0))
    learner_cpus, actor_cpus = devices.split_cpus(cpus, 1, 2)
    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "learner.cpu_placement=split", "learner.max_steps=4",
                       "learner.log_every=1")
    try:
        lp.wait_for(r"step 1/4", timeout=300)
        kids = [int(p) for p in os.popen(f"pgrep -P {lp.p.pid} -f actors").read().split()]
        assert len(kids) == 2
        assert os.sched_getaffinity(lp.p.pid) == set(learner_cpus[0])
        assert sorted(sorted(os.sched_getaffinity(k)) for k in kids) == sorted(actor_cpus)
        s = procs.finish_clean(lp, run, 4, timeout=300)
    finally:
        lp.kill()
    assert s["accounting_ok"]
