"""Held-out evaluation: one sampled rollout per held-out prompt, through the configured agent
(so a tool-use task is evaluated with its tools), mean reward. With model scorers in
`task.scorers` the learner scores the rollouts itself, with the same scorers built in its own
process for the evaluation (batches of `scoring.batch_size`; judges on the HF engine), not
through the fleet."""

from __future__ import annotations

import asyncio

from actors.agents.registry import make_agent
from actors.rollout import RolloutTask
from actors.engines.client import EngineClient
from actors.engines.hf import HFEngine
from configs.schema import TetherConfig, model_scorers


def evaluate(engine: HFEngine, task, cfg: TetherConfig, tokenizer) -> float:
    """Blocks while it generates; every sample is seeded from (seed + 12345, prompt id)."""
    prompts = task.eval_prompts(cfg.task.eval_prompts)
    agent = make_agent(cfg, task, tokenizer)
    tasks = [RolloutTask(prompt_id=p.prompt_id, sample_index=0, prompt_ids=p.token_ids,
                         meta=p.meta, max_new_tokens=cfg.task.max_new_tokens,
                         temperature=cfg.task.temperature, run_seed=cfg.learner.seed + 12345)
             for p in prompts]

    async def run_all() -> list[float]:
        client = EngineClient(engine)
        rollouts = await asyncio.gather(*(agent.run(t, client) for t in tasks))
        rewards = [r.reward for r in rollouts]
        if model_scorers(cfg):
            rewards = await _add_model_scores(cfg, tokenizer, tasks, rollouts, rewards)
        return rewards

    rewards = asyncio.run(run_all())
    return sum(rewards) / len(rewards)


async def _add_model_scores(cfg: TetherConfig, tokenizer, tasks, rollouts, rewards) -> list[float]:
    from actors.scorer import build_scorers, score_items
    from tasks.scorers import make_item

    scorers = await build_scorers(cfg, judge_engine_kind="hf")
    weights = {s.name: s.weight for s in scorers}
    items = [make_item(tokenizer, t.meta, t.prompt_ids, r.completion_ids)
             for t, r in zip(tasks, rollouts)]
    n = cfg.scoring.batch_size
    out = list(rewards)
    try:
        for lo in range(0, len(items), n):
            for i, scores in enumerate(await score_items(scorers, items[lo:lo + n]), start=lo):
                out[i] += sum(weights[k] * (0.0 if v != v else v) for k, v in scores.items())
    finally:
        for s in scorers:
            await s.close()
    return out
