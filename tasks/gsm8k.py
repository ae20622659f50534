"""GSM8K-style math word problems from a local JSONL file, for real instruct models.

Each line is `{"question": "...", "answer": "... #### 42"}` (GSM8K's format: the gold number
follows the last `####`). The prompt is the question under the model's chat template; the
reward is 1.0 when the last number the model writes (after `####` if it writes one) equals the
gold number, else 0.0. Every 10th line is held out for evaluation.

The file is read only where prompts are made (the learner); actors score from `meta` alone.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path

import numpy as np

from tasks.base import Prompt

INSTRUCTION = "Solve the problem step by step. Write the final answer as a number after '####'."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The answer a completion gives: the first number after the last '####', else the last
    number in the text; commas removed. None if there is no number."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    found = _NUMBER.findall(tail)
    if not found:
        return None
    pick = found[0] if "####" in text else found[-1]
    return pick.replace(",", "").rstrip(".")


def same_number(a: str, b: str) -> bool:
    return float(a) == float(b)


class GSM8KTask:
    name = "gsm8k"

    def __init__(self, tokenizer, data_path: str = "", seed: int = 0, **_unused) -> None:
        self.tokenizer = tokenizer
        self.data_path = data_path
        self.seed = seed

    @cached_property
    def _rows(self) -> tuple[list[dict], list[dict]]:
        path = Path(self.data_path)
        if not path.is_file():
            raise FileNotFoundError(f"task.data_path {self.data_path!r} is not a JSONL file")
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("question"), str) or "####" not in str(row.get("answer", "")):
                raise ValueError(f"{path}:{n}: need a 'question' string and an 'answer' with '####'")
            gold = final_number(row["answer"])
            if gold is None:
                raise ValueError(f"{path}:{n}: no number after '####' in the answer")
            rows.append({"question": row["question"], "gold": gold})
        if len(rows) < 10:
            raise ValueError(f"{path}: {len(rows)} problems; need at least 10")
        return [r for i, r in enumerate(rows) if i % 10], rows[::10]

    def _prompt(self, prompt_id: int, row: dict) -> Prompt:
        messages = [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return Prompt(prompt_id=prompt_id, token_ids=np.asarray(ids, dtype=np.int32),
                      meta={"task": self.name, "target": row["gold"]})

    def train_prompt(self, index: int) -> Prompt:
        train = self._rows[0]
        rng = np.random.default_rng([self.seed, index])
        return self._prompt(index, train[int(rng.integers(len(train)))])

    def eval_prompts(self, n: int) -> list[Prompt]:
        held = self._rows[1][:n]
        return [self._prompt(-1 - i, row) for i, row in enumerate(held)]

    def reward(self, meta: dict[str, str], completion_ids: np.ndarray) -> float:
        text = self.tokenizer.decode(np.asarray(completion_ids).tolist(), skip_special_tokens=True)
        got = final_number(text)
        return float(got is not None and same_number(got, meta["target"]))

    def supervised_example(self, prompt: Prompt) -> np.ndarray:
        raise NotImplementedError("gsm8k has no supervised warm-start; set model.warmstart_steps=0")


def make_task(cfg, tokenizer, seed: int = 0) -> GSM8KTask:
    """`task.name: gsm8k` (= `tasks.gsm8k:make_task`)."""
    return GSM8KTask(tokenizer, data_path=cfg.data_path, seed=seed)
