"""Held-out evaluation: one sampled rollout per held-out prompt, through the configured agent
(so a tool-use task is evaluated with its tools), mean reward. With model scorers in
`task.scorers` the learner scores the rollouts itself, with the same scorers built in its own
process for the evaluation (batches of `scoring.batch_size`; judges on the HF engine), not
through the fleet.

A rollout that raises (a bug in an agent, a client gone) is counted, logged (the first three)
with its error, and left out of the mean, as an actor drops such a sample: it never ends the run.

Every evaluation of a process runs on one event loop, as every rollout of an actor does (`LOOP`):
agent libraries keep async HTTP clients process-wide (openai-agents' shared httpx client,
langchain-openai's per base URL, pydantic-ai's), bound to the loop that first used them. With a
fresh loop per evaluation (asyncio.run), the final evaluation's rollouts failed with "Event loop
is closed" (openai 3.x) or printed its tracebacks. The endpoint of each evaluation is closed on
that loop when it ends."""

from __future__ import annotations

import asyncio
import atexit
import logging
from dataclasses import dataclass

from actors.agents.registry import make_agent, served_endpoint
from actors.rollout import RolloutTask
from actors.engines.client import EngineClient
from actors.engines.hf import HFEngine
from configs.schema import TetherConfig, model_scorers

log = logging.getLogger(__name__)

LOOP = asyncio.Runner()
"""The evaluations' event loop (made on first use, closed at exit; see the module docstring)."""
atexit.register(LOOP.close)


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

    async def run_all() -> tuple[list, list, list[float]]:
        client = EngineClient(engine)
        rollouts = await asyncio.gather(*(agent.run(t, client) for t in tasks),
                                        return_exceptions=True)
        if (endpoint := served_endpoint(agent)) is not None:
            await endpoint.close_server()
        pairs = [(t, r) for t, r in zip(tasks, rollouts) if not isinstance(r, BaseException)]
        failed = [(t, r) for t, r in zip(tasks, rollouts) if isinstance(r, BaseException)]
        rewards = [r.reward for _, r in pairs]
        if model_scorers(cfg) and pairs:
            rewards = await _add_model_scores(cfg, tokenizer, *zip(*pairs), rewards)
        return pairs, failed, rewards

    pairs, failed, rewards = LOOP.run(run_all())
    for t, e in failed[:3]:
        log.warning("held-out rollout of prompt %d failed (counted, left out of the mean): %r",
                    t.prompt_id, e)
    reward_failures = sum(any(r.scores.get(f) for f in ("reward_error", "reward_timeout"))
                          for _, r in pairs)
    return Evaluation(sum(rewards) / len(rewards) if rewards else None, len(failed), len(tasks),
                      reward_failures)


def evaluate(engine: HFEngine, task, cfg: TetherConfig, tokenizer) -> float | None:
    """The mean held-out reward alone (see `held_out`)."""
    return held_out(engine, task, cfg, tokenizer).reward


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
