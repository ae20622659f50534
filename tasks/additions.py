"""Additions for a real instruct model, generated from a seed (`task.name: additions`).

Every pair (a, b) of `task.num_digits`-digit numbers (0-9 for one digit) becomes a chat prompt

    "What is 3 + 5? Answer with the number only."      label 8, metadata {"a": 3, "b": 5}

and goes through the data task (tasks/data.py: chat template, seeded epochs, held-out split
`task.eval_fraction` chosen with a fixed seed, the reward by import path in a process pool).
The reward defaults to `tasks.builtin_rewards:correct_and_short` when `task.reward` is empty.
"""

from __future__ import annotations

import msgspec

import numpy as np

from configs.schema import TaskConfig
from tasks.data import SPLIT_SEED, DataTask

QUESTION = "What is {a} + {b}? Answer with the number only."
DEFAULT_REWARD = "tasks.builtin_rewards:correct_and_short"


def rows(num_digits: int, eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): all pairs, a fixed `eval_fraction` of them held out."""
    n = 10 ** num_digits
    pairs = [(a, b) for a in range(n) for b in range(n)]
    order = np.random.default_rng(SPLIT_SEED).permutation(len(pairs))
    k = max(1, int(round(eval_fraction * len(pairs))))
    table = [{"prompt": QUESTION.format(a=a, b=b), "label": a + b, "a": a, "b": b}
             for a, b in pairs]
    held = sorted(order[:k].tolist())
    train = sorted(order[k:].tolist())
    return [table[i] for i in train], [table[i] for i in held]


def make_task(cfg: TaskConfig, tokenizer, seed: int = 0) -> DataTask:
    if cfg.num_digits > 2:  # every pair is enumerated: 100 ** num_digits rows
        raise ValueError(f"task.num_digits must be 1 or 2 for the additions task, got "
                         f"{cfg.num_digits}")
    cfg = msgspec.structs.replace(cfg, prompt_key="prompt", label_key="label", metadata_keys="a,b",
                                  reward=cfg.reward or DEFAULT_REWARD)
    task = DataTask(cfg, tokenizer, seed, rows=rows(cfg.num_digits, cfg.eval_fraction))
    task.name = "additions"
    return task
