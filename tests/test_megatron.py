"""The Megatron-core learner backend on CPU ranks (gloo), in real torchrun process groups.

TP = 2 and PP = 2 (2 ranks each): a step equals the single-process step on the same batch (loss
metrics and gradients, every loss aggregation); the weights published after N steps equal the
single-process learner's and load into transformers and vLLM; a checkpoint resumed by fresh
processes continues like the uninterrupted run; the whole learner with TP = 2 and two actors
learns the toy task. The CPU redirects (learner/backends/megatron/cpu.py) are each shown to be needed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import fsdp_worker
import procs
from learner.backends.single import SingleProcessBackend
from learner.algo.trainer import Trainer

TOL = 1e-5
LAYOUTS = ["2x1", "1x2"]
"""Tensor-parallel size x pipeline-parallel size, each on 2 ranks (data-parallel size 1)."""


def _torchrun(nproc: int, *args: str, timeout: float = 300) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", str(nproc), *args], cwd=procs.ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def megatron_runs(tmp_path_factory, tiny_model_dir):
    """One torchrun of tests/megatron_worker.py train on 2 ranks, every layout in turn."""
    out = tmp_path_factory.mktemp("megatron")
    _torchrun(2, "tests/megatron_worker.py", "train", str(out), str(tiny_model_dir), *LAYOUTS)
    return out


def _single(cfg, dtype: torch.dtype = torch.float32):
    L = cfg.learner
    backend = SingleProcessBackend(cfg.model.path, L.lr, L.weight_decay, L.seed, dtype=dtype)
    return backend, Trainer(cfg, backend, pad_id=0)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


NOISE_REL = 1e-7
"""Relative perturbation of the reference's initial weights: about one float32 rounding."""
NOISE_SEEDS = (1, 2, 3)
ILL_CONDITIONED_FRAC = 1e-3
"""At most this fraction of the weights may be ill-conditioned (move more than TOL under
NOISE_REL), so the weights bound stays TOL nearly everywhere."""
_noise_cache: dict[str, dict[str, torch.Tensor]] = {}


def _single_after_steps(cfg, perturb_seed: int | None = None) -> dict[str, torch.Tensor]:
    backend, trainer = _single(cfg)
    if perturb_seed is not None:
        g = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in backend.model.parameters():
                p.mul_(1 + NOISE_REL * torch.randn(p.shape, generator=g))
    for s in range(fsdp_worker.STEPS):
        trainer.step(fsdp_worker.synthetic_groups(cfg, s), s)
    return backend.state_dict()


def _rounding_noise(cfg) -> dict[str, torch.Tensor]:
    """How far each weight of the single-process reference after STEPS steps moves when its
    initial weights carry float32 rounding noise (NOISE_REL; elementwise max over NOISE_SEEDS).
    Measured on the test model: one element of 132,800 (layer 0 q_proj) moves ~3.7e-5, with or
    without the PPO clip and the grad-norm clip; every other one stays below 1e-5. No float32
    implementation with another summation order (Megatron's TP and PP splits) can be held to
    TOL at such an element, nor can the reference itself."""
    key = msgspec.json.encode(cfg).decode()
    if key not in _noise_cache:
        base = _single_after_steps(cfg)
        noise = {k: torch.zeros_like(v) for k, v in base.items()}
        for seed in NOISE_SEEDS:
            other = _single_after_steps(cfg, seed)
            noise = {k: torch.maximum(noise[k], (other[k] - base[k]).abs()) for k in base}
        _noise_cache[key] = noise
    return _noise_cache[key]


def _assert_weights_match(got: dict, ref: dict, noise: dict, label: str) -> None:
    """`got` equals `ref` within TOL, except where the reference is itself ill-conditioned
    (`_rounding_noise`): there within TOL + 2 x that noise, and such elements are rare."""
    assert got.keys() == ref.keys() == noise.keys(), label
    total = sum(v.numel() for v in noise.values())
    ill = sum(int((v > TOL).sum()) for v in noise.values())
    assert ill <= ILL_CONDITIONED_FRAC * total, (label, ill, total)
    for k in got:
        excess = (got[k] - ref[k]).abs() - (TOL + 2 * noise[k])
        assert excess.max().item() <= 0, (label, k, (got[k] - ref[k]).abs().max().item())


