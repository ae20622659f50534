"""The built-in tasks by name: the one module that knows every task.

`task.name` is a built-in short name (below) or an import path `package.module:make_task` /
`path/to/file.py:make_task` of a function `make_task(cfg: TaskConfig, tokenizer, seed) -> Task`.
Each built-in task's module is imported only when it is made, by the explicit imports below,
so tests/test_imports.py sees every edge. A new built-in task is a module in tasks/, an entry in
BUILTIN and its name in configs.schema.BUILTIN_TASKS (which the config checks names against).
"""

from __future__ import annotations

from typing import Callable

from configs.schema import TaskConfig
from tasks.base import Task

TaskFactory = Callable[[TaskConfig, object, int], Task]
"""make_task(cfg, tokenizer, seed) -> the task."""


def _reverse() -> TaskFactory:
    from tasks.reverse import make_task
    return make_task


def _calculator() -> TaskFactory:
    from tasks.calculator import make_task
    return make_task


def _gsm8k() -> TaskFactory:
    from tasks.gsm8k import make_task
    return make_task


def _data() -> TaskFactory:
    from tasks.data import make_task
    return make_task


def _additions() -> TaskFactory:
    from tasks.additions import make_task
    return make_task


def _environment() -> TaskFactory:
    from tasks.environment import make_task
    return make_task


def _verifiers() -> TaskFactory:
    from tasks.verifiers import make_task
    return make_task


BUILTIN: dict[str, Callable[[], TaskFactory]] = {
    "reverse": _reverse, "calculator": _calculator, "gsm8k": _gsm8k, "data": _data,
    "additions": _additions, "environment": _environment, "verifiers": _verifiers,
}
"""Short name -> a function importing that task's make_task."""


def task_factory(name: str) -> TaskFactory:
    """The make_task that `task.name` names: a built-in's, or the function at an import path."""
    if name in BUILTIN:
        return BUILTIN[name]()
    from tasks.rewards import load_function

    return load_function(name, "task.name")
