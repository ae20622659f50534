"""Small named fakes and builders shared by unit tests."""

from __future__ import annotations

import numpy as np

from buffer.record import TrajGroup


def make_group(lease_id: int, version: int, n: int = 4, tokens: int = 3, rewards=None) -> TrajGroup:
    """A group whose every token was sampled at `version`."""
    rewards = np.arange(n, dtype=np.float32) / n if rewards is None else np.asarray(rewards, np.float32)
    return TrajGroup.build(
        lease_id=lease_id, prompt_id=lease_id, actor_id="fake",
        prompt_ids=np.array([1, 4, 6, 7, 5], dtype=np.int64),
        completions=[np.full(tokens, 6, dtype=np.int64) for _ in range(n)],
        logprobs=[np.full(tokens, -0.5, dtype=np.float32) for _ in range(n)],
        versions=[np.full(tokens, version, dtype=np.int64) for _ in range(n)],
        loss_masks=[np.ones(tokens, dtype=np.float32) for _ in range(n)],
        rewards=rewards)


class FakeTask:
    """Prompts numbered by index; enough for the lease table."""

    name = "fake"

    def train_prompt(self, index: int):
        from tasks.base import Prompt

        return Prompt(prompt_id=index, token_ids=np.array([1, 2], dtype=np.int32), meta={})