def _rel_norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
              origin: dict[str, torch.Tensor] | None = None) -> float:
    """||a - b|| / ||b - origin|| over all tensors together (origin None: zero)."""
    assert a.keys() == b.keys()
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float((b[k].double() - (0 if origin is None else origin[k].double())).pow(2).sum())
              for k in b)
    return (num / den) ** 0.5


def _check_bf16_update(got: dict, weights: dict, initial: dict, label: str) -> None:
    """The weight update `got` (bf16) is within BF16_NOISE x the single-process backend's own
    bf16-vs-fp32 difference of the single-process bf16 update, and really is not fp32's."""
    bf16_error = _rel_norm(weights[torch.bfloat16], weights[torch.float32], initial)
    error = _rel_norm(got, weights[torch.bfloat16], initial)
    print(f"{label}: update vs single bf16 {error:.2e}, single bf16 vs fp32 {bf16_error:.2e}, "
          f"max abs weight diff {_max_diff(got, weights[torch.bfloat16]):.2e}")
    assert error <= BF16_NOISE * bf16_error
    assert _rel_norm(got, weights[torch.float32], initial) > 100 * TOL


NOT_ON_MEGATRON = {"entropy"}
"""Metrics the Megatron backend does not produce: the policy entropy over vocab-parallel logits
is not built (MegatronBackend.logprobs_entropy returns None; entropy_coef > 0 is refused)."""


@pytest.mark.megatron
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("agg", fsdp_worker.LOSS_AGGS)
def test_loss_and_gradients_equal_single_process(megatron_runs, tiny_model_dir, layout, agg):
    out = megatron_runs / layout
    cfg = fsdp_worker.config(tiny_model_dir, "learner.max_grad_norm=0", "learner.minibatches=1",
                             f"learner.loss_agg={agg}")
    backend, trainer = _single(cfg)
    ref = trainer.step(fsdp_worker.synthetic_groups(cfg, 0), 0)
    got = json.loads((out / f"grads_{agg}.json").read_text())
    assert got.keys() == ref.keys() - NOT_ON_MEGATRON
    for k in got:
        assert got[k] == pytest.approx(ref[k], rel=TOL, abs=TOL), k
    grads = {n: p.grad for n, p in backend.model.named_parameters()}
    assert min(g.abs().max().item() for g in grads.values()) > 0  # every tensor gets a gradient
    assert _max_diff(load_file(str(out / f"grads_{agg}.safetensors")), grads) <= TOL


@pytest.mark.megatron
@pytest.mark.parametrize("layout", LAYOUTS)
def test_weights_after_n_steps_equal_single_process(megatron_runs, tiny_model_dir, layout):
    out = megatron_runs / layout
    cfg = fsdp_worker.config(tiny_model_dir)
    backend, trainer = _single(cfg)
    rows = [trainer.step(fsdp_worker.synthetic_groups(cfg, s), s) for s in range(fsdp_worker.STEPS)]
    assert any(r["grad_norm"] > cfg.learner.max_grad_norm for r in rows)  # clipping was active
    got = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
    ref = backend.state_dict()
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    _assert_weights_match(got, ref, _rounding_noise(cfg), layout)
    assert _max_diff(ref, initial) > 100 * TOL  # the weights really moved
    megatron_rows = json.loads((out / "train_metrics.json").read_text())
    for r, m in zip(rows, megatron_rows, strict=True):
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=TOL)
        assert m["loss"] == pytest.approx(r["loss"], rel=TOL, abs=TOL)


