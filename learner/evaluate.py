"""Held-out evaluation: one sampled rollout per held-out prompt, through the configured agent
(so a tool-use task is evaluated with its tools), mean reward.

A rollout that raises (a bug in an agent, a client gone) is counted, logged once with its
error, and left out of the mean, as an actor drops such a sample: it never ends the run."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from actors.agents import make_agent
from actors.rollout import RolloutTask
from actors.client import EngineClient
from actors.hf_engine import HFEngine
from configs.schema import TetherConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    reward: float | None
    """Mean reward of the rollouts that completed (None: none did)."""
    errors: int
    """Rollouts that raised."""
    prompts: int
    reward_failures: int = 0
    """Completed rollouts whose reward call failed (error or timeout; scored 0)."""

    def __str__(self) -> str:
        reward = "n/a" if self.reward is None else f"{self.reward:.3f}"
        return reward + (f" ({self.errors} of {self.prompts} rollouts failed)" if self.errors
                         else "")


def held_out(engine: HFEngine, task, cfg: TetherConfig, tokenizer) -> Evaluation:
    """Blocks while it generates; every sample is seeded from (seed + 12345, prompt id)."""
    prompts = task.eval_prompts(cfg.task.eval_prompts)
    agent = make_agent(cfg, task, tokenizer)
    tasks = [RolloutTask(prompt_id=p.prompt_id, sample_index=0, prompt_ids=p.token_ids,
                         meta=p.meta, max_new_tokens=cfg.task.max_new_tokens,
                         temperature=cfg.task.temperature, run_seed=cfg.learner.seed + 12345)
             for p in prompts]

    async def run_all() -> list:
        client = EngineClient(engine)
        return await asyncio.gather(*(agent.run(t, client) for t in tasks),
                                    return_exceptions=True)

    rollouts = asyncio.run(run_all())
    failed = [(t, r) for t, r in zip(tasks, rollouts) if isinstance(r, BaseException)]
    for t, e in failed[:3]:
        log.warning("held-out rollout of prompt %d failed (counted, left out of the mean): %r",
                    t.prompt_id, e)
    done = [r for r in rollouts if not isinstance(r, BaseException)]
    rewards = [r.reward for r in done]
    reward_failures = sum(any(r.scores.get(f) for f in ("reward_error", "reward_timeout"))
                          for r in done)
    return Evaluation(sum(rewards) / len(rewards) if rewards else None, len(failed), len(tasks),
                      reward_failures)


def evaluate(engine: HFEngine, task, cfg: TetherConfig, tokenizer) -> float | None:
    """The mean held-out reward alone (see `held_out`)."""
    return held_out(engine, task, cfg, tokenizer).reward
