"""Held-out evaluation: one sampled completion per held-out prompt, mean reward."""

from __future__ import annotations

from actors.engine import GenerateRequest, sample_seed
from actors.hf_engine import HFEngine
from configs.schema import TetherConfig


def evaluate(engine: HFEngine, task, cfg: TetherConfig) -> float:
    prompts = task.eval_prompts(cfg.task.eval_prompts)
    reqs = [GenerateRequest(p.token_ids, cfg.task.max_new_tokens, cfg.task.temperature,
                            sample_seed(cfg.learner.seed + 12345, p.prompt_id, 0))
            for p in prompts]
    outs = engine.generate(reqs)
    return sum(task.reward(p.meta, o.token_ids) for p, o in zip(prompts, outs)) / len(prompts)
