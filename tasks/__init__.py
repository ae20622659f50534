"""RL tasks: a task makes prompts (learner side) and scores completions (actor side).

The learner owns the dataset; each lease carries the prompt token ids and the task's `meta`
(e.g. the target), so an actor can score a completion with `reward(meta, ...)` alone.
"""

from __future__ import annotations

from configs.schema import TaskConfig
from tasks.base import Prompt, Task


def make_task(cfg: TaskConfig, tokenizer, seed: int = 0) -> Task:
    """The task named by `cfg.name`, built from the fields of the task config it uses."""
    if cfg.name == "reverse":
        from tasks.reverse import ReverseTask

        return ReverseTask(tokenizer, num_digits=cfg.num_digits, seed=seed)
    if cfg.name == "calculator":
        from tasks.calculator import CalculatorTask

        return CalculatorTask(tokenizer, num_digits=cfg.num_digits, seed=seed)
    if cfg.name == "gsm8k":
        from tasks.gsm8k import GSM8KTask

        return GSM8KTask(tokenizer, data_path=cfg.data_path, seed=seed)
    raise ValueError(f"unknown task {cfg.name!r}")


__all__ = ["Prompt", "Task", "make_task"]
