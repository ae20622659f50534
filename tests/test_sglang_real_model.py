"""SGLang on the real pretrained model (SmolLM2-135M-Instruct, float32, converted by
`models.fetch`), in the SGLang lane: its behavior logprobs equal the learner's recomputation
before and after a real optimizer step, and the smollm2_add preset runs a few steps end to end
with an SGLang actor (the same checks as tests/test_real_model.py does for vLLM)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("sglang", reason="SGLang is tested in its own lane (scripts/env_sglang.sh)")

import torch  # noqa: E402

pytestmark = pytest.mark.sglang

KV_TOKENS = 4096
"""SGLang's KV cache for these tests (tokens): a few dozen short requests."""


def test_logprobs_match_learner_before_and_after_one_update(smollm2_dir):
    from actors.sglang_engine import SGLangEngine
    from configs.schema import TaskConfig
    from learner.backend import SingleProcessBackend
    from models.tiny import load_tokenizer
    from tasks import make_task
    from transport.weights import pack

    task = make_task(TaskConfig(name="additions", num_digits=1), load_tokenizer(smollm2_dir))
    prompts = [task.train_prompt(i).token_ids for i in range(6)]
    backend = SingleProcessBackend(smollm2_dir, lr=1e-4, weight_decay=0.0, seed=0)
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(asyncio.to_thread(SGLangEngine, smollm2_dir, "keep", 0,
                                                       KV_TOKENS, 0.0))
    try:
        worst = {}
        for version in (0, 1):
            packed = pack(backend.state_dict(), version, bucket_bytes=32 * 2**20)
            assert packed.manifest.num_buckets > 1  # the bucketed path
            loop.run_until_complete(engine.load_packed(packed.manifest, list(packed.buckets)))
            outs = loop.run_until_complete(_generate(engine, prompts))
            rows, diffs = [], []
            for p, c in zip(prompts, outs):
                assert len(c.token_ids) >= 1 and (c.versions == version).all()
                ids = torch.from_numpy(np.concatenate([p, c.token_ids]).astype(np.int64))[None]
                with torch.no_grad():
                    ref = backend.logprobs(ids, 0.7)[0, len(p) - 1:].numpy()
                diffs.append(float(np.abs(ref - c.logprobs).max()))
                rows.append(ids)
            worst[version] = max(diffs)
            if version == 0:  # one real learner update: raise the sampled completions' logprobs
                loss = -sum(backend.logprobs(ids, 0.7)[0, len(p) - 1:].mean()
                            for ids, p in zip(rows, prompts)) / len(rows)
                backend.step(loss, max_grad_norm=1.0)
        print(f"max |SGLang - learner| logprob: v0 {worst[0]:.2e}, v1 {worst[1]:.2e}")
        assert worst[0] < 1e-3 and worst[1] < 1e-3, worst
    finally:
        engine.shutdown()
        pending = asyncio.all_tasks(loop)  # SGLang's output loop: cancel it while the loop lives
        for t in pending:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


async def _generate(engine, prompts):
    return await asyncio.gather(*(engine.generate(p, 12, 0.7, seed=i) for i, p in enumerate(prompts)))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_preset_runs_end_to_end_on_sglang(tmp_path, smollm2_dir):
    import procs

    run = tmp_path / "run"
    steps = 3
    lp = procs.learner(run, smollm2_dir, f"learner.max_steps={steps}", "learner.prompts_per_step=2",
                       "learner.group_size=4", "task.eval_prompts=8", "task.max_new_tokens=16",
                       "actors.groups_per_request=2", "actors.engine=sglang",
                       f"actors.sglang_max_total_tokens={KV_TOKENS}", "buffer.capacity_groups=8",
                       preset=procs.ROOT / "configs" / "smollm2_add.yaml")
    s = procs.finish_clean(lp, run, steps, timeout=1700)
    rows = procs.metrics(run)
    assert rows[-1]["staleness_max"] <= 1  # eta = 1
    log = (run / "logs" / "actor-0.log").read_text()
    assert "SGLangEngine" in log and "loaded weights v1" in log, log[-3000:]
    sc = s["reward_scores"]
    assert sc["samples"] == sum(s["rollout_ends"].values()) > 0
    assert sc["reward_timeout"] == 0 and sc["reward_error"] == 0
    # step 1 trains on version-0 samples with the version-0 weights: the learner's recomputed
    # logprobs equal SGLang's, so every importance weight is 1 up to float error
    assert abs(rows[0]["is_weight_max"] - 1) < 1e-2 and abs(rows[0]["kl_behavior_prox_k3"]) < 1e-4, rows[0]
    print("summary:", {k: s[k] for k in ("eval_reward_start", "eval_reward_end", "wall_seconds")},
          "train_s:", [round(r["train_s"], 1) for r in rows])
