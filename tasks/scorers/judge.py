"""`kind: judge`: a generative judge served by a Tether engine (HF or vLLM) in the scorer.

Each sample becomes one chat turn of the judge (its tokenizer's chat template over the filled
`template`), sampled with the judge's own settings (max_new_tokens, temperature, seed: the same
sample gets the same seed every time); the text is parsed to a number (`parser`) and divided by
`scale`. The engine is the role's (actors/scorer.py builds it from `engine` and loads the
directory's weights once, version 0; it never takes a policy version). Requests of a batch are
issued together: the HF engine batches them (per prompt length), vLLM schedules them.
"""

from __future__ import annotations

import asyncio
import zlib

import numpy as np

from configs.scorers import JudgeScorer
from tasks.scorers.base import Item
from tasks.scorers.parse import fill, make_parser


class Judge:
    def __init__(self, cfg: JudgeScorer, llm, tokenizer, close=None) -> None:
        """`llm`: an LLMClient (actors/engine.py) holding the judge's weights; `close`: what
        stops it."""
        self.name, self.weight, self.cfg = cfg.name, cfg.weight, cfg
        self.llm, self.tokenizer, self._close = llm, tokenizer, close
        self.parse = make_parser(cfg.parser, cfg.scale, f"task.scorers {cfg.name}: parser")
        self.texts: list[str] = []
        """The judge's latest answers (the last batch's), for logs and tests."""

    def prompt_ids(self, item: Item) -> np.ndarray:
        msgs = [{"role": "user", "content": fill(self.cfg.template, item)}]
        if self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
        else:
            ids = self.tokenizer(msgs[0]["content"], add_special_tokens=True)["input_ids"]
        return np.asarray(ids, dtype=np.int32)

    async def score(self, items: list[Item]) -> list[float]:
        c = self.cfg
        outs = await asyncio.gather(*(
            self.llm.generate(self.prompt_ids(i), c.max_new_tokens, c.temperature,
                              c.seed + zlib.crc32(f"{i.prompt}\0{i.completion}".encode()))
            for i in items))
        self.texts = [self.tokenizer.decode(o.token_ids.tolist(), skip_special_tokens=True)
                      for o in outs]
        return [self.parse(t) for t in self.texts]

    async def close(self) -> None:
        if self._close is not None:
            self._close()
