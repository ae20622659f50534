"""Held-out evaluation: one sampled rollout per held-out prompt, through the configured agent
(so a tool-use task is evaluated with its tools), mean reward.

On the fleet (the learner's runs, `Evaluations`): the learner queues one evaluation lease per
held-out prompt for the version it evaluates (learner/leases.py `add_eval`); actors serve them
before training work, with the same seeds as the local path (run seed + 12345, sample 0), and
their results come back on the trajectory channel, where the learner's I/O thread records them
here instead of in the replay buffer: never trained on. The learner holds no copy of the policy
for evaluation; its first step waits for the start round (so that round is sampled with exactly
its version), later steps never wait. Each round reports the versions that sampled its tokens.
With model scorers in `task.scorers`, each round's rollouts are scored at the run's end by the
learner (rank 0 alone, the other ranks gone), with the scorers built in its own process
(`Evaluations.rescore`: batches of `scoring.batch_size`; judges on the HF engine).

Locally (`held_out`, `evaluate`): an HF engine in this process, where no actor exists: the
learner-alone tools (scripts/algo_study.py, scripts/staleness_study.py), and a learner's end
round when every actor is gone (it loads the exported model, after the other ranks have left).
A rollout that raises (a bug in an agent, a client gone) is counted, logged (the first three)
with its error, and left out of the mean, as an actor drops such a sample: it never ends the run.

Every local evaluation of a process runs on one event loop, as every rollout of an actor does
(`LOOP`): agent libraries keep async HTTP clients process-wide (openai-agents' shared httpx
client, langchain-openai's per base URL, pydantic-ai's), bound to the loop that first used them.
With a fresh loop per evaluation (asyncio.run), the final evaluation's rollouts failed with
"Event loop is closed" (openai 3.x) or printed its tracebacks. The endpoint of each evaluation
is closed on that loop when it ends."""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
from dataclasses import dataclass, field

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


@dataclass
class EvalRound:
    """One evaluation of one policy version on the fleet."""

    version: int
    prompts: int
    rewards: dict[int, float] = field(default_factory=dict)
    """Evaluation lease id -> reward of its sample (a held-out prompt may be asked twice)."""
    errors: int = 0
    """Samples whose agent raised or whose result failed validation: counted, and left out of
    the mean (as in `held_out`)."""
    reward_failures: int = 0
    """Samples whose reward call failed (error or timeout; scored 0 by the actor)."""
    min_version: int | None = None
    max_version: int | None = None
    """The versions that sampled this round's tokens."""
    items: dict[int, tuple] = field(default_factory=dict)
    """Lease id -> (prompt, completion ids), for scoring by model scorers at the end."""

    def done(self) -> bool:
        return len(self.rewards) + self.errors >= self.prompts

    def result(self) -> dict:
        n = len(self.rewards)
        return {"version": self.version, "reward": sum(self.rewards.values()) / n if n else None,
                "samples": n, "prompts": self.prompts, "errors": self.errors,
                "reward_failures": self.reward_failures, "sampled_versions": [self.min_version, self.max_version], "where": "actors"}


class Evaluations:
    """The learner's evaluation rounds. Thread-safe: the I/O thread records results, the
    trainer thread opens rounds and waits for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rounds: dict[int, EvalRound] = {}

    def open(self, version: int, prompts: int) -> None:
        with self._cond:
            self._rounds[version] = EvalRound(version, prompts)

    def record(self, version: int, lease_id: int, reward: float, versions, error: bool,
               item: tuple | None = None, reward_failed: bool = False) -> None:
        """One evaluation lease's result (I/O thread); `item`: (prompt, completion ids)."""
        with self._cond:
            r = self._rounds[version]
            r.reward_failures += reward_failed
            if error:
                r.errors += 1
                self._cond.notify_all()
                return
            r.rewards[lease_id] = float(reward)
            if item is not None:
                r.items[lease_id] = item
            if len(versions):
                lo, hi = int(versions.min()), int(versions.max())
                r.min_version = lo if r.min_version is None else min(r.min_version, lo)
                r.max_version = hi if r.max_version is None else max(r.max_version, hi)
            self._cond.notify_all()

    def wait(self, version: int, timeout: float) -> bool:
        """Block until the round of `version` is complete or `timeout` passes; True if done."""
        deadline = time.monotonic() + timeout
        with self._cond:
            r = self._rounds[version]
            while not r.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def result(self, version: int) -> dict:
        with self._cond:
            return self._rounds[version].result()

    def rescore(self, version: int, cfg: TetherConfig, tokenizer) -> None:
        """Add the model scorers' weighted scores to the round's rewards (task.scorers; rank 0
        alone, at the end: the scorers are built in this process)."""
        from types import SimpleNamespace

        with self._cond:
            r = self._rounds[version]
            ids = list(r.items)
            tasks = [SimpleNamespace(meta=r.items[i][0].meta, prompt_ids=r.items[i][0].token_ids)
                     for i in ids]
            rollouts = [SimpleNamespace(completion_ids=r.items[i][1]) for i in ids]
            rewards = [r.rewards[i] for i in ids]
        scored = LOOP.run(_add_model_scores(cfg, tokenizer, tasks, rollouts, rewards))
        with self._cond:
            r.rewards.update(zip(ids, scored))


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
