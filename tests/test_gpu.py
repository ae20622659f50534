"""The GPU path: vLLM on CUDA against the learner on CUDA, in-flight `keep` updates, FSDP2 with
NCCL, bf16 weights (BF16AdamW) and packed rows on CUDA, the learner -> vLLM weight path. Every test is @pytest.mark.gpu (skipped without CUDA;
scripts/device_check.sh runs them all). The tiny model is used unless TETHER_GPU_MODEL names an
HF directory (the device check passes SmolLM2-135M-Instruct) for the bf16 gap test.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import procs

pytestmark = [pytest.mark.gpu]
vllm = pytest.mark.vllm
"""The tests that need vLLM; the others run on the lent GPU machine, which has none
(scripts/device_check.sh runs `pytest -m "gpu and not vllm"`)."""
DEVICE = "cuda"
FP32_TOL = 1e-3
"""Engine vs learner logprobs in float32: the same contract as on CPU (tests/test_vllm.py)."""
BF16_MEAN_TOL = 0.05
"""bf16 keeps 8 mantissa bits (relative error 2**-8 per rounding): on logits of magnitude ~10
that is ~0.04, so a mean gap above 0.05 is a mismatch of weights or dtype, not rounding."""


def _engine(model_dir, dtype: str):
    from actors.engines.vllm.engine import VLLMEngine

    loop = asyncio.new_event_loop()
    eng = loop.run_until_complete(asyncio.to_thread(
        VLLMEngine, model_dir, "keep", 0, 1.0, True, 64, dtype))
    eng.loop = loop
    return eng


def _close(eng) -> None:
    eng.shutdown()
    pending = asyncio.all_tasks(eng.loop)
    for task in pending:
        task.cancel()
    eng.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    eng.loop.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = _engine(tiny_model_dir, "float32")
    yield eng
    _close(eng)


def _backend(model_dir, dtype=torch.float32, lr=1e-6):
    from learner.backends.single import SingleProcessBackend

    return SingleProcessBackend(model_dir, lr, 0.0, 0, torch.device(DEVICE), dtype)


def _load(eng, state, version: int) -> None:
    from transport.weights import pack

    packed = pack(state, version, bucket_bytes=1 << 20)
    eng.loop.run_until_complete(eng.load_packed(packed.manifest, list(packed.buckets)))


def _generate(eng, prompts, max_new: int, on_started=None):
    async def run():
        tasks = [asyncio.create_task(eng.generate(p, max_new, 1.0, seed=i))
                 for i, p in enumerate(prompts)]
        if on_started is not None:
            await on_started()
        return await asyncio.gather(*tasks)
    return eng.loop.run_until_complete(run())


def _prompts(model_dir, n: int, length: int = 8):
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=length).astype(np.int32) for _ in range(n)]


def _gaps(backend, prompts, outs) -> np.ndarray:
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, outs):
            ids = torch.from_numpy(np.concatenate([p, c.token_ids]).astype(np.int64))[None]
            lp = backend.logprobs(ids.to(backend.device), 1.0)[0, len(p) - 1:].float().cpu().numpy()
            out.append(np.abs(lp - c.logprobs))
    return np.concatenate(out)


@vllm
def test_vllm_cuda_logprobs_match_learner_fp32(engine, tiny_model_dir):
    backend = _backend(tiny_model_dir)
    _load(engine, dict(backend.named_full_tensors()), 1)
    prompts = _prompts(tiny_model_dir, 32)
    outs = _generate(engine, prompts, 16)
    gap = _gaps(backend, prompts, outs)
    print(f"fp32 gap vLLM vs learner on CUDA: mean {gap.mean():.2e} max {gap.max():.2e}")
    assert gap.size > 0 and gap.max() < FP32_TOL


@vllm
def test_vllm_cuda_logprobs_match_learner_bf16(tiny_model_dir):
    model = Path(os.environ.get("TETHER_GPU_MODEL") or tiny_model_dir)
    backend = _backend(model, torch.bfloat16)
    eng = _engine(model, "bfloat16")
    try:
        _load(eng, dict(backend.named_full_tensors()), 1)
        prompts = _prompts(model, 32, length=32)
        gap = _gaps(backend, prompts, _generate(eng, prompts, 64))
    finally:
        _close(eng)
    print(f"bf16 gap vLLM vs learner on CUDA ({model.name}): mean {gap.mean():.3e} "
          f"max {gap.max():.3e} over {gap.size} tokens")
    assert gap.size > 0 and gap.mean() < BF16_MEAN_TOL


@vllm
def test_learner_to_vllm_weight_path_on_cuda(engine, tiny_model_dir):
    """A real optimizer step on the CUDA learner, published as buckets, loaded by vLLM on
    CUDA: the engine samples with the new version and its logprobs match the new weights."""
    backend = _backend(tiny_model_dir, lr=1e-2)
    _load(engine, dict(backend.named_full_tensors()), 5)
    prompts = _prompts(tiny_model_dir, 16)
    before = _gaps(backend, prompts, _generate(engine, prompts, 8))
    ids = torch.from_numpy(np.stack(prompts).astype(np.int64)).to(backend.device)
    backend.step(-backend.logprobs(ids, 1.0).mean(), 1.0)
    _load(engine, dict(backend.named_full_tensors()), 6)
    outs = _generate(engine, prompts, 8)
    assert all((c.versions == 6).all() for c in outs)
    after = _gaps(backend, prompts, outs)
    assert before.max() < FP32_TOL and after.max() < FP32_TOL


@vllm
def test_inflight_keep_update_on_cuda(engine, tiny_model_dir):
    """Weights B land while samples from A run: some samples hold both versions, and each
    token's logprob matches the weights of the version that sampled it."""
    backend = _backend(tiny_model_dir)
    base = dict(backend.named_full_tensors())
    g = torch.Generator(device=DEVICE).manual_seed(1)
    a = {k: v + 0.5 * torch.randn(v.shape, generator=g, device=DEVICE) for k, v in base.items()}
    b = {k: v + 0.5 * torch.randn(v.shape, generator=g, device=DEVICE) for k, v in base.items()}
    engine.update_mode = "keep"
    _load(engine, a, 20)
    prompts = _prompts(tiny_model_dir, 24)
    started = asyncio.Event()
    target = engine.tokens_out + 2 * len(prompts)
    engine.on_tokens = lambda n: started.set() if n >= target else None

    async def swap():
        await started.wait()
        from transport.weights import pack

        packed = pack(b, 21, bucket_bytes=1 << 20)
        await engine.load_packed(packed.manifest, list(packed.buckets))

    outs = _generate(engine, prompts, 48, on_started=swap)
    engine.on_tokens = None
    mixed = 0
    for v, state in ((20, a), (21, b)):
        backend.model.load_state_dict(state, strict=False)
        backend.model.tie_weights()
        for p, c in zip(prompts, outs):
            sel = c.versions == v
            if sel.any():
                assert _gaps(backend, [p], [c])[sel].max() < FP32_TOL, f"v{v} tokens"
    for c in outs:
        assert set(np.unique(c.versions)) <= {20, 21} and (np.diff(c.versions) >= 0).all()
        mixed += len(set(c.versions.tolist())) > 1
    assert mixed >= 1, "no sample straddled the update"


