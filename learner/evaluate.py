"""Held-out evaluation: one sampled rollout per held-out prompt, through the configured agent
(so a tool-use task is evaluated with its tools), mean reward."""

from __future__ import annotations

import asyncio

from actors.agents.registry import make_agent
from actors.rollout import RolloutTask
from actors.engines.client import EngineClient
from actors.engines.hf import HFEngine
from configs.schema import TetherConfig


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
        return [r.reward for r in rollouts]

    rewards = asyncio.run(run_all())
    return sum(rewards) / len(rewards)
