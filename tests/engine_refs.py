"""Shared engine checks, run against vLLM (tests/test_vllm.py, tests/test_real_model.py) and
SGLang (tests/test_sglang.py, tests/test_sglang_real_model.py) alike. Reference logprobs come
from the learner's own code path (models.logprobs) on an HF model holding the same weights as
the engine under test. An engine here is one of `started_engine`'s: its event loop is `.loop`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile

import numpy as np
import torch


@contextlib.contextmanager
def started_engine(make_engine):
    """The engine `make_engine()` builds (blocking: run in a worker thread) with its own event
    loop as `.loop`; shut down on exit, the engine's output loop cancelled while the loop lives.
    The files the engine puts in the temp dir as it starts (its ipc sockets) go to a directory
    of its own, removed on exit, as an actor's engine's go to the actor's scratch dir."""
    import torch._inductor.codecache  # noqa: F401  (below)

    from actors import forked
    from actors.scratch import inductor_default_cache_dir

    forked.enable()  # its children fork as an actor's do (the tests run one torch thread)
    # torch inductor's caches stay where they are: its compile cache by TORCHINDUCTOR_CACHE_DIR
    # (as in an actor), its precompiled headers by importing codecache first, which fixes their
    # directory from the temp dir at import (imported during an engine's start, it put them in
    # that engine's directory for good: a later compile in this process re-made it)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_default_cache_dir())
    # removed on exit, also when the engine fails to start; files of engine processes still
    # ending are no error
    with tempfile.TemporaryDirectory(prefix="tether-test-engine-",
                                     ignore_cleanup_errors=True) as scratch:
        loop = asyncio.new_event_loop()
        before, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            engine = loop.run_until_complete(asyncio.to_thread(make_engine))
        finally:
            tempfile.tempdir = before
        engine.loop = loop
        try:
            yield engine
        finally:
            engine.shutdown()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()


def hf_model(model_dir, state):
    from transformers import AutoModelForCausalLM

    from models.tied import load_state

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_state(model, state, "test weights")
    return model


