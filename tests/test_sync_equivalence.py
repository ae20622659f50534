"""max_staleness = 0 through the distributed system (separate processes, real ZeroMQ) is
bitwise the same as a plain in-process synchronous PPO loop."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import procs
from configs.loader import load_config
from learner.sync_loop import run_sync

STEPS = 6


@pytest.mark.parametrize("correction, extra", [
    ("none", []),
    ("decoupled", ["learner.minibatches=2", "learner.epochs=2"]),
    # docs/algorithms.md: a critic (GAE), the reference KL, dynamic sampling
    ("decoupled", ["learner.advantage=gae", "learner.lam=0.95", "learner.minibatches=2"]),
    ("decoupled", ["learner.kl_coef=0.05", "learner.kl_estimator=k3", "learner.entropy_coef=0.01"]),
    ("decoupled", ["learner.drop_uniform_groups=true", "learner.group_size=2"]),
], ids=["none", "decoupled", "critic_gae", "reference_kl", "dynamic_sampling"])
def test_eta0_distributed_equals_synchronous_loop(tmp_path, tiny_model_dir, correction, extra):
    run = tmp_path / "run"
    overrides = ["max_staleness=0", f"learner.correction={correction}", "learner.prompts_per_step=8",
                 f"learner.max_steps={STEPS}", "actors.groups_per_request=3", *extra]
    lp = procs.learner(run, tiny_model_dir, *overrides)
    assert lp.finish(timeout=300) == 0, lp.tail()
    assert procs.summary(run)["steps"] == STEPS
    assert all(r["staleness_max"] == 0 for r in procs.metrics(run))
    if "learner.drop_uniform_groups=true" in extra:  # many groups of 2 are uniform
        s = procs.summary(run)
        assert s["groups"]["dropped"].get("uniform", 0) > 0 and s["accounting_ok"], s["groups"]
    distributed = load_file(str(run / "final_model" / "model.safetensors"))  # after step STEPS

    cfg = load_config(procs.PRESET, [*overrides, f"model.path={tiny_model_dir}"])
    synchronous = run_sync(cfg, STEPS).state_dict()
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert distributed.keys() == synchronous.keys()
    moved = 0
    for name, ref in synchronous.items():
        assert torch.equal(distributed[name], ref), f"{name} differs: max " \
            f"{(distributed[name] - ref).abs().max().item():.3e}"
        moved += int(not torch.equal(ref, initial[name]))
    assert moved == len(synchronous)  # training really changed every tensor


@pytest.mark.parametrize("weights_via,targets", [
    ("zmq", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"),
    ("filesystem", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head")])
def test_eta0_lora_distributed_equals_synchronous_loop(tmp_path, tiny_model_dir, weights_via,
                                                       targets):
    """LoRA: actors get the base once and an adapter per version (merged by the HF engine),
    over ZeroMQ or as files on shared storage; the trained adapter is bitwise the synchronous
    loop's, and the base never moved. The file case also adapts the tied head (lm_head)."""
    from models.lora import hf_name

    run = tmp_path / "run"
    overrides = [f"transport.weights_via={weights_via}", "max_staleness=0", "learner.correction=decoupled", "learner.prompts_per_step=8",
                 f"learner.max_steps={STEPS}", "actors.groups_per_request=3",
                 "learner.lora.rank=4", "learner.lora.alpha=8", "learner.lr=3e-3",
                 "learner.kl_coef=0.05", f"learner.lora.targets={targets}"]
    lp = procs.learner(run, tiny_model_dir, *overrides)
    assert lp.finish(timeout=300) == 0, lp.tail()
    assert procs.summary(run)["steps"] == STEPS
    assert all(r["staleness_max"] == 0 for r in procs.metrics(run))
    logs = [p.read_text() for p in (run / "logs").glob("actor-*.log")]
    assert len(logs) == 2  # the base once per actor that loaded anything, then adapters only
    assert all(t.count("loaded the base weights") == int("loaded weights v" in t) for t in logs)
    assert sum(t.count("(adapter") for t in logs) >= STEPS and not any("(full" in t for t in logs)
    saved = load_file(str(run / "final_model" / "adapter" / "adapter_model.safetensors"))
    distributed = {hf_name(k): v for k, v in saved.items()}

    cfg = load_config(procs.PRESET, [*overrides, f"model.path={tiny_model_dir}"])
    backend = run_sync(cfg, STEPS)
    synchronous = backend.adapter_state()
    assert distributed.keys() == synchronous.keys()
    for name, ref in synchronous.items():
        assert torch.equal(distributed[name], ref), f"{name} differs: max " \
            f"{(distributed[name] - ref).abs().max().item():.3e}"
    assert sum(not torch.equal(v, torch.zeros_like(v)) for v in synchronous.values()) \
        == len(synchronous)  # every A and B moved (B starts at zero)
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    assert all(torch.equal(v, initial[k]) for k, v in backend.state_dict().items())
