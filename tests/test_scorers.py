"""The scorers family and the scoring desk, without a learner: the desk's exactly-once rules
(reassignment, late answers, deadlines), rule + model rewards mixed by weight against a hand
computation, and the remote judge's bounded concurrency and retries against a named fake
OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from configs.loader import load_config
from learner.leases import LeaseRecord
from learner.scoring import ScoringDesk, balanced
from scorer_models import FakeOpenAIJudge, build_seven_classifier
from tasks.base import Prompt
from transport import messages as m


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _desk(**scoring):
    cfg = load_config(None, ["task.scorers=[{kind: remote, name: j, base_url: http://x, "
                             "weight: 2.0}]", "transport.peer_timeout_s=5",
                             *[f"scoring.{k}={v}" for k, v in scoring.items()]])
    sent, clock = [], Clock()
    desk = ScoringDesk(cfg, lambda ident, msg: sent.append((ident, msg)),
                       lambda lease_id: lease_id in desk.leases_outstanding, now=clock)
    desk.leases_outstanding = set()  # what the lease table would say
    return desk, sent, clock


def _group(lease_id: int, n: int = 2, reward: float = 0.5):
    samples = [m.Sample(sample_index=i, reward=reward, finish="answer") for i in range(n)]
    tokens = [{"completion_ids": np.array([6 + i, 7], np.int32),
               "logprobs": np.zeros(2, np.float32), "versions": np.zeros(2, np.int32),
               "loss_mask": np.ones(2, np.uint8)} for i in range(n)]
    msg = m.pack_group(lease_id=lease_id, actor_id="a", prompt_id=lease_id, samples=samples,
                       tokens=tokens)
    rec = LeaseRecord(lease_id, Prompt(lease_id, np.array([1, 4, 6], np.int32), {"t": "x"}),
                      "a", "i", n, 0)

    class Group:
        rewards = np.zeros(n, np.float32)

    return msg, rec, Group()


def _hello(desk, sid: str, inc: str = "1"):
    assert desk.hello(sid.encode(), m.ScorerHello(protocol_version=m.PROTOCOL_VERSION,
                                                  scorer_id=sid, incarnation=inc,
                                                  scorers=["j"])) == ""


def test_desk_batches_across_groups_and_applies_weighted_scores_once():
    desk, sent, clock = _desk(batch_size=3, max_wait_s=1.0)
    _hello(desk, "A")
    for lease in (1, 2):
        desk.add(*_group(lease))
    desk.tick()
    (ident, batch), = sent  # 3 of the 4 samples, from both groups; the rest waits max_wait_s
    assert ident == b"A" and len(batch.items) == 3
    assert [i.completion_ids.to_numpy().tolist() for i in batch.items] == [[6, 7], [7, 7], [6, 7]]
    desk.tick()
    assert len(sent) == 1
    clock.t = 1.5
    desk.tick()
    assert len(sent) == 2 and len(sent[1][1].items) == 1
    done = m.ScoreDone(scorer_id="A", batch_id=batch.batch_id,
                       results=[m.ItemScores(i.item_id, {"j": 0.25 * k})
                                for k, i in enumerate(batch.items)])
    assert desk.on_done(done) == ""
    [w] = desk.take_finished()  # group 1 is complete, group 2 waits for its last sample
    assert [s.reward for s in w.msg.samples] == [0.5, 0.5 + 2.0 * 0.25]
    assert w.msg.samples[1].scores == {"j": 0.25, "reward_failed": 0.0}
    assert w.group.rewards.tolist() == [0.5, 1.0]
    assert desk.on_done(done) == ""  # the same answer again: late, applied once
    assert desk.counts["late"] >= 1 and desk.counts["scored"] == 3


def test_desk_gives_a_dead_scorers_batches_to_another_and_ignores_its_late_answer():
    desk, sent, clock = _desk(batch_size=2, max_wait_s=0)
    _hello(desk, "A")
    desk.add(*_group(1))
    desk.tick()
    first = sent[-1][1]
    _hello(desk, "B")
    clock.t = 6.0  # A silent past peer_timeout_s; B heard from
    desk.seen("B", b"B")
    desk.tick()
    assert "A" not in desk.scorers and sent[-1][0] == b"B"
    assert sorted(i.item_id for i in sent[-1][1].items) == sorted(i.item_id for i in first.items)
    late = m.ScoreDone(scorer_id="A", batch_id=first.batch_id,
                       results=[m.ItemScores(i.item_id, {"j": 1.0}) for i in first.items])
    desk.on_done(late)
    assert desk.counts["scored"] == 0 and desk.counts["reassigned"] == 2
    desk.on_done(m.ScoreDone(scorer_id="B", batch_id=sent[-1][1].batch_id,
                             results=[m.ItemScores(i.item_id, {"j": math.nan})
                                      for i in sent[-1][1].items]))
    [w] = desk.take_finished()
    assert [s.reward for s in w.msg.samples] == [0.5, 0.5]  # unreadable: 0, flagged
    assert w.msg.samples[0].scores["j_unparsed"] == 1.0
    snap = desk.snapshot()
    assert snap["samples"] == snap["scored"] + snap["failed"] + snap["live"] == 2
    assert snap["delivered"] == 2 and balanced(snap)


def test_desk_fails_unscored_samples_at_the_deadline_and_refuses_malformed_answers():
    desk, sent, clock = _desk(batch_size=2, max_wait_s=0, deadline_s=10, batch_timeout_s=4)
    desk.add(*_group(1))
    desk.tick()
    assert sent == []  # no scorer yet: the samples wait
    _hello(desk, "A")
    desk.tick()
    batch = sent[-1][1]
    bad = m.ScoreDone(scorer_id="A", batch_id=batch.batch_id,
                      results=[m.ItemScores(batch.items[0].item_id, {"other": 1.0})])
    assert "results for items" in desk.on_done(bad)  # requeued
    clock.t = 3.0
    desk.seen("A", b"A")
    desk.tick()
    batch = sent[-1][1]
    clock.t = 11.0  # past the deadline; A still alive
    desk.seen("A", b"A")
    desk.tick()
    [w] = desk.take_finished()
    assert all(s.scores == {"j": 0.0, "reward_failed": 1.0} for s in w.msg.samples)
    assert desk.snapshot()["failed"] == 2 and not desk.items and balanced(desk.snapshot())
    desk.on_done(m.ScoreDone(scorer_id="A", batch_id=batch.batch_id,
                             results=[m.ItemScores(i.item_id, {"j": 1.0}) for i in batch.items]))
    assert desk.counts["scored"] == 0  # too late: each sample counted once, as failed


def _answer(desk, scorer: str, batch, value) -> None:
    assert desk.on_done(m.ScoreDone(scorer_id=scorer, batch_id=batch.batch_id, results=[
        m.ItemScores(i.item_id, {"j": value(i)}) for i in batch.items])) == ""


def test_desk_scores_streamed_samples_before_their_group_arrives():
    """Samples streamed as their rollouts end are scored across groups while the groups are
    still generated; a group whose samples are all scored goes on as it arrives, one still
    being scored waits; a sample streamed after its group is not scored twice."""
    desk, sent, clock = _desk(batch_size=2, max_wait_s=0)
    _hello(desk, "A")
    (g1, r1, t1), (g2, r2, t2) = _group(1), _group(2)
    desk.leases_outstanding |= {1, 2}
    desk.stream(r1, 1, np.array([7, 7], np.int32))
    desk.stream(r2, 0, np.array([6, 7], np.int32))
    desk.stream(r1, 1, np.array([7, 7], np.int32))  # a second copy: ignored
    desk.tick()
    [(_, batch)] = sent  # two leases' samples in one batch, before either group arrived
    assert [(desk.items[i.item_id].lease_id, i.completion_ids.to_numpy().tolist())
            for i in batch.items] == [(1, [7, 7]), (2, [6, 7])]
    _answer(desk, "A", batch, lambda i: 0.5)
    desk.stream(r1, 0, np.array([6, 7], np.int32))
    desk.tick()
    _answer(desk, "A", sent[-1][1], lambda i: 1.0)
    assert desk.take_finished() == [] and desk.snapshot()["held"] == 3
    assert desk.add(g1, r1, t1) == ""  # every sample already scored: finished at once
    assert desk.counts["early"] == 2
    [w] = desk.take_finished()
    assert [s.reward for s in w.msg.samples] == [0.5 + 2.0, 0.5 + 2.0 * 0.5]
    assert desk.add(g2, r2, t2) == ""  # sample 1 was never streamed: queued from the group
    desk.tick()
    assert [i.completion_ids.to_numpy().tolist() for i in sent[-1][1].items] == [[7, 7]]
    _answer(desk, "A", sent[-1][1], lambda i: 0.0)
    [w] = desk.take_finished()
    assert w.group.rewards.tolist() == [0.5 + 2.0 * 0.5, 0.5]
    desk.stream_late()  # (the server's count of a SampleDone whose lease had closed)
    snap = desk.snapshot()
    assert (snap["samples"], snap["streamed"], snap["scored"], snap["delivered"],
            snap["stream_late"], snap["live"], snap["held"]) == (4, 3, 4, 4, 2, 0, 0)
    assert balanced(snap)


def test_desk_drops_streamed_samples_of_a_lease_without_its_group():
    """A lease that ends without its group (actor dead, agent error): its streamed samples are
    dropped, scored (`wasted`) or not (`discarded`), and a late answer for them is ignored. A
    group whose ids differ from the streamed ones is refused."""
    desk, sent, clock = _desk(batch_size=1, max_wait_s=0, in_flight=1)
    _hello(desk, "A")
    (g1, r1, t1), (g2, r2, t2) = _group(1), _group(2)
    desk.leases_outstanding |= {1, 2}
    desk.stream(r1, 0, np.array([6, 7], np.int32))
    desk.stream(r1, 1, np.array([7, 7], np.int32))
    desk.tick()
    first = sent[-1][1]
    _answer(desk, "A", first, lambda i: 1.0)
    desk.tick()
    second = sent[-1][1]  # sample 1, at the scorer
    desk.leases_outstanding.discard(1)  # lease 1 expired
    desk.tick()
    snap = desk.snapshot()
    assert (snap["wasted"], snap["discarded"], snap["streaming"]) == (1, 1, 0) and not desk.items
    _answer(desk, "A", second, lambda i: 1.0)
    assert desk.counts["late"] == 1 and desk.counts["scored"] == 1
    desk.stream(r2, 0, np.array([6, 6], np.int32))  # not what the group will say
    assert "sample 0's completion differs" in desk.add(g2, r2, t2)
    snap = desk.snapshot()
    assert not desk.items and len(desk) == 0 and snap["discarded"] == 2 and balanced(snap)


def test_rule_and_model_rewards_mix_by_weight(tmp_path):
    """A function scorer (built-in regex reward, in its process pool) and the classifier, by
    weight: the actor's part plus the desk's part equal 0.3 * rule + 2.0 * p(has7), p computed
    here by hand with the model itself."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from actors.scorer import build_scorers, score_items
    from models.tiny import build_tokenizer
    from tasks.reverse import ReverseTask
    from tasks.scorers import agent_reward, make_item

    rm = tmp_path / "rm"
    build_seven_classifier(rm, steps=10)  # its taste does not matter here, only the numbers
    cfg = load_config(None, ["task.scorers=[{kind: function, name: rule, weight: 0.3, "
                             "fn: tasks.builtin_rewards:regex_format, kwargs: {pattern: '7'}, workers: 1}, "
                             f"{{kind: classifier, name: rm, weight: 2.0, path: {rm}, "
                             "output: has7}]"])
    tok = build_tokenizer()
    task = ReverseTask(tok)
    prompt = task.train_prompt(0)
    comps = [np.array(tok.convert_tokens_to_ids(c.split()), np.int32)
             for c in ("7 1 2 3", "1 2 3 4", "7 7", "9")]
    reward = agent_reward(cfg.task, task, tok)
    try:
        actor_part = [asyncio.run(reward(prompt.meta, c)) for c in comps]
    finally:
        reward.__self__.close()

    async def model_part():
        scorers = await build_scorers(cfg)
        items = [make_item(tok, prompt.meta, prompt.token_ids, c) for c in comps]
        return await score_items(scorers, items)

    scores = asyncio.run(model_part())
    model = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    texts = ["rev " + " ".join(tok.decode(prompt.token_ids[2:-1]).split()) + " = " +
             tok.decode(c) for c in comps]
    with torch.inference_mode():
        enc = tok(texts, padding=True, return_tensors="pt")
        enc.pop("token_type_ids", None)
        p = torch.softmax(model(**enc).logits, -1)[:, 1].tolist()
    rule = [1.0, 0.0, 1.0, 0.0]
    for i in range(len(comps)):
        total = actor_part[i].reward + 2.0 * scores[i]["rm"]
        assert total == pytest.approx(0.3 * rule[i] + 2.0 * p[i], abs=1e-6)
        assert actor_part[i].scores["rule"] == rule[i]
        assert actor_part[i].scores["rule_reward_error"] == 0.0


