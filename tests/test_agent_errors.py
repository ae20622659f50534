"""An agent that raises yields a failed group, counted with its reason; the actor lives on."""

from __future__ import annotations

import asyncio

import numpy as np

import procs
from actors.actor import Actor
from actors.rollout import Rollout, RolloutTask
from actors.engines.client import EngineClient
from actors.engines.simulated import SimulatedEngine
from configs.loader import load_config


class FlakyAgent:
    """Raises on every third prompt; otherwise one simulated generation."""

    async def run(self, task: RolloutTask, llm: EngineClient) -> Rollout:
        if task.prompt_id % 3 == 0 and task.sample_index == 1:
            raise RuntimeError("tool crashed")
        c = await llm.generate(task.prompt_ids, task.max_new_tokens, task.temperature, task.seed())
        return Rollout(c.token_ids, c.logprobs, c.versions, np.ones(len(c.token_ids), np.uint8), 0.5)


def test_agent_errors_are_dropped_with_reason_and_actor_survives(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "actors.num_local=0", "learner.max_steps=6",
                       "learner.prompts_per_step=4")
    lp.wait_for(r"learner listening", timeout=120)
    cfg = load_config(run / "config.yaml")
    actor = Actor(cfg, procs.json.loads((run / "endpoints.json").read_text())["control"], "flaky",
                  tmp_path / "cache")
    actor._build = lambda welcome: (EngineClient(SimulatedEngine(16, 0.0, 0.0)), FlakyAgent())
    assert asyncio.run(actor.run()) == 0  # ran until the learner said the run is over
    assert lp.finish(timeout=120) == 0, lp.tail()
    s = procs.summary(run)
    assert s["steps"] == 6
    assert s["groups"]["dropped"].get("agent_error", 0) >= 3
    assert s["accounting_ok"]
    assert any("agent error on actor flaky: RuntimeError: tool crashed" in ln for ln in lp.lines)