def noisy_state(model_dir, noise: float = 0.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded Gaussian noise (a tied head left out, as the learner sends)."""
    from transformers import AutoModelForCausalLM

    from models.tied import without_tied

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {k: v.detach() + noise * torch.randn(v.shape, generator=g)
            for k, v in without_tied(model.state_dict().items(), model.config.tie_word_embeddings)}


def prompts(model_dir, n):
    from configs.schema import TaskConfig
    from models.tiny import load_tokenizer
    from tasks import make_task

    task = make_task(TaskConfig(name="reverse", num_digits=4), load_tokenizer(model_dir), seed=3)
    return [task.train_prompt(i).token_ids for i in range(n)]


def reference(model, prompt, completion, temperature):
    """The learner's logprobs of `completion` after `prompt` at `temperature`."""
    from models.logprobs import token_logprobs

    ids = torch.from_numpy(np.concatenate([prompt, completion]).astype(np.int64))[None]
    with torch.no_grad():
        return token_logprobs(model, ids, temperature)[0, len(prompt) - 1:].numpy()


async def load_async(engine, state, version):
    """Publish `state` as `version` in 64 KiB buckets (the bucketed path: several of them)."""
    from transport.weights import pack

    packed = pack(state, version, bucket_bytes=64 * 1024)
    assert packed.manifest.num_buckets > 1
    await engine.load_packed(packed.manifest, list(packed.buckets))


def load(engine, state, version):
    engine.loop.run_until_complete(load_async(engine, state, version))


def generate(engine, prompts, max_new, temperature):
    async def run():
        return await asyncio.gather(*(engine.generate(p, max_new, temperature, seed=i)
                                      for i, p in enumerate(prompts)))
    return engine.loop.run_until_complete(run())


def check_logprobs_then_after_update(engine, model_dir, temperature):
    """Behavior logprobs equal the learner's (< 1e-3) for one version, then for a perturbed one."""
    ps = prompts(model_dir, 16)
    for version, noise in ((10, 0.0), (11, 0.05)):
        state = noisy_state(model_dir, noise, seed=version)
        load(engine, state, version)
        model = hf_model(model_dir, state)
        worst = 0.0
        for p, c in zip(ps, generate(engine, ps, 5, temperature)):
            assert len(c.token_ids) >= 1 and (c.versions == version).all()
            worst = max(worst, float(np.abs(reference(model, p, c.token_ids, temperature)
                                            - c.logprobs).max()))
        print(f"T={temperature} v{version}: max |engine - learner| = {worst:.2e}")
        assert worst < 1e-3, f"v{version}: engine vs learner logprobs differ by {worst}"


def generate_across_update(engine, ps, max_new_tokens: int, update, after=None):
    """Sample from every prompt (seed 100 + i, T = 1); once the engine has produced about two
    tokens per request, await `update()`, then `after()` if given (requests made after the
    update, while the first ones still run). Returns (the first completions, after's result)."""
    started = asyncio.Event()
    target = engine.tokens_out + 2 * len(ps)
    engine.on_tokens = lambda n: started.set() if n >= target else None

    async def run():
        tasks = [asyncio.create_task(engine.generate(p, max_new_tokens, 1.0, seed=100 + i))
                 for i, p in enumerate(ps)]
        await started.wait()
        await update()
        later = await after() if after is not None else None
        return await asyncio.gather(*tasks), later

    try:
        return engine.loop.run_until_complete(run())
    finally:
        engine.on_tokens = None


def check_inflight_update(engine, model_dir, mode):
    """Long samples from random weights A; once every request has started, weights B land.
    keep/abort: some samples switch version mid-sequence and each token's logprob matches the
    weights of its own version; wait: no sample mixes versions."""
    engine.update_mode = mode
    k = ("keep", "abort", "wait").index(mode)
    a, b = noisy_state(model_dir, 0.5, seed=1), noisy_state(model_dir, 0.5, seed=2)
    va, vb = 20 + 2 * k, 21 + 2 * k
    load(engine, a, va)
    ps = prompts(model_dir, 24)
    outs, _ = generate_across_update(engine, ps, 48, lambda: load_async(engine, b, vb))
    models = {va: hf_model(model_dir, a), vb: hf_model(model_dir, b)}
    mixed = 0
    for p, c in zip(ps, outs):
        assert set(np.unique(c.versions)) <= {va, vb}
        assert (np.diff(c.versions) >= 0).all(), "versions must not go back within a sample"
        mixed += len(set(c.versions.tolist())) > 1
        for v, model in models.items():
            sel = c.versions == v
            if sel.any():
                ref = reference(model, p, c.token_ids, 1.0)
                diff = float(np.abs(ref[sel] - c.logprobs[sel]).max())
                assert diff < 1e-3, f"{mode}: tokens of v{v} differ from v{v} weights by {diff}"
    print(f"{mode}: {mixed} of {len(ps)} samples straddle the update")
    if mode == "wait":
        assert mixed == 0
    else:
        assert mixed >= 1, f"{mode}: no sample straddled the update"


def load_lora_base(engine, backend) -> None:
    """A LoRA run's base, as an actor gets it once per learner run."""
    from transport.weights import pack

    base = pack(backend.named_full_tensors(), -1, 64 * 1024, kind="base")
    engine.loop.run_until_complete(engine.load_packed(base.manifest, list(base.buckets)))


def publish_adapter(engine, backend, version):
    """The awaitable that loads `backend`'s adapter into `engine` as `version`."""
    from transport.weights import pack

    packed = pack(backend.named_adapter_tensors(), version, 4096, kind="adapter",
                  lora=backend.lora)
    return engine.load_packed(packed.manifest, list(packed.buckets))


def adapter_gap(backend, prompts, outs, temperature, versions=None) -> float:
    """Largest |engine - learner| logprob gap of completions sampled under `backend`'s adapter
    (over the tokens of `versions` only, if given)."""
    worst = 0.0
    for p, c in zip(prompts, outs):
        ids = torch.from_numpy(np.concatenate([p, c.token_ids]).astype(np.int64))[None]
        with torch.no_grad():
            ref = backend.logprobs(ids, temperature)[0, len(p) - 1:].numpy()
        sel = np.ones(len(c.token_ids), bool) if versions is None else np.isin(c.versions, versions)
        if sel.any():
            worst = max(worst, float(np.abs(ref[sel] - c.logprobs[sel]).max()))
    return worst


def check_tied_head_adapter(engine, model_dir, lora, name: str) -> None:
    """Adapters with `lm_head` among `lora`'s targets (the tiny model's head is tied), versions
    20 and 21: every token is labelled with its version and its logprob is the learner's."""
    from learner.backends.single import SingleProcessBackend

    backend = SingleProcessBackend(model_dir, 3e-2, 0.0, 0, lora=lora)
    assert "lm_head.lora_B.weight" in backend.adapter_state()
    ps = prompts(model_dir, 16)
    for version in (20, 21):
        train_adapter(backend, model_dir, 5)
        engine.loop.run_until_complete(publish_adapter(engine, backend, version))
        outs = generate(engine, ps, 5, 1.0)
        assert all((c.versions == version).all() for c in outs)
        worst = adapter_gap(backend, ps, outs, 1.0)
        print(f"{name} LoRA with lm_head v{version}: max |engine - learner| = {worst:.2e}")
        assert worst < 1e-3


def train_adapter(backend, model_dir, steps: int) -> None:
    """`steps` optimizer steps of `backend` on a fixed loss (the logprob of a fixed batch)."""
    ids = torch.from_numpy(np.stack([np.concatenate([p, p[:3]])
                                     for p in prompts(model_dir, 4)]).astype(np.int64))
    for _ in range(steps):
        backend.step(-backend.logprobs(ids, 1.0).mean(), max_grad_norm=1.0)


def real_model_gaps(make_engine, model_dir) -> dict[int, float]:
    """The real-model check shared by the vLLM and SGLang lanes: versions 0 and 1 of a learner's
    weights (one real optimizer step between them, raising the sampled completions' logprobs)
    through the engine `make_engine()` builds (blocking; run in a worker thread); per version the
    largest |engine - learner| behavior logprob over 6 additions prompts, 12 tokens at T = 0.7."""
    from configs.schema import TaskConfig
    from learner.backends.single import SingleProcessBackend
    from models.tiny import load_tokenizer
    from tasks import make_task
    from transport.weights import pack

    task = make_task(TaskConfig(name="additions", num_digits=1), load_tokenizer(model_dir))
    ps = [task.train_prompt(i).token_ids for i in range(6)]
    backend = SingleProcessBackend(model_dir, lr=1e-4, weight_decay=0.0, seed=0)

    worst = {}
    with started_engine(make_engine) as engine:
        for version in (0, 1):
            packed = pack(backend.state_dict(), version, bucket_bytes=32 * 2**20)
            engine.loop.run_until_complete(engine.load_packed(packed.manifest, list(packed.buckets)))
            rows, diffs = [], []
            for p, c in zip(ps, generate(engine, ps, 12, 0.7)):
                assert len(c.token_ids) >= 1 and (c.versions == version).all()
                ids = torch.from_numpy(np.concatenate([p, c.token_ids]).astype(np.int64))[None]
                with torch.no_grad():
                    ref = backend.logprobs(ids, 0.7)[0, len(p) - 1:].numpy()
                diffs.append(float(np.abs(ref - c.logprobs).max()))
                rows.append(ids)
            worst[version] = max(diffs)
            if version == 0:  # one real learner update
                loss = -sum(backend.logprobs(ids, 0.7)[0, len(p) - 1:].mean()
                            for ids, p in zip(rows, ps)) / len(rows)
                backend.step(loss, max_grad_norm=1.0)
    return worst


def smollm2_preset_run(tmp_path, model_dir, *overrides: str, steps: int = 3):
    """The smollm2_add preset for `steps` small steps with one local actor (`overrides` pick its
    engine), checked as a clean eta = 1 run that applied new weights and scored every rollout
    with the reward pool's named scores. Returns (summary, metrics rows, the actor's log)."""
    import procs

    run = tmp_path / "run"
    lp = procs.learner(run, model_dir, f"learner.max_steps={steps}", "learner.prompts_per_step=2",
                       "learner.group_size=4", "task.eval_prompts=8", "task.max_new_tokens=16",
                       "actors.groups_per_request=2", "buffer.capacity_groups=8", *overrides,
                       preset=procs.ROOT / "configs" / "smollm2_add.yaml")
    s = procs.finish_clean(lp, run, steps, timeout=1700)
    rows = procs.metrics(run)
    # eta = 1: the last step trains on samples of version >= 1, so the actor took new weights
    assert rows[-1]["staleness_max"] <= 1
    log = (run / "logs" / "actor-0.log").read_text()
    assert "loaded weights v1" in log, log[-3000:]
    sc = s["reward_scores"]
    assert sc["samples"] == sum(s["rollout_ends"].values()) > 0
    assert sc["reward_timeout"] == 0 and sc["reward_error"] == 0
    assert 0 <= sc["correct"] <= sc["samples"]
    # named scores: the mean over the rollouts that arrived since the previous step (a step with
    # none, possible at eta = 1, has no score of its own)
    assert any(r["rollouts"] > 0 for r in rows)
    assert all("score_correct" in r and "score_tokens" in r for r in rows if r["rollouts"] > 0)
    assert (run / "final_model" / "chat_template.jinja").exists()
    print("summary:", {k: s[k] for k in ("eval_reward_start", "eval_reward_end", "wall_seconds")},
          "train_s:", [round(r["train_s"], 1) for r in rows])
    return s, rows, log


def check_streamed_load(engine, model_dir):
    """`transport.weight_load: streamed` at the engine (streaming.py begin_load / load_bucket /
    end_load), update_mode keep: requests running when the stream begins are held until its
    last bucket, then go on with the new weights; a stream that stops part-way leaves the
    engine closed with version -1, and a request submitted then runs only once a whole version
    is in. Every token's logprob matches the weights of the version it is labelled with."""
    from transport.weights import pack

    engine.update_mode = "keep"
    states = {v: noisy_state(model_dir, 0.5, seed=v) for v in (40, 41, 42)}
    packed = {v: pack(s, v, bucket_bytes=64 * 1024) for v, s in states.items()}
    assert packed[42].manifest.num_buckets > 2
    load(engine, states[40], 40)

    async def stream(version, stop_after=None):
        man, buckets = packed[version].manifest, packed[version].buckets
        await engine.begin_load(man)
        assert engine.version == -1
        for i in range(man.num_buckets if stop_after is None else stop_after):
            await engine.load_bucket(man, i, buckets[i])
        if stop_after is None:
            await engine.end_load(man)

    ps = prompts(model_dir, 8)
    outs, _ = generate_across_update(engine, ps, 32, lambda: stream(41))
    assert engine.version == 41

    async def broken_then_whole():
        await stream(42, stop_after=2)
        assert engine.version == -1
        held = asyncio.ensure_future(engine.generate(ps[0], 8, 1.0, seed=7))
        await stream(42)
        return await held

    late = engine.loop.run_until_complete(broken_then_whole())
    assert (late.versions == 42).all(), "a request ran on a half-loaded model"
    models = {v: hf_model(model_dir, s) for v, s in states.items()}
    mixed = 0
    for p, c in [*zip(ps, outs), (ps[0], late)]:
        assert set(np.unique(c.versions)) <= {40, 41, 42}
        mixed += len(set(c.versions.tolist())) > 1
        for v, model in models.items():
            sel = c.versions == v
            if sel.any():
                diff = float(np.abs(reference(model, p, c.token_ids, 1.0)[sel]
                                    - c.logprobs[sel]).max())
                assert diff < 1e-3, f"tokens of v{v} differ from v{v} weights by {diff}"
    assert mixed >= 1, "no sample straddled the streamed update"
