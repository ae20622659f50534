"""The scorers family: the reward as a weighted sum of named scorers (`task.scorers`).

    function    tasks/scorers/function.py    an import-path reward, in the actors' process pools
    classifier  tasks/scorers/classifier.py  an HF sequence-classification model, batched
    judge       tasks/scorers/judge.py       a generative judge on a Tether engine (hf | vllm)
    remote      tasks/scorers/remote.py      an OpenAI-compatible endpoint, bounded concurrency

The model kinds run in the scorer fleet (actors/scorer.py, brokered by learner/scoring.py);
`MODEL_BUILDERS` is the one table from a kind's section type to its implementation. The
settings are configs/scorers.py; the protocol is tasks/scorers/base.py.
"""

from __future__ import annotations

import math

from configs.scorers import ClassifierScorer, FunctionScorer, JudgeScorer, RemoteScorer
from tasks.scorers.base import Item, ModelScorer, make_item


async def _classifier(cfg: ClassifierScorer, device: str, engines) -> ModelScorer:
    import asyncio

    from tasks.scorers.classifier import Classifier

    return await asyncio.to_thread(Classifier, cfg, device)


async def _judge(cfg: JudgeScorer, device: str, engines) -> ModelScorer:
    from tasks.scorers.judge import Judge

    llm, tokenizer, close = await engines(cfg, device)
    return Judge(cfg, llm, tokenizer, close)


async def _remote(cfg: RemoteScorer, device: str, engines) -> ModelScorer:
    from tasks.scorers.remote import Remote

    return Remote(cfg)


MODEL_BUILDERS = {ClassifierScorer: _classifier, JudgeScorer: _judge, RemoteScorer: _remote}
"""Section type -> async builder(section, device, engines): the model scorers. `await
engines(section, device)` gives (LLMClient, tokenizer, close) for a judge: the role that runs
scorers provides it (actors/scorer.py judge_engine), since engines live above this layer."""


async def make_model_scorer(cfg, device: str, engines=None) -> ModelScorer:
    """The model scorer of section `cfg`, built in the running event loop (its model loads in
    a worker thread)."""
    return await MODEL_BUILDERS[type(cfg)](cfg, device, engines)


def function_scorers(scorers: list) -> list[FunctionScorer]:
    return [s for s in scorers if isinstance(s, FunctionScorer)]


def model_sections(scorers: list) -> list:
    return [s for s in scorers if type(s) in MODEL_BUILDERS]


def weighted(scorer: ModelScorer, value: float) -> tuple[float, dict[str, float]]:
    """A model score -> (its share of the reward, its named scores): NaN (unreadable) counts 0
    and is flagged `<name>_unparsed`."""
    bad = math.isnan(value)
    v = 0.0 if bad else value
    named = {scorer.name: v}
    if bad:
        named[f"{scorer.name}_unparsed"] = 1.0
    return scorer.weight * v, named


def agent_reward(task_cfg, task, tokenizer):
    """The reward an agent computes in the actor: the task's reward (or `task.reward`, today's
    path, unchanged) without `task.scorers`; with them, the weighted sum of the function scorers
    (0 when there are none: the fleet adds the model scorers' part at the learner)."""
    if not task_cfg.scorers:
        return task.reward
    functions = function_scorers(task_cfg.scorers)
    if not functions:
        return _no_function_part
    from tasks.scorers.function import FunctionScorers

    return FunctionScorers(functions, task, tokenizer).reward


def _no_function_part(meta, completion_ids) -> float:
    return 0.0


__all__ = ["agent_reward", "Item", "ModelScorer", "MODEL_BUILDERS", "make_item", "make_model_scorer",
           "function_scorers", "model_sections", "weighted"]
