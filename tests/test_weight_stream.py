"""`transport.weight_load: streamed`: a full version goes into the engine bucket by bucket as
the buckets arrive (transport/weightsrc/zmq_pull.py `_stream`). Real ZeroMQ sockets to the
learner's real WeightsService (tests/test_weightsrc.py's LearnerSide), the real batching client
around a real HF engine of the tiny model; vLLM's and SGLang's side is tests/engine_refs.py
`check_streamed_load`."""

from __future__ import annotations

import asyncio

import torch
import zmq.asyncio

import engine_refs as refs
from actors.engines.client import EngineClient
from actors.engines.hf import HFEngine
from configs.schema import TransportConfig
from transport.weights import pack
from transport.weightsrc.store import Published
from transport.weightsrc.zmq_pull import WINDOW, ZmqSource

from test_weightsrc import LearnerSide, _run, _source

STAGED = TransportConfig(peer_timeout_s=5)
STREAMED = TransportConfig(peer_timeout_s=5, weight_load="streamed")


class CountingSource(ZmqSource):
    """A real ZmqSource that counts the buckets it has asked for, by version."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.asked: dict[int, int] = {}

    async def _bucket(self, man, i, cands, dead):
        self.asked[man.version] = self.asked.get(man.version, 0) + 1
        return await super()._bucket(man, i, cands, dead)


class WindowedClient(EngineClient):
    """The real client of an HF engine that records, as bucket i reaches it, how many buckets
    the actor holds: asked for (in flight or arrived) and not yet in the engine; and calls
    `on_bucket(version, index)` first."""

    def __init__(self, engine: HFEngine, source: CountingSource) -> None:
        super().__init__(engine)
        self.source = source
        self.held: list[int] = []
        self.in_engine = 0
        self.on_bucket = lambda version, index: None

    async def begin_load(self, manifest) -> None:
        self.in_engine = 0
        await super().begin_load(manifest)

    async def load_bucket(self, manifest, index: int, bucket) -> None:
        assert index == self.in_engine  # in order
        self.held.append(self.source.asked[manifest.version] - index)
        self.on_bucket(manifest.version, index)
        await super().load_bucket(manifest, index, bucket)
        self.in_engine += 1


def _packed(state: dict, version: int, parts: int = 24):
    """`state` as `version` in about `parts` buckets (more than twice WINDOW)."""
    total = sum(t.numel() * t.element_size() for t in state.values())
    packed = pack(state, version, max(1024, total // parts))
    assert packed.manifest.num_buckets > 2 * WINDOW + 2
    return packed


def test_streamed_gives_the_staged_weights_bit_for_bit_holding_at_most_window_buckets(
        tiny_model_dir):
    state = refs.noisy_state(tiny_model_dir, 0.1, seed=1)
    packed = _packed(state, 0)
    learner = LearnerSide(STAGED)
    learner.add(Published(full=packed))
    prompt = refs.prompts(tiny_model_dir, 1)[0]

    async def scenario():
        actx = zmq.asyncio.Context()
        staged_src = _source(ZmqSource, actx, learner, STAGED)
        streamed_src = _source(CountingSource, actx, learner, STREAMED, actor_id="a1")
        staged = EngineClient(HFEngine(tiny_model_dir))
        streamed = WindowedClient(HFEngine(tiny_model_dir), streamed_src)
        assert await staged_src.pull(staged) is None
        assert await streamed_src.pull(streamed) is None
        outs = [await c.generate(prompt, 8, 1.0, seed=3) for c in (staged, streamed)]
        for s in (staged_src, streamed_src):
            s.close()
        actx.destroy(linger=0)
        return staged, streamed, outs

    try:
        staged, streamed, outs = _run(scenario())
    finally:
        learner.close()
    assert staged.version == streamed.version == 0
    a, b = staged.engine.model.state_dict(), streamed.engine.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert outs[0].token_ids.tolist() == outs[1].token_ids.tolist()
    assert (outs[1].versions == 0).all()
    n = packed.manifest.num_buckets
    assert len(streamed.held) == n
    assert max(streamed.held) == WINDOW  # it fetches ahead ...
    assert all(h <= WINDOW for h in streamed.held), streamed.held  # ... and no further


def test_a_stream_broken_part_way_keeps_the_engine_closed_until_a_whole_version_loads(
        tiny_model_dir):
    """The learner loses version 1 while an actor streams it (as when a newer version replaced
    it): the engine has some of v1's buckets and stays closed with version -1; a request made
    then waits; the next pull asks for a full version (v2) and the request runs on it."""
    states = {v: refs.noisy_state(tiny_model_dir, 0.1, seed=v) for v in (0, 1, 2)}
    learner = LearnerSide(STAGED)
    learner.add(Published(full=_packed(states[0], 0)))
    prompt = refs.prompts(tiny_model_dir, 1)[0]

    def lose_v1(version: int, index: int) -> None:
        if version == 1 and index == 2:
            with learner.lock:
                del learner.service.store.blobs["f1"]

    async def scenario():
        actx = zmq.asyncio.Context()
        src = _source(CountingSource, actx, learner, STREAMED)
        client = WindowedClient(HFEngine(tiny_model_dir), src)
        client.on_bucket = lose_v1
        assert await src.pull(client) is None and client.version == 0
        learner.add(Published(full=_packed(states[1], 1)))
        assert await src.pull(client) is None  # Gone part-way
        broken = (client.version, client.engine.version, client.in_engine,
                  src.stats.broken_streams, src.stats.versions)
        held = asyncio.ensure_future(client.generate(prompt, 8, 1.0, seed=3))
        learner.add(Published(full=_packed(states[2], 2)))
        assert await src.pull(client) is None
        out = await held
        src.close()
        actx.destroy(linger=0)
        return client, broken, out

    try:
        client, broken, out = _run(scenario())
    finally:
        learner.close()
    version, engine_version, in_engine, broken_streams, versions = broken
    assert (version, engine_version, broken_streams, versions) == (-1, -1, 1, 1)
    assert 3 <= in_engine < _packed(states[1], 1).manifest.num_buckets  # a mix of v0 and v1
    assert client.version == 2 and (out.versions == 2).all()  # never ran on the mix
    weights = client.engine.model.state_dict()
    for k, t in states[2].items():
        assert torch.equal(weights[k], t), k


def test_a_run_with_streamed_loads_trains_and_accounts(tmp_path, tiny_model_dir):
    """Learner and two HF actors in one process (transport.kind=inproc), every version
    streamed into the engines in 16 KiB buckets while the actors generate."""
    import procs

    s, logs = procs.run_inproc(tmp_path / "run", tiny_model_dir, "learner.max_steps=5",
                               "max_staleness=1", "transport.weight_load=streamed",
                               "transport.weight_bucket_bytes=16384")
    assert s["steps"] == 5 and s["accounting_ok"] and s["rejected_messages"] == {}
    text = "\n".join(line for name in ("actor-local-0", "actor-local-1")
                     for line in logs.lines[name])
    assert "loaded weights v5 (full" in text
