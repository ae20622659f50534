"""Reference logprobs for engine tests: the learner's own code path on an HF model holding the
same weights as the engine under test (used by tests/test_sglang.py; the same checks as
tests/test_vllm.py), and the real-model checks of both engines (`real_model_gaps`, `smollm2_preset_run`)."""

from __future__ import annotations

import numpy as np
import torch


def hf_model(model_dir, state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def noisy_state(model_dir, noise: float = 0.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded Gaussian noise (tied lm_head left out, as the learner sends)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return {k: v.detach() + noise * torch.randn(v.shape, generator=g)
            for k, v in model.state_dict().items() if k != "lm_head.weight"}


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


def real_model_gaps(make_engine, model_dir) -> dict[int, float]:
    """The real-model check shared by the vLLM and SGLang lanes: versions 0 and 1 of a learner's
    weights (one real optimizer step between them, raising the sampled completions' logprobs)
    through the engine `make_engine()` builds (blocking; run in a worker thread); per version the
    largest |engine - learner| behavior logprob over 6 additions prompts, 12 tokens at T = 0.7."""
    import asyncio

    from configs.schema import TaskConfig
    from learner.backend import SingleProcessBackend
    from models.tiny import load_tokenizer
    from tasks import make_task
    from transport.weights import pack

    task = make_task(TaskConfig(name="additions", num_digits=1), load_tokenizer(model_dir))
    prompts = [task.train_prompt(i).token_ids for i in range(6)]
    backend = SingleProcessBackend(model_dir, lr=1e-4, weight_decay=0.0, seed=0)

    async def generate(engine):
        return await asyncio.gather(*(engine.generate(p, 12, 0.7, seed=i)
                                      for i, p in enumerate(prompts)))

    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(asyncio.to_thread(make_engine))
    try:
        worst = {}
        for version in (0, 1):
            packed = pack(backend.state_dict(), version, bucket_bytes=32 * 2**20)
            loop.run_until_complete(engine.load_packed(packed.manifest, list(packed.buckets)))
            rows, diffs = [], []
            for p, c in zip(prompts, loop.run_until_complete(generate(engine))):
                assert len(c.token_ids) >= 1 and (c.versions == version).all()
                ids = torch.from_numpy(np.concatenate([p, c.token_ids]).astype(np.int64))[None]
                with torch.no_grad():
                    ref = backend.logprobs(ids, 0.7)[0, len(p) - 1:].numpy()
                diffs.append(float(np.abs(ref - c.logprobs).max()))
                rows.append(ids)
            worst[version] = max(diffs)
            if version == 0:  # one real learner update
                loss = -sum(backend.logprobs(ids, 0.7)[0, len(p) - 1:].mean()
                            for ids, p in zip(rows, prompts)) / len(rows)
                backend.step(loss, max_grad_norm=1.0)
        return worst
    finally:
        engine.shutdown()
        pending = asyncio.all_tasks(loop)  # the engine's output loop: cancel it while the loop lives
        for t in pending:
            t.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


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