def test_fsdp2_nccl_one_rank_equals_single_process(tmp_path, tiny_model_dir):
    """torchrun with one rank: the process group is NCCL on cuda:0, and FSDP2 training equals
    the single-process CUDA backend on the same batches."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "1", "tests/gpu_fsdp_worker.py", str(tmp_path),
                        str(tiny_model_dir), DEVICE], cwd=procs.ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads((tmp_path / "fsdp_vs_single.json").read_text())
    assert got["process_group"] == "nccl" and got["device"].startswith("cuda"), got
    assert got["max_weight_diff"] <= 1e-5 and got["moved"] > 1e-3, got


def test_auto_dtype_is_bf16_and_tf32_is_on_for_the_cuda_learner():
    """model.dtype auto resolves to bfloat16 on CUDA, and the learner's fp32 matmuls use TF32."""
    from models import devices

    dev = devices.resolve_device("auto", "learner.device")
    assert dev.type == "cuda" and devices.resolve_dtype("auto", dev) == "bfloat16"
    devices.enable_tf32(dev)
    assert torch.get_float32_matmul_precision() == "high"


@vllm
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per process: the "
                    "learner on one, the vLLM actor on another")
def test_versions_reach_a_vllm_actor_by_nccl_broadcast(tmp_path, tiny_model_dir):
    """transport.weights_via=nccl: every version is broadcast from the learner (GPU 0) into a
    vLLM actor's engine (GPU 1); the run trains and accounts like any."""
    run = tmp_path / "run"
    args = ["-m", "learner", "-c", str(procs.PRESET), f"run_dir={run}",
            f"model.path={tiny_model_dir}", "learner.max_steps=4", "actors.num_local=0",
            "actors.engine=vllm", "transport.weights_via=nccl", "transport.nccl_engines=1"]
    lp = procs.Proc(args, tmp_path / "learner.log", env={"CUDA_VISIBLE_DEVICES": "0"})
    actor = None
    try:
        lp.wait_for(r"learner listening", timeout=300)
        actor = procs.actor(run, "gpu1", env={"CUDA_VISIBLE_DEVICES": "1"})
        s = procs.finish_clean(lp, run, 4, timeout=900)
        assert actor.finish(timeout=120) == 0, actor.tail()
    finally:
        for p in (actor, lp):
            if p is not None:
                p.kill()
    loaded = [int(v) for v in re.findall(r"loaded weights v(\d+) \(full, by nccl broadcast\)",
                                         "".join(actor.lines))]
    assert loaded and loaded == sorted(loaded) and loaded[-1] >= 3, actor.tail()
    assert s["weights_sent_bytes"] == {}  # no bucket went over ZeroMQ


