"""RL tasks: a task makes prompts (learner side) and scores completions (actor side).

The learner owns the dataset; each lease carries the prompt token ids and the task's `meta`
(e.g. the target), so an actor can score a completion with `reward(meta, ...)` alone.
"""

from __future__ import annotations

from tasks.base import Prompt, Task


def make_task(name: str, tokenizer, **kwargs) -> Task:
    if name == "reverse":
        from tasks.reverse import ReverseTask

        return ReverseTask(tokenizer, **kwargs)
    if name == "calculator":
        from tasks.calculator import CalculatorTask

        return CalculatorTask(tokenizer, **kwargs)
    raise ValueError(f"unknown task {name!r}")


__all__ = ["Prompt", "Task", "make_task"]
