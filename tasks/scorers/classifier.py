"""`kind: classifier`: a discriminative reward model, an HF sequence-classification directory.

Each sample is rendered as the classifier's tokenizer sees a conversation: its chat template
over [user: prompt, assistant: completion] when it has one, else prompt + " " + completion. A
batch is padded and run in one forward pass (`torch.inference_mode`, in a worker thread so the
scorer's event loop keeps serving); the row of logits becomes a float by `transform`: softmax
(the probability of `output`), sigmoid or raw (the logit of `output`), or a user function.
"""

from __future__ import annotations

import asyncio
import math

from configs.scorers import ClassifierScorer
from tasks.scorers.base import Item


class Classifier:
    def __init__(self, cfg: ClassifierScorer, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from models.tiny import load_tokenizer

        self.name, self.weight, self.cfg = cfg.name, cfg.weight, cfg
        self.tokenizer = load_tokenizer(cfg.path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            cfg.path, dtype=torch.float32).to(device).eval()
        self.model.requires_grad_(False)  # frozen: never trained, never updated
        self.device = device
        labels = {v: int(k) for k, v in (self.model.config.id2label or {}).items()}
        n = self.model.config.num_labels
        if cfg.output and cfg.output not in labels:
            raise ValueError(f"task.scorers {cfg.name}: output {cfg.output!r} is not a label of "
                             f"{cfg.path} (id2label: {sorted(labels)})")
        self.index = labels[cfg.output] if cfg.output else n - 1
        self.transform = _transform(cfg.transform, self.index, cfg.name)

    def text(self, item: Item) -> str:
        tok = self.tokenizer
        if tok.chat_template:
            return tok.apply_chat_template([{"role": "user", "content": item.prompt},
                                            {"role": "assistant", "content": item.completion}],
                                           tokenize=False)
        return f"{item.prompt} {item.completion}"

    async def score(self, items: list[Item]) -> list[float]:
        return await asyncio.to_thread(self.forward, [self.text(i) for i in items])

    def forward(self, texts: list[str]) -> list[float]:
        """One padded forward pass over `texts` (blocks: call from a worker thread)."""
        import torch

        tok = self.tokenizer
        tok.truncation_side = "left"
        enc = tok(texts, padding=True, truncation=True, max_length=self.cfg.max_length,
                  return_tensors="pt", add_special_tokens=not tok.chat_template)
        enc.pop("token_type_ids", None)
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits
        return [self.transform(row) for row in logits.float().cpu().tolist()]

    async def close(self) -> None:
        self.model = None


def _transform(spec: str, index: int, name: str):
    if spec == "softmax":
        return lambda row: _softmax(row)[index]
    if spec == "sigmoid":
        return lambda row: 1.0 / (1.0 + math.exp(-row[index]))
    if spec == "raw":
        return lambda row: float(row[index])
    if ":" in spec:
        from tasks.rewards import load_function

        fn = load_function(spec, f"task.scorers {name}: transform")
        return lambda row: float(fn(row))
    raise ValueError(f"task.scorers {name}: transform must be softmax, sigmoid, raw or an import "
                     f"path module:fn, got {spec!r}")


def _softmax(row: list[float]) -> list[float]:
    top = max(row)
    e = [math.exp(x - top) for x in row]
    total = sum(e)
    return [x / total for x in e]