def test_bf16_adamw_on_cuda_is_fp32_adamw_rounded_to_a_neighbour():
    """learner.backend.param_dtype=bfloat16 on a GPU: BF16AdamW draws its rounding noise from a
    generator on the parameters' device, and one step lands on a bf16 neighbour of fp32 AdamW's
    result (tests/test_optim.py, on CUDA tensors)."""
    from learner.backends.optim import BF16AdamW

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    w0 = torch.randn(1 << 20, generator=gen, device=DEVICE).bfloat16()
    grad = torch.randn(1 << 20, generator=gen, device=DEVICE).bfloat16()
    ref = torch.nn.Parameter(w0.float())
    got = torch.nn.Parameter(w0.clone())
    ref.grad, got.grad = grad.float(), grad.clone()
    torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1).step()
    BF16AdamW([got], lr=1e-2, weight_decay=0.1).step()
    r = ref.detach()
    low = (r.view(torch.int32) & -65536).view(torch.float32)
    high = (low.view(torch.int32) + 65536).view(torch.float32)
    g, tol = got.detach().float(), 1e-6 * r.abs()
    assert torch.all(((g - low).abs() <= tol) | ((g - high).abs() <= tol))
    assert 0 < (g == high).float().mean().item() < 1  # both neighbours drawn


def test_bf16_weights_train_on_cuda(tiny_model_dir):
    """A single-process CUDA backend with bf16 weights (param_dtype=bfloat16, model.dtype
    bfloat16) takes a step: bf16 parameters and moments on the GPU, the weights move, the loss
    is finite."""
    from learner.backends.single import SingleProcessBackend

    backend = SingleProcessBackend(tiny_model_dir, 1e-3, 0.0, 0, torch.device(DEVICE),
                                   torch.bfloat16, param_dtype="bfloat16")
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    ids = torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    lp = backend.logprobs(ids, 1.0)
    loss = -lp.mean()
    assert torch.isfinite(loss)
    backend.zero_grad()
    backend.backward(loss)
    backend.apply_gradients(1.0)
    params = dict(backend.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert all(p.device.type == DEVICE for p in params.values())
    assert any(not torch.equal(before[n], p.detach()) for n, p in params.items())


def test_packed_rows_stay_apart_on_cuda_in_bf16(tiny_model_dir):
    """learner.pack_rows on a GPU (sdpa, bf16): the start-up check passes, and a pack's second
    row gets its own logprobs whatever its first row holds (bitwise, as on the CPU), close to
    the row run alone (bf16 rounding: BF16_MEAN_TOL)."""
    from learner.algo import microbatch
    from learner.algo.batch import TokenBatch
    from models import packing

    backend = _backend(tiny_model_dir, torch.bfloat16)
    lp = lambda ids, pos: backend.logprobs(ids, 1.0, pos)  # noqa: E731
    packing.require_rows_apart("the policy", backend.model, lp)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 16, (2, 10), generator=gen)
    lengths = torch.tensor([7, 10])
    part = microbatch.MicroBatch(rows=torch.tensor([0, 1]), length=10, packed=lengths)

    def rows(input_ids: torch.Tensor) -> torch.Tensor:
        mb = TokenBatch(input_ids=input_ids.to(DEVICE), mask=None, behavior=None, versions=None,
                        rewards=None, num_groups=1, lengths=lengths)
        with torch.no_grad():
            return part.run(lp, mb).float().cpu()

    other = ids.clone()
    other[0] = (other[0] + 3) % 16
    assert torch.equal(rows(ids)[1], rows(other)[1])
    with torch.no_grad():
        alone = backend.logprobs(ids[1:].to(DEVICE), 1.0).float().cpu()[0]
    assert (rows(ids)[1] - alone).abs().mean().item() <= BF16_MEAN_TOL