BF16_EPS = torch.finfo(torch.bfloat16).eps
"""2**-7: bfloat16 keeps 8 significant bits, so every rounding moves a value by up to 2**-8
relative. Two bf16 computations of the same function that round in different places (Megatron
fuses q/k/v and gate/up into one matmul, splits matmuls over TP ranks and sums the bf16 partial
results, the HF model does neither) differ by bf16 noise, not by float32 noise."""
BF16_NOISE = 3.0
"""Megatron in bf16 vs the single-process learner in bf16 may differ by this many times the
single-process learner's own bf16-vs-fp32 difference, measured in the same test. Two independent
bf16 errors of the same size differ by about sqrt(2) times one; measured at most 1.5 times
(gradients) and 1.25 times (weights after N steps), see lab/notes/backends.md."""


@pytest.fixture(scope="module")
def megatron_bf16_runs(tmp_path_factory, tiny_model_dir):
    """As `megatron_runs`, with model.dtype=bfloat16 (fp32 weights, bf16 autocast)."""
    out = tmp_path_factory.mktemp("megatron_bf16")
    _torchrun(2, "tests/megatron_worker.py", "train", str(out), str(tiny_model_dir), *LAYOUTS,
              "model.dtype=bfloat16")
    return out


@pytest.mark.megatron
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("agg", fsdp_worker.LOSS_AGGS)
def test_bf16_loss_and_gradients_match_single_process_bf16(megatron_bf16_runs, tiny_model_dir,
                                                           layout, agg):
    """model.dtype=bfloat16: one step's loss metrics within one bf16 epsilon, gradients within
    BF16_NOISE times the single-process bf16 error, and measurably not float32."""
    out = megatron_bf16_runs / layout
    cfg = fsdp_worker.config(tiny_model_dir, "learner.max_grad_norm=0", "learner.minibatches=1",
                             f"learner.loss_agg={agg}", "model.dtype=bfloat16")
    grads, metrics = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        backend, trainer = _single(cfg, dtype)
        metrics[dtype] = trainer.step(fsdp_worker.synthetic_groups(cfg, 0), 0)
        grads[dtype] = {n: p.grad for n, p in backend.model.named_parameters()}
    got = json.loads((out / f"grads_{agg}.json").read_text())
    assert got.keys() == metrics[torch.bfloat16].keys() - NOT_ON_MEGATRON
    for k in got:
        assert got[k] == pytest.approx(metrics[torch.bfloat16][k], rel=BF16_EPS, abs=BF16_EPS), k
    got_grads = load_file(str(out / f"grads_{agg}.safetensors"))
    assert {g.dtype for g in got_grads.values()} == {torch.float32}
    bf16_error = _rel_norm(grads[torch.bfloat16], grads[torch.float32])
    error = _rel_norm(got_grads, grads[torch.bfloat16])
    print(f"bf16 {layout} {agg}: gradients vs single bf16 {error:.2e}, single bf16 vs fp32 "
          f"{bf16_error:.2e}, vs single fp32 {_rel_norm(got_grads, grads[torch.float32]):.2e}")
    assert error <= BF16_NOISE * bf16_error
    assert _rel_norm(got_grads, grads[torch.float32]) > 100 * TOL  # it did compute in bf16


@pytest.mark.megatron
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_weights_after_n_steps_match_single_process_bf16(megatron_bf16_runs, tiny_model_dir,
                                                              layout):
    """model.dtype=bfloat16, N steps with clipping: parameters and AdamW state stay float32; the
    weight update (published - initial) is within BF16_NOISE times the single-process learner's
    own bf16-vs-fp32 update difference (the max-abs weight difference says nothing here: AdamW
    moves a weight by about lr per step whatever its gradient's size, so bf16 noise in a tiny
    gradient can reverse its update); per-step loss and gradient norm within a few bf16 epsilons."""
    out = megatron_bf16_runs / layout
    cfg = fsdp_worker.config(tiny_model_dir, "model.dtype=bfloat16")
    weights, rows = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        backend, trainer = _single(cfg, dtype)
        rows[dtype] = [trainer.step(fsdp_worker.synthetic_groups(cfg, s), s)
                       for s in range(fsdp_worker.STEPS)]
        weights[dtype] = backend.state_dict()
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    initial = {k: initial[k] for k in weights[torch.float32]}
    got = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
    assert json.loads((out / "dtypes.json").read_text()) == {"params": ["torch.float32"],
                                                             "optimizer": ["torch.float32"]}
    assert {t.dtype for t in got.values()} == {torch.float32}
    _check_bf16_update(got, weights, initial, f"bf16 {layout}")
    megatron_rows = json.loads((out / "train_metrics.json").read_text())
    for r, m in zip(rows[torch.bfloat16], megatron_rows, strict=True):
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=4 * BF16_EPS)
        assert m["loss"] == pytest.approx(r["loss"], rel=4 * BF16_EPS, abs=BF16_EPS)


