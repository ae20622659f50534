"""Toy tool task: add two multi-digit numbers, with a calculator the model may call.

    prompt:       <bos> 3 4 7 + 5 8 1 =
    model turn:   <call> calc 3 4 7 + 5 8 1 </call> <eos>          (loss mask 1)
    tool turn:    <result> 9 2 8 </result>                          (loss mask 0)
    model turn:   9 2 8 <eos>                                       (loss mask 1)

Reward: the final answer (the digits after the last tool result, up to EOS) compared position
by position with the true sum: right positions / max(answer length, sum length), so 1.0 only
for the exact sum. Answering without the tool is allowed; the tiny model cannot add by itself.
About 10% of all number pairs are held out for evaluation (chosen by a fixed hash).
"""

from __future__ import annotations

import numpy as np

from models.tiny import render_tool_result
from tasks.base import Prompt


class CalculatorTask:
    name = "calculator"

    def __init__(self, tokenizer, num_digits: int = 3, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.num_digits = num_digits
        self.seed = seed
        self.low, self.high = 10 ** (num_digits - 1), 10 ** num_digits
        ids = tokenizer.convert_tokens_to_ids
        self.bos, self.eos, self.plus, self.eq = ids("<bos>"), ids("<eos>"), ids("+"), ids("=")
        self.result_end = ids("</result>")
        self.digit = np.array([ids(str(d)) for d in range(10)])
        self.digit_value = {int(t): d for d, t in enumerate(self.digit)}

    def _held_out(self, a: int, b: int) -> bool:
        return ((a * self.high + b) * 2654435761 % 4093) % 10 == 0

    def _pair(self, rng: np.random.Generator, held_out: bool) -> tuple[int, int]:
        while True:
            a, b = (int(x) for x in rng.integers(self.low, self.high, 2))
            if self._held_out(a, b) == held_out:
                return a, b

    def _digits(self, n: int) -> list[int]:
        return [int(self.digit[int(c)]) for c in str(n)]

    def _prompt(self, prompt_id: int, a: int, b: int) -> Prompt:
        ids = np.array([self.bos, *self._digits(a), self.plus, *self._digits(b), self.eq],
                       dtype=np.int32)
        return Prompt(prompt_id=prompt_id, token_ids=ids,
                      meta={"task": self.name, "a": str(a), "b": str(b), "target": str(a + b)})

    def train_prompt(self, index: int) -> Prompt:
        return self._prompt(index, *self._pair(np.random.default_rng([self.seed, index]), False))

    def eval_prompts(self, n: int) -> list[Prompt]:
        rng = np.random.default_rng([self.seed, 999])
        return [self._prompt(-1 - i, *self._pair(rng, True)) for i in range(n)]

    def answer(self, completion_ids: np.ndarray) -> list[int]:
        """Token ids of the final answer: after the last tool result, up to EOS."""
        ids = np.asarray(completion_ids)
        ends = np.nonzero(ids == self.result_end)[0]
        tail = ids[ends[-1] + 1:] if ends.size else ids
        stop = np.nonzero(tail == self.eos)[0]
        return [int(t) for t in (tail[:stop[0]] if stop.size else tail)]

    def reward(self, meta: dict[str, str], completion_ids: np.ndarray) -> float:
        target = self._digits(int(meta["target"]))
        got = self.answer(completion_ids)
        right = sum(g == t for g, t in zip(got, target))
        return right / max(len(got), len(target))

    def supervised_example(self, prompt: Prompt) -> tuple[np.ndarray, np.ndarray]:
        """Prompt, the tool call, the calculator's result, the answer; mask 1 on model turns."""
        a, b, total = prompt.meta["a"], prompt.meta["b"], prompt.meta["target"]
        encode = self.tokenizer.convert_tokens_to_ids
        call = encode(["<call>", "calc", *a, "+", *b, "</call>", "<eos>"])
        result = render_tool_result(self.tokenizer, " ".join(total))
        answer = encode([*total, "<eos>"])
        parts = [(prompt.token_ids, 0), (call, 1), (result, 0), (answer, 1)]
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p, _ in parts])
        mask = np.concatenate([np.full(len(p), k, dtype=np.uint8) for p, k in parts])
        return ids, mask


def make_task(cfg, tokenizer, seed: int = 0) -> CalculatorTask:
    """`task.name: calculator` (= `tasks.calculator:make_task`)."""
    return CalculatorTask(tokenizer, num_digits=cfg.num_digits, seed=seed)
