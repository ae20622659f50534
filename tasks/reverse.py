"""Toy task: reverse a digit string. Reward = fraction of positions right.

    prompt:      <bos> rev 1 2 3 4 =
    completion:  4 3 2 1 <eos>

About 10% of all digit strings are held out for evaluation (chosen by a fixed hash).
"""

from __future__ import annotations

import numpy as np

from tasks.base import Prompt


class ReverseTask:
    name = "reverse"

    def __init__(self, tokenizer, num_digits: int = 4, seed: int = 0) -> None:
        self.num_digits = num_digits
        self.seed = seed
        self.bos = tokenizer.convert_tokens_to_ids("<bos>")
        self.eos = tokenizer.convert_tokens_to_ids("<eos>")
        self.rev = tokenizer.convert_tokens_to_ids("rev")
        self.eq = tokenizer.convert_tokens_to_ids("=")
        self.digit = np.array([tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])
        numbers = np.arange(10**num_digits)
        held_out = (numbers * 2654435761 % 4093) % 10 == 0
        self.train_pool = numbers[~held_out]
        self.eval_pool = numbers[held_out]

    def _prompt(self, prompt_id: int, number: int) -> Prompt:
        digits = [int(c) for c in str(int(number)).zfill(self.num_digits)]
        ids = np.array([self.bos, self.rev, *self.digit[digits], self.eq], dtype=np.int32)
        return Prompt(prompt_id=prompt_id, token_ids=ids,
                      meta={"task": self.name, "target": "".join(map(str, digits[::-1]))})

    def train_prompt(self, index: int) -> Prompt:
        rng = np.random.default_rng([self.seed, index])
        return self._prompt(index, self.train_pool[rng.integers(len(self.train_pool))])

    def eval_prompts(self, n: int) -> list[Prompt]:
        n = min(n, len(self.eval_pool))
        return [self._prompt(-1 - i, self.eval_pool[i * len(self.eval_pool) // n]) for i in range(n)]

    def reward(self, meta: dict[str, str], completion_ids: np.ndarray) -> float:
        target = self.digit[[int(c) for c in meta["target"]]]
        got = np.asarray(completion_ids)[: len(target)]
        right = int(np.sum(got == target[: len(got)]))
        return right / len(target)

    def supervised_example(self, prompt: Prompt) -> tuple[np.ndarray, np.ndarray]:
        target = self.digit[[int(c) for c in prompt.meta["target"]]]
        ids = np.concatenate([prompt.token_ids, target, [self.eos]]).astype(np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[len(prompt.token_ids):] = 1
        return ids, mask


def make_task(cfg, tokenizer, seed: int = 0) -> ReverseTask:
    """`task.name: reverse` (= `tasks.reverse:make_task`)."""
    return ReverseTask(tokenizer, num_digits=cfg.num_digits, seed=seed)