@pytest.mark.megatron
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_export_loads_with_transformers(megatron_runs, layout):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = megatron_runs / layout
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    AutoTokenizer.from_pretrained(out / "hf")
    final = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.items())


@pytest.mark.megatron
def test_checkpoint_resumed_by_fresh_processes_is_bitwise_exact(megatron_runs, tiny_model_dir):
    """Checkpoint (model shards + AdamW state) after step 3 of 6; new processes load it and train
    steps 4-6: the weights equal the uninterrupted run's bit for bit, for every layout."""
    _torchrun(2, "tests/megatron_worker.py", "resume", str(megatron_runs), str(tiny_model_dir),
              *LAYOUTS)
    for layout in LAYOUTS:
        out = megatron_runs / layout
        tp, pp = (int(x) for x in layout.split("x"))
        meta = json.loads((out / "ckpt" / "backend.json").read_text())
        assert meta == {"backend": "megatron", "tp": tp, "pp": pp, "optimizer": True}
        at_ckpt = load_file(str(out / f"train_{fsdp_worker.CKPT_AT}.safetensors"))
        uninterrupted = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
        resumed = load_file(str(out / "resume_final.safetensors"))
        assert _max_diff(uninterrupted, at_ckpt) > 0
        for k, v in uninterrupted.items():
            assert torch.equal(resumed[k], v), (layout, k)


# ---- HF <-> Megatron layouts (pure functions, no process group) ------------------------------

def _gqa_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=24,
                       tie_word_embeddings=False)


MEGATRON_NAMES = ["embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
                  "decoder.layers.0.self_attention.linear_proj.weight",
                  "decoder.layers.0.self_attention.linear_qkv.weight",
                  "decoder.layers.0.self_attention.linear_qkv.bias",
                  "decoder.layers.0.pre_mlp_layernorm.weight",
                  "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
                  "decoder.final_layernorm.weight", "output_layer.weight"]
SHARDED = {"embedding.word_embeddings.weight", "output_layer.weight"} | {
    n for n in MEGATRON_NAMES if "linear_" in n}


def test_grouped_query_attention_round_trips_through_two_tp_ranks():
    """A GQA model (4 heads, 2 KV groups) split over TP = 2 and gathered back gives every HF
    tensor unchanged; each rank's linear_qkv holds [q heads of its group; k; v] of one group."""
    from transformers import AutoModelForCausalLM

    from learner.backends.megatron import convert

    hf = _gqa_config()
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(hf).state_dict()
    offset = 1  # a second pipeline stage: its local layer 0 is HF layer 1
    back = {}
    for name in MEGATRON_NAMES:
        shards = [convert.to_megatron(name, state.__getitem__, hf, r, 2, offset) for r in (0, 1)]
        back.update(convert.to_hf(name, shards if name in SHARDED else shards[:1], hf, offset))
    for k, v in back.items():
        assert torch.equal(v, state[k]), k
    assert {k for k in state if "layers.0." not in k} == set(back)
    p = "model.layers.1.self_attn."
    rank1 = convert.to_megatron("decoder.layers.0.self_attention.linear_qkv.weight",
                                state.__getitem__, hf, 1, 2, offset)
    expected = torch.cat([state[p + "q_proj.weight"][16:32], state[p + "k_proj.weight"][8:16],
                          state[p + "v_proj.weight"][8:16]])
    assert torch.equal(rank1, expected)


