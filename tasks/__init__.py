"""RL tasks: a task makes prompts (learner side) and scores completions (actor side).

The learner owns the dataset; each lease carries the prompt token ids and the task's `meta`
(e.g. the target), so an actor can score a completion with `reward(meta, ...)` alone.

`task.name` is an import path `package.module:make_task` (or `path/to/file.py:make_task`) of a
function `make_task(cfg: TaskConfig, tokenizer, seed: int) -> Task`, or a built-in task's short
name (tasks/registry.py).
"""

from __future__ import annotations

from configs.schema import TaskConfig
from tasks.base import Prompt, Task


def make_task(cfg: TaskConfig, tokenizer, seed: int = 0) -> Task:
    """The task `cfg.name` names (a built-in short name or an import path)."""
    from tasks.registry import task_factory

    return task_factory(cfg.name)(cfg, tokenizer, seed)


__all__ = ["Prompt", "Task", "make_task"]
