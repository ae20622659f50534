"""`kind: remote`: an OpenAI-compatible chat-completions endpoint as the judge.

Every sample is one POST {base_url}/chat/completions with the filled template as the user
message; at most `max_concurrency` requests are in flight at once (a semaphore per scorer
process), each limited to `timeout_s`. A connection error, a timeout or HTTP 429 / 5xx is
retried `retries` times after `retry_backoff_s * 2**k`; after that the batch fails (the learner
gives it to another scorer, and past its deadline scores it 0 with `reward_failed`). Other HTTP
errors (400, 401, ...) fail at once: retrying would not help. An answer whose text the parser
cannot read scores NaN (0, flagged `<name>_unparsed`).
"""

from __future__ import annotations

import asyncio
import logging
import os

from configs.scorers import RemoteScorer
from tasks.scorers.base import Item
from tasks.scorers.parse import fill, make_parser

log = logging.getLogger(__name__)

RETRIED = {429, 500, 502, 503, 504}
"""HTTP statuses that are retried."""


class RemoteError(RuntimeError):
    """The endpoint refused a request, or kept failing after every retry."""


class Remote:
    def __init__(self, cfg: RemoteScorer) -> None:
        self.name, self.weight, self.cfg = cfg.name, cfg.weight, cfg
        self.parse = make_parser(cfg.parser, cfg.scale, f"task.scorers {cfg.name}: parser")
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        key = os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else ""
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._limit: asyncio.Semaphore | None = None  # made on the loop that uses it
        self._session = None
        self.requests = 0
        """Requests sent (retries included)."""

    async def score(self, items: list[Item]) -> list[float]:
        import aiohttp

        if self._session is None:
            self._limit = asyncio.Semaphore(self.cfg.max_concurrency)
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s))
        texts = await asyncio.gather(*(self._ask(fill(self.cfg.template, i)) for i in items))
        return [self.parse(t) for t in texts]

    async def _ask(self, content: str) -> str:
        import aiohttp

        c = self.cfg
        body = {"model": c.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": c.max_new_tokens, "temperature": c.temperature}
        for attempt in range(c.retries + 1):
            why = ""
            async with self._limit:
                self.requests += 1
                try:
                    async with self._session.post(self.url, json=body,
                                                  headers=self.headers) as r:
                        if r.status == 200:
                            data = await r.json()
                            return data["choices"][0]["message"]["content"] or ""
                        why = f"HTTP {r.status}: {(await r.text())[:200]}"
                        if r.status not in RETRIED:
                            raise RemoteError(f"{self.url}: {why}")
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                    why = f"{type(e).__name__}: {e}"
            if attempt < c.retries:
                log.warning("%s: %s; retry %d of %d", self.url, why, attempt + 1, c.retries)
                await asyncio.sleep(c.retry_backoff_s * 2**attempt)  # backoff, not synchronisation
        raise RemoteError(f"{self.url}: {why} (after {c.retries} retries)")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