def test_unsupported_models_and_splits_are_refused():
    from transformers import Qwen2Config

    from learner.backends.megatron import convert

    hf = _gqa_config()
    with pytest.raises(ValueError, match="learner.backend.tp=3 must divide the model's num_attention_heads"):
        convert.check_supported(hf, 3, 1)
    with pytest.raises(ValueError, match="learner.backend.pp=4 must divide the model's num_hidden_layers=2"):
        convert.check_supported(hf, 1, 4)
    with pytest.raises(ValueError, match="not model_type='gpt2'"):
        convert.check_supported(type("C", (), {"model_type": "gpt2"})(), 1, 1)
    assert isinstance(hf, Qwen2Config)


def test_tp_times_pp_must_divide_the_torchrun_world(monkeypatch):
    from configs.loader import ConfigError, load_config

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="learner.backend.tp \\* learner.backend.pp must be a "
                                          "divisor of the torchrun world size 2, got 4"):
        load_config(procs.ROOT / "configs" / "toy_reverse_megatron.yaml", ["learner.backend.pp=2"])
    load_config(procs.ROOT / "configs" / "toy_reverse_megatron.yaml", [])


def test_megatron_tests_skip_cleanly_without_megatron_core(tmp_path):
    """With a `megatron` package that has no `core` first on the path, every megatron-marked
    test is skipped (not failed, not errored) by tests/conftest.py."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(procs.ROOT)]))
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/test_megatron.py", "-m", "megatron",
                        "-q", "-rs", "-p", "no:cacheprovider"], cwd=procs.ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:]
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (\w+)", r.stdout.splitlines()[-1]))
    assert set(counts) == {"skipped", "deselected"}, r.stdout[-2000:]
    assert counts["skipped"] >= 29, counts  # the megatron tests of this file, parametrized
    reasons = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all("needs megatron-core" in line or "CUDA" in line  # the GPU test
                           for line in reasons), reasons


# ---- the CPU redirects: each is still needed, and works ------------------------------------

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only redirects")


def _source(obj) -> str:
    import inspect

    return inspect.getsource(obj)


@pytest.mark.megatron
@cpu_only
def test_redirect_current_device_for_rotary_embeddings_and_p2p():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from learner.backends.megatron.cpu import cpu_redirects

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        rope.get_emb(4)  # rotary_pos_embedding.py: inv_freq moved to torch.cuda.current_device()
    with cpu_redirects():
        emb = rope.get_emb(4)
    freqs = torch.outer(torch.arange(4, dtype=torch.float32), rope.inv_freq)
    assert torch.equal(emb, torch.cat([freqs, freqs], -1)[:, None, None, :])
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.cuda.current_device()  # the redirect ends with the block
    assert _source(P2PCommunicator._communicate).count("device=torch.cuda.current_device()") == 2


@pytest.mark.megatron
@cpu_only
def test_redirect_cuda_factories_for_schedules_and_tied_embeddings():
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules

    from learner.backends.megatron.cpu import CudaFactoriesOnCpu

    for schedule in (schedules.forward_backward_no_pipelining,
                     schedules.forward_backward_pipelining_without_interleaving):
        assert 'torch.zeros([], dtype=torch.int, device="cuda")' in _source(schedule)
    assert "weight.data.cuda()" in _source(LanguageModule.setup_embeddings_and_output_layer)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.zeros([], dtype=torch.int, device="cuda")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.ones(2).cuda()
    with CudaFactoriesOnCpu():
        assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t


@pytest.mark.megatron
@cpu_only
def test_redirect_rng_tracker():
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    from learner.backends.megatron.cpu import init_rng_tracker

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        CudaRNGStatesTracker().add("model-parallel-rng", 1)
    init_rng_tracker(0)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", 1)
    with tracker.fork():
        torch.rand(1)


@pytest.mark.megatron
@cpu_only
def test_explicit_causal_mask_and_no_p2p_sync_are_needed():
    """Not redirects but settings: Megatron's default causal mask is built on CUDA, so the
    backend passes its own (equal to Megatron's); batched p2p synchronizes CUDA unless
    batch_p2p_sync is off."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.transformer.utils import get_default_causal_mask

    from learner.backends.megatron.backend import _inputs
    from learner.backends.megatron.cpu import CudaFactoriesOnCpu

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        get_default_causal_mask(5)
    with CudaFactoriesOnCpu():
        megatron_mask = get_default_causal_mask(5)
    assert torch.equal(_inputs(torch.zeros(2, 5, dtype=torch.long))["attention_mask"][0, 0],
                       megatron_mask)
    assert "if config.batch_p2p_comm and config.batch_p2p_sync:\n            # To protect" in \
        _source(P2PCommunicator._communicate)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.cuda.synchronize()


@pytest.mark.megatron
@cpu_only
def test_bf16_backward_runs_under_autocast_on_cpu():
    """Why MegatronBackend runs backward inside models.devices.compute: Megatron's linear layers
    are autograd Functions whose custom_fwd/custom_bwd handle CUDA autocast only, so on CPU
    their backward meets the fp32 weight with a bf16 output gradient; under CPU autocast it
    runs and the gradients come back fp32."""
    from megatron.core.tensor_parallel.layers import (
        LinearWithGradAccumulationAndAsyncCommunication as Linear)

    from models.devices import compute

    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16

    def forward():
        with compute(cpu, bf16):  # input, weight, bias, fusion, allreduce_dgrad, seq. parallel, ...
            return Linear.apply(x, w, None, False, False, False, None, None, None)
    y = forward()
    assert y.dtype == bf16
    with pytest.raises(RuntimeError, match="same dtype"):
        y.float().sum().backward()
    y = forward()
    with compute(cpu, bf16):
        y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.float32
    exact = x.detach().sum(0).expand(5, 4)  # d sum(x @ w.T) / d w, each row
    assert (w.grad - exact).abs().max() <= 3 * BF16_EPS * x.detach().abs().sum(0).max()


@pytest.mark.megatron
@pytest.mark.vllm
@pytest.mark.slow
def test_hf_export_loads_into_vllm(megatron_runs):
    """vLLM starts from the TP = 2 learner's HF export and takes its published weights as a new
    version; its sampling logprobs match the learner's own logprob code on the export (the
    bound of tests/test_vllm.py)."""
    from transformers import AutoModelForCausalLM

    import engine_refs as refs
    from actors.engines.vllm.engine import VLLMEngine

    out = megatron_runs / "2x1"
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    published = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
    with refs.started_engine(lambda: VLLMEngine(out / "hf", "keep", 0, 0.25, True, 64)) as engine:
        refs.load(engine, published, fsdp_worker.STEPS)
        prompts = refs.prompts(out / "hf", 8)
        outs = refs.generate(engine, prompts, 5, 1.0)
    worst = max(float(np.abs(refs.reference(model, p, c.token_ids, 1.0) - c.logprobs).max())
                for p, c in zip(prompts, outs))
    assert worst < 1e-3, worst


E2E_STEPS = 500
"""The preset's budget, as for every toy learning test; the run ends sooner once learned
(procs.UNTIL_LEARNED). With a fixed 300 steps it measured 0.934 and, once (2026-12-03, under
the whole suite's load), 0.768 held-out: its sampled reward had reached only 0.78."""


@pytest.mark.megatron
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_tp2_learner_with_two_actors_learns(tmp_path, tiny_model_dir):
    """The whole learner under torchrun with TP = 2 (rank 0 owns the sockets, rank 1 follows)
    and two HF actors trains the toy task to a held-out reward >= 0.8."""
    run = tmp_path / "run"
    lp = procs.Proc(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                     "-m", "learner", "-c", str(procs.ROOT / "configs" / "toy_reverse_megatron.yaml"),
                     f"run_dir={run}", f"model.path={tiny_model_dir}",
                     f"learner.max_steps={E2E_STEPS}", "learner.checkpoint_every=0",
                     procs.UNTIL_LEARNED],
                    tmp_path / "learner.log")
    s = procs.finish_clean(lp, run, E2E_STEPS, timeout=1000)
    assert s["eval_reward_start"] <= 0.45, s
    print(f"Megatron TP2: held-out {s['eval_reward_start']:.3f} -> {s['eval_reward_end']:.3f} in "
          f"{s['steps']} steps ({s['end_reason']}), {s['wall_seconds']:.0f} s")
    assert s["eval_reward_end"] >= 0.8, (s, procs.learning_curve(run))
    assert f"rank 1: stop after {s['steps']} steps" in "".join(lp.lines)
    meta = json.loads((run / "checkpoints" / f"step_{s['steps']}" / "backend.json").read_text())
    assert meta["backend"] == "megatron" and meta["tp"] == 2
    assert (run / "final_model" / "model.safetensors").exists()


