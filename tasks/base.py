"""The task interface shared by learner (prompts) and actors (rewards)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Prompt:
    """One prompt: a stable id, its token ids, and what the reward function needs (`meta`)."""

    prompt_id: int
    token_ids: np.ndarray
    meta: dict[str, str]


class Task(Protocol):
    name: str

    def train_prompt(self, index: int) -> Prompt:
        """The `index`-th training prompt; a pure function of (task seed, index)."""

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The first `n` held-out prompts, never used for training."""

    def reward(self, meta: dict[str, str], completion_ids: np.ndarray) -> float:
        """Score one completion (token ids, possibly ending in EOS)."""

    def supervised_example(self, prompt: Prompt) -> tuple[np.ndarray, np.ndarray]:
        """Prompt + ideal completion token ids, and a mask of the same length that is 1 on the
        tokens the model should learn to produce (0 on the prompt and on tool results)."""
