"""actors/engines/client.py: a request abandoned while its batch runs does not break the batch."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from actors.engines.client import EngineClient
from actors.engines.base import Completion


class GatedEngine:
    """Generates one fixed token per request once `gate` is set (a worker thread waits on it)."""

    version = 0
    vocab_size = 16

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()

    def generate(self, requests):
        self.started.set()
        self.gate.wait()
        one = np.ones(1, dtype=np.int32)
        return [Completion(one, np.zeros(1, np.float32), one * 0, "length") for _ in requests]


def test_a_cancelled_request_leaves_the_rest_of_its_batch_served():
    async def main():
        engine = GatedEngine()
        client = EngineClient(engine)
        prompt = np.ones(3, dtype=np.int32)
        a = asyncio.ensure_future(client.generate(prompt, 1, 1.0, seed=0))
        b = asyncio.ensure_future(client.generate(prompt, 1, 1.0, seed=1))
        await asyncio.to_thread(engine.started.wait)  # both are in the running batch
        a.cancel()  # e.g. the actor abandons its rollouts to join a new learner run
        engine.gate.set()
        got = await asyncio.wait_for(b, timeout=30)
        assert got.token_ids.tolist() == [1]
        assert a.cancelled()
        # the client still serves new requests (its batch task did not die)
        c = await asyncio.wait_for(client.generate(prompt, 1, 1.0, seed=2), timeout=30)
        assert c.token_ids.tolist() == [1]

    asyncio.run(main())