FOUR_RANK_LAYOUTS = ["2x2", "2x1"]
"""On 4 ranks: TP2 x PP2 (data-parallel size 1) and TP2 with data-parallel size 2."""


@pytest.mark.megatron
@pytest.mark.slow
def test_four_ranks_tp2_pp2_and_tp2_dp2_equal_single_process(tmp_path, tiny_model_dir):
    _torchrun(4, "tests/megatron_worker.py", "train", str(tmp_path), str(tiny_model_dir),
              *FOUR_RANK_LAYOUTS, timeout=500)
    cfg = fsdp_worker.config(tiny_model_dir, "learner.max_grad_norm=0", "learner.minibatches=1")
    backend, trainer = _single(cfg)
    ref = trainer.step(fsdp_worker.synthetic_groups(cfg, 0), 0)
    grads = {n: p.grad for n, p in backend.model.named_parameters()}
    cfg = fsdp_worker.config(tiny_model_dir)
    after, trainer = _single(cfg)
    for s in range(fsdp_worker.STEPS):
        trainer.step(fsdp_worker.synthetic_groups(cfg, s), s)
    for layout in FOUR_RANK_LAYOUTS:
        out = tmp_path / layout
        got = json.loads((out / "grads_token_mean.json").read_text())
        assert got.keys() == ref.keys() - NOT_ON_MEGATRON, layout
        for k in got:
            assert got[k] == pytest.approx(ref[k], rel=TOL, abs=TOL), (layout, k)
        assert _max_diff(load_file(str(out / "grads_token_mean.safetensors")), grads) <= TOL
        weights = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
        _assert_weights_match(weights, after.state_dict(), _rounding_noise(cfg), layout)