def test_remote_judge_calls_with_bounded_concurrency_and_retries():
    from configs.scorers import RemoteScorer
    from tasks.scorers.base import Item
    from tasks.scorers.remote import Remote

    with FakeOpenAIJudge(delay_s=0.05, fail_first=2) as server:
        judge = Remote(RemoteScorer(name="gpt", base_url=server.base_url, max_concurrency=3,
                                    retries=2, retry_backoff_s=0.01))
        answers = ["7 7", "1", "7", "2 7 7 7", "x"] * 4
        items = [Item("q", a, None, {}, [], []) for a in answers]

        async def go():
            try:
                return await judge.score(items)
            finally:
                await judge.close()

        scores = asyncio.run(go())
    assert scores == [5 * a.count("7") / 10 for a in answers]
    assert server.max_active == 3  # the limit was reached and never passed
    assert server.requests == len(items) + 2 == judge.requests  # two 503s retried


def test_remote_judge_gives_up_on_a_refused_request():
    from configs.scorers import RemoteScorer
    from tasks.scorers.base import Item
    from tasks.scorers.remote import Remote, RemoteError

    with FakeOpenAIJudge(fail_first=100) as server:
        judge = Remote(RemoteScorer(name="gpt", base_url=server.base_url, retries=1,
                                    retry_backoff_s=0.01))

        async def go():
            try:
                return await judge.score([Item("q", "7", None, {}, [], [])])
            finally:
                await judge.close()

        with pytest.raises(RemoteError, match="HTTP 503.*after 1 retries"):
            asyncio.run(go())
    assert server.requests == 2
