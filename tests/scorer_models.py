"""Small scorer models and a named fake endpoint, built in the tests' set-up (no hub).

`build_seven_classifier` trains a tiny HF sequence classifier (Qwen2ForSequenceClassification,
216k parameters, the toy task's word-level tokenizer) to prefer completions of the reversal
task that contain the digit 7: label 1 iff the completion has a 7, so its probability of label
`has7` is the score. Seeded; a few CPU-seconds.

`FakeOpenAIJudge` is a small fake OpenAI-compatible chat-completions server (aiohttp, on
127.0.0.1): it answers "Score: N" where N is the number of 7s in the answer it is asked to rate
times 5, holds each request `delay_s`, and records how many requests were in flight at once.

`verdict` is a judge parser (`parser: tests/scorer_models.py:verdict`) for a small judge's
"1" / "0" / "The answer is (in)correct." answers.
"""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path

import numpy as np


def seven_examples(rng: np.random.Generator, n: int) -> tuple[list[str], np.ndarray]:
    """Prompt + completion texts as the classifier scorer renders them (no chat template:
    "prompt completion", special tokens skipped) and their labels (completion has a 7)."""
    texts, labels = [], []
    for _ in range(n):
        prompt = rng.integers(0, 10, 4)
        length = int(rng.integers(1, 5))
        if rng.random() < 0.5:
            comp = prompt[::-1][:length].copy()  # what the warm-started policy writes
        else:
            comp = rng.integers(0, 10, length)
        if rng.random() < 0.3:
            comp[rng.integers(0, length)] = 7
        texts.append("rev " + " ".join(map(str, prompt)) + " = " + " ".join(map(str, comp)))
        labels.append(int(7 in comp))
    return texts, np.asarray(labels)


def build_seven_classifier(path: Path, seed: int = 0, steps: int = 300) -> float:
    """Train and save the classifier; returns its accuracy on 512 fresh held-out examples."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                         intermediate_size=384, max_position_embeddings=64, num_labels=2,
                         id2label={0: "no7", 1: "has7"}, label2id={"no7": 0, "has7": 1},
                         pad_token_id=tok.pad_token_id, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch(texts):
        enc = tok(texts, padding=True, return_tensors="pt")
        enc.pop("token_type_ids", None)
        return enc

    model.train()
    for _ in range(steps):
        texts, labels = seven_examples(rng, 64)
        loss = torch.nn.functional.cross_entropy(model(**batch(texts)).logits,
                                                 torch.as_tensor(labels))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    texts, labels = seven_examples(np.random.default_rng(seed + 1), 512)
    with torch.inference_mode():
        pred = model(**batch(texts)).logits.argmax(-1).numpy()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return float((pred == labels).mean())


class FakeOpenAIJudge:
    """A fake OpenAI-compatible judge on 127.0.0.1 (see the module docstring)."""

    def __init__(self, delay_s: float = 0.05, fail_first: int = 0) -> None:
        self.delay_s = delay_s
        self.fail_first = fail_first
        """The first this many requests get HTTP 503 (the scorer retries them)."""
        self.active = 0
        self.max_active = 0
        self.requests = 0
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeOpenAIJudge:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    async def _chat(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests += 1
        number = self.requests
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay_s)  # hold the request: concurrency is observable
            if number <= self.fail_first:
                return web.Response(status=503, text="busy")
            answer = re.search(r"Answer: (.*)", body["messages"][0]["content"]).group(1)
            text = f"Score: {5 * answer.count('7')}"
            return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant",
                                                               "content": text}}]})
        finally:
            self.active -= 1


def verdict(text: str) -> float:
    """A judge's verdict as a score, by its first verdict word: "correct" or a lone 1 -> 1,
    "incorrect", "not correct" or a lone 0 -> 0, none -> NaN (unparsed). SmolLM2-135M-Instruct,
    asked to reply 1 or 0, answers "1. The answer is correct" or "The answer is 1."; asked for
    a 0-10 rating, it echoes a digit of the question ("The answer is 4.")."""
    m = re.search(r"\b(incorrect|not correct|correct|[01])\b", text, re.IGNORECASE)
    if m is None:
        return float("nan")
    return 1.0 if m.group(1).lower() in ("correct", "1") else 0.0