@pytest.mark.megatron
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_tp2_on_nccl_trains_like_single_process(tmp_path, tiny_model_dir, dtype):
    """The same code on 2 GPUs (NCCL, no CPU redirects): TP = 2 weights after N steps match the
    single-process CPU learner in the same model.dtype. float32: GPU kernels differ from CPU
    ones, hence 1e-4. bfloat16 (CUDA autocast): the weight update within BF16_NOISE times the
    CPU learner's own bf16-vs-fp32 update difference, as on CPU; parameters and AdamW state fp32."""
    _torchrun(2, "tests/megatron_worker.py", "train", str(tmp_path), str(tiny_model_dir), "2x1",
              f"model.dtype={dtype}")
    out = tmp_path / "2x1"
    assert json.loads((out / "device.json").read_text()) == {"device": "cuda", "dist": "nccl"}
    assert json.loads((out / "dtypes.json").read_text()) == {"params": ["torch.float32"],
                                                             "optimizer": ["torch.float32"]}
    cfg = fsdp_worker.config(tiny_model_dir, f"model.dtype={dtype}")
    weights = {}
    for torch_dtype in {"float32": [torch.float32],
                        "bfloat16": [torch.bfloat16, torch.float32]}[dtype]:
        backend, trainer = _single(cfg, torch_dtype)
        for s in range(fsdp_worker.STEPS):
            trainer.step(fsdp_worker.synthetic_groups(cfg, s), s)
        weights[torch_dtype] = backend.state_dict()
    got = load_file(str(out / f"train_{fsdp_worker.STEPS}.safetensors"))
    if dtype == "float32":
        assert _max_diff(got, weights[torch.float32]) <= 1e-4
        return
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    initial = {k: initial[k] for k in got}
    _check_bf16_update(got, weights, initial, "bf16 on 2 GPUs (vs CPU single)")
