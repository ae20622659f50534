"""SGLang with LoRA adapters on CPU (its torch_native LoRA backend): the base once, an adapter
per version loaded in memory (`load_lora_adapter_from_tensors`, no files), behavior logprobs
equal to the learner's peft forward, in-flight updates. Runs in the SGLang lane of ./test.sh."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("sglang", reason="SGLang is tested in its own lane (scripts/env_sglang.sh)")

import engine_refs as refs  # noqa: E402
from configs.schema import LoraConfig  # noqa: E402
from learner.backends.single import SingleProcessBackend  # noqa: E402

pytestmark = pytest.mark.sglang
LORA = LoraConfig(rank=4, alpha=8)
LORA_HEAD = LoraConfig(rank=4, alpha=8, targets=f"{LORA.targets},lm_head")
"""The seven projections and the tied `lm_head`: the module's engine is started with these
targets (one engine start for the module); an adapter that leaves `lm_head` out (LORA) gets
SGLang's zeroed buffers there, i.e. no change to the head."""


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from actors.engines.sglang.engine import SGLangEngine

    with refs.started_engine(lambda: SGLangEngine(tiny_model_dir, "keep", 0, 8192, 0.0,
                                                  lora_rank=4,
                                                  lora_targets=LORA_HEAD.target_list())) as eng:
        # the base, as an actor gets it once per learner run (every test publishes adapters)
        backend = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LORA)
        refs.load_lora_base(eng, backend)
        yield eng


def test_adapter_logprobs_match_learner_then_after_update(engine, tiny_model_dir):
    backend = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LORA)
    ps = refs.prompts(tiny_model_dir, 16)
    seen = []
    for version, steps in ((0, 0), (1, 5), (2, 5)):
        refs.train_adapter(backend, tiny_model_dir, steps)
        engine.loop.run_until_complete(refs.publish_adapter(engine, backend, version))
        outs = refs.generate(engine, ps, 5, 1.0)
        assert all((c.versions == version).all() for c in outs)
        worst = refs.adapter_gap(backend, ps, outs, 1.0)
        seen.append([c.token_ids.tolist() for c in outs])
        print(f"SGLang LoRA v{version}: max |engine - learner| = {worst:.2e}")
        assert worst < 1e-3
    assert seen[0] != seen[2]  # the adapters changed what is sampled
    assert engine.loaded_adapters() == {engine._adapter}  # only v2's adapter is left


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_inflight_adapter_update(engine, tiny_model_dir, mode):
    """A new adapter lands while long requests run. keep: they finish on the adapter they
    started with; abort: they are resubmitted and continue on the new one. Either way each
    token is labelled with the version whose adapter sampled it (its logprob matches that
    version's learner), new requests get the new adapter, and the old adapter is unloaded
    once its last request ended."""
    engine.update_mode = mode
    k = ("keep", "abort").index(mode)
    va, vb = 10 + 2 * k, 11 + 2 * k
    old = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LORA)
    refs.train_adapter(old, tiny_model_dir, 3)
    new = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LORA)
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
    worst = max(refs.adapter_gap(old, ps, first, 1.0, [va]), refs.adapter_gap(new, ps, first, 1.0, [vb]),
                refs.adapter_gap(new, ps, second, 1.0))
    print(f"SGLang in flight ({mode}): {mixed}/{len(ps)} samples span both versions, "
          f"max |engine - learner| = {worst:.2e}")
    assert worst < 1e-3
    if mode == "keep":  # each of the first requests finished on the adapter it started with
        assert all((c.versions == va).all() for c in first)
    else:
        assert mixed > 0
    assert engine.loaded_adapters() == {engine._adapter}


def test_adapter_on_the_tied_head_matches_learner(engine, tiny_model_dir):
    """An adapter on `lm_head` of the tied tiny model (with the seven projections: SGLang
    packs q, k, v and gate, up, so it wants all of them), in the engine started with those
    targets: SGLang gives the head a LoRA layer of its own that shares the embedding's weight,
    so its logprobs are the learner's."""
    engine.update_mode = "keep"
    refs.check_tied_head_adapter(engine, tiny_model_dir, LORA_HEAD, "SGLang")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_run_with_an_sglang_actor(tmp_path, tiny_model_dir):
    """The whole path: learner (LoRA) + one SGLang actor process; the actor loads the base once
    and then only adapters, the run finishes with its accounting balanced."""
    import procs

    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "actors.num_local=1", "learner.max_steps=20",
                       "learner.checkpoint_every=0", "learner.lora.rank=8",
                       "learner.lora.alpha=16", "learner.lr=3e-3",
                       preset=procs.ROOT / "configs" / "toy_reverse_sglang.yaml")
    s = procs.finish_clean(lp, run, steps=20, timeout=800)
    print("SGLang LoRA run: held-out", s["eval_reward_start"], "->", s["eval_reward_end"])
    (log,) = [p.read_text() for p in (run / "logs").glob("actor-*.log")]
    assert "SGLangEngine" in log
    assert log.count("loaded the base weights") == 1
    assert log.count("(adapter, ") >= 5 and "(full, " not in log
