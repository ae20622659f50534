"""Ecosystem environments as the task (`task.name: environment`): the environment's own dataset.

    task.environment = "package.module:ENV"      an object (or a zero-argument factory) with a
                                                 `rollout` and a `rubric` (the agent's side:
                                                 actors/agents/environment.py)

Optional attributes of the environment:

        dataset          its prompts: a list of row dicts (or a `datasets.Dataset`), each with
                         the prompt under `task.prompt_key` (a string or chat messages) and any
                         other columns (e.g. `answer`, `info`)
        eval_dataset     held-out rows of the same shape (else `task.eval_fraction` of dataset)
        tools            OpenAI tool definitions its episodes send: rendered into the prompts

The learner renders each row's prompt with the same chat format the actor's endpoint checks the
first call against, and every other column travels in the lease's meta to `rollout` and
`rubric` (strings as they are, other values JSON-encoded).
"""

from __future__ import annotations

import inspect
import json
from functools import cached_property
from typing import Protocol

import msgspec
import numpy as np

from configs.imports import load_object
from configs.schema import TaskConfig
from tasks.base import Prompt
from tasks.chat import make_chat_format
from tasks.data import DataError, DataTask, check_rows, split_rows


class Environment(Protocol):
    async def rollout(self, client, model: str, messages: list[dict], meta: dict) -> list[dict]: ...

    def rubric(self, messages: list[dict], completion: list[dict], meta: dict) -> float: ...


def load_environment(spec: str) -> Environment:
    """`package.module:attribute` -> the environment (a class or factory is called once)."""
    obj = load_object(spec, "actors.agent.environment")
    env = obj() if inspect.isclass(obj) or inspect.isfunction(obj) else obj
    for method in ("rollout", "rubric"):
        if not callable(getattr(type(env), method, None)):
            raise ValueError(f"actors.agent.environment {spec!r} has no {method}() method")
    return env


class EnvironmentTask(DataTask):
    """`task.name: environment`: the rows of `task.environment`'s dataset as the prompts (the
    data task's seeded epochs and held-out split); its rubric, in the actors, scores them."""

    name = "environment"

    def __init__(self, cfg: TaskConfig, tokenizer, seed: int = 0) -> None:
        super().__init__(msgspec.structs.replace(cfg, label_key="", metadata_keys=""), tokenizer,
                         seed)

    @cached_property
    def env(self) -> Environment:
        return load_environment(self.cfg.environment)

    @cached_property
    def _split(self) -> tuple[list[dict], list[dict]]:
        spec = self.cfg.environment
        if getattr(self.env, "dataset", None) is None:
            raise DataError(f"task.environment {spec!r} has no dataset: task.name=environment "
                            f"takes its prompts from the environment's `dataset` rows")
        rows = _as_rows(self.env.dataset, f"{spec} dataset")
        if getattr(self.env, "eval_dataset", None) is not None:
            train, held = rows, _as_rows(self.env.eval_dataset, f"{spec} eval_dataset")
        else:
            train, held = split_rows(rows, self.cfg.eval_fraction, f"{spec} dataset")
        check_rows(train, f"{spec} dataset", self.cfg)
        check_rows(held, f"{spec} held-out rows", self.cfg)
        return train, held

    @cached_property
    def chat(self):
        return make_chat_format(self.tokenizer)

    def _prompt(self, prompt_id: int, row: dict, row_index: int) -> Prompt:
        key = self.cfg.prompt_key
        ids = self.chat.start(self.messages(row[key]), getattr(self.env, "tools", None))
        meta = {"row": str(row_index)}
        meta.update({k: v if isinstance(v, str) else json.dumps(v, default=str)
                     for k, v in row.items() if k != key})
        return Prompt(prompt_id=prompt_id, token_ids=np.asarray(ids, dtype=np.int32), meta=meta)

    async def reward(self, meta: dict[str, str], completion_ids: np.ndarray):
        raise NotImplementedError("an environment task is scored by the environment's rubric: "
                                  "run it with actors.agent=environment")


def _as_rows(data, what: str) -> list[dict]:
    rows = data.to_list() if hasattr(data, "to_list") else list(data)
    if not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{what}: rows must be dicts (or a datasets.Dataset)")
    return rows


def make_task(cfg: TaskConfig, tokenizer, seed: int = 0) -> EnvironmentTask:
    """`task.name: environment` (tasks/registry.py)."""
    return EnvironmentTask(cfg, tokenizer, seed)
