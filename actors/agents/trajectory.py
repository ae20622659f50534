"""Token-level assembly of a multi-turn rollout.

Model turns are appended as the engine returned them (token ids, behavior logprobs, versions,
loss mask 1); tool/environment turns as token ids with logprob 0, version -1 ("sampled by no
policy") and loss mask 0. The context for the next generation is prompt + everything so far, so
nothing is ever re-tokenized from text.
"""

from __future__ import annotations

import numpy as np

from actors.engines.base import Completion
from actors.rollout import Finish, Rollout


class TrajectoryBuilder:
    def __init__(self, prompt_ids: np.ndarray, max_total_tokens: int) -> None:
        self.prompt_ids = np.asarray(prompt_ids, dtype=np.int32)
        self.max_total_tokens = max_total_tokens
        self.turns = 0
        """Model turns appended so far."""
        self._ids: list[np.ndarray] = []
        self._logprobs: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self.num_tokens = 0

    @property
    def remaining(self) -> int:
        """Completion tokens still allowed."""
        return self.max_total_tokens - self.num_tokens

    def context(self) -> np.ndarray:
        """Prompt + every turn so far: what the next generation continues."""
        return np.concatenate([self.prompt_ids, *self._ids])

    def add_model(self, c: Completion) -> None:
        self._add(c.token_ids, c.logprobs, c.versions, 1)
        self.turns += 1

    def add_environment(self, ids: np.ndarray) -> None:
        """Tool results, user messages: context for the model, never trained on."""
        n = len(ids)
        self._add(ids, np.zeros(n, np.float32), np.full(n, -1, np.int32), 0)

    def _add(self, ids, logprobs, versions, mask: int) -> None:
        n = len(ids)
        if n > self.remaining:
            raise ValueError(f"turn of {n} tokens exceeds the remaining budget {self.remaining}")
        self._ids.append(np.asarray(ids, dtype=np.int32))
        self._logprobs.append(np.asarray(logprobs, dtype=np.float32))
        self._versions.append(np.asarray(versions, dtype=np.int32))
        self._masks.append(np.full(n, mask, dtype=np.uint8))
        self.num_tokens += n

    def rollout(self, reward: float, finish: Finish) -> Rollout:
        if self.turns == 0:
            raise ValueError("a rollout needs at least one model turn")
        return Rollout(completion_ids=np.concatenate(self._ids),
                       logprobs=np.concatenate(self._logprobs),
                       versions=np.concatenate(self._versions),
                       loss_mask=np.concatenate(self._masks), reward=float(reward),
                       finish=finish.value)
