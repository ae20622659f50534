"""Multi-turn agents and tools: token assembly, call parsing, limits, the python sandbox, the
learner's handling of tool tokens, the OpenAI-compatible endpoint, and an end-to-end run."""

from __future__ import annotations

import asyncio
import http.client
import json

import numpy as np
import pytest
import torch

import procs
from configs.loader import load_config
from actors.actor import _sample
from actors.rollout import RolloutTask
from tasks.chat import TinyChat
from actors.engines.base import Completion
from actors.agents.openai.example import calculator_agent
from actors.agents.openai.server import OpenAIAgent, OpenAIEndpoint
from actors.agents.tool_agent import ToolAgent
from actors.agents.tools import CallError, Calculator, PythonTool, ToolCall, ToolRegistry, parse_call
from actors.rollout import Finish
from actors.agents.trajectory import TrajectoryBuilder
from buffer.record import TrajGroup
from configs.schema import LearnerConfig
from learner.algo.batch import collate
from learner.leases import LeaseRecord
from learner.algo.loss import policy_loss
from learner.algo.trainer import _staleness_metrics
from learner.validate import InvalidTrajectory, to_group
from models.tiny import build_tokenizer, vocab_for
from tasks.base import Prompt
from tasks.calculator import CalculatorTask
from transport import messages as m

TOK = build_tokenizer(vocab_for("calculator"))
TASK = CalculatorTask(TOK, num_digits=3)
CHAT = TinyChat(TOK)


def ids(text: str) -> np.ndarray:
    return np.asarray(TOK.encode(text, add_special_tokens=False), dtype=np.int32)


class ScriptedLLM:
    """A named fake engine client: answers each generate() with the next scripted turn (text +
    <eos>), with logprob -0.1 * (turn + 1) per token and weight version `version`."""

    def __init__(self, turns: list[str], version: int = 3) -> None:
        self.turns = turns
        self.version = version
        self.calls: list[tuple[np.ndarray, int, int]] = []

    async def generate(self, prompt_ids, max_new_tokens, temperature, seed) -> Completion:
        k = len(self.calls)
        self.calls.append((np.asarray(prompt_ids).copy(), max_new_tokens, seed))
        tok = np.concatenate([ids(self.turns[min(k, len(self.turns) - 1)]), [TOK.eos_token_id]])
        tok = tok[:max_new_tokens].astype(np.int32)
        return Completion(token_ids=tok, logprobs=np.full(len(tok), -0.1 * (k + 1), np.float32),
                          versions=np.full(len(tok), self.version, np.int32),
                          finish_reason="stop" if tok[-1] == TOK.eos_token_id else "length")


def rollout_task(a: int = 347, b: int = 581, max_new_tokens: int = 12, index: int = 1) -> RolloutTask:
    p = TASK._prompt(5, a, b)
    return RolloutTask(prompt_id=p.prompt_id, sample_index=index, prompt_ids=p.token_ids, meta=p.meta,
                       max_new_tokens=max_new_tokens, temperature=1.0, run_seed=0)


def tool_agent(max_turns: int = 3, max_total_tokens: int = 40, tools=None) -> ToolAgent:
    return ToolAgent(TASK.reward, CHAT, tools or ToolRegistry([Calculator()], 5.0), max_turns,
                     max_total_tokens)


CALL = "<call> calc 3 4 7 + 5 8 1 </call>"
ANSWER = "9 2 8"


# ------------------------------------------------------------------ assembly


def test_multi_turn_rollout_aligns_masks_logprobs_and_versions():
    llm = ScriptedLLM([CALL, ANSWER])
    r = asyncio.run(tool_agent().run(rollout_task(), llm))
    call, result, answer = ids(CALL + " <eos>"), ids("<result> 9 2 8 </result>"), ids(ANSWER + " <eos>")
    np.testing.assert_array_equal(r.completion_ids, np.concatenate([call, result, answer]))
    want_mask = np.concatenate([np.ones(len(call)), np.zeros(len(result)), np.ones(len(answer))])
    np.testing.assert_array_equal(r.loss_mask, want_mask)
    np.testing.assert_allclose(r.logprobs, np.concatenate(
        [np.full(len(call), -0.1), np.zeros(len(result)), np.full(len(answer), -0.2)]))
    np.testing.assert_array_equal(r.versions, np.where(want_mask == 1, 3, -1))
    assert r.reward == 1.0
    # the second turn continues the exact token ids (never re-tokenized), with its own seed
    prompt = rollout_task().prompt_ids
    np.testing.assert_array_equal(llm.calls[1][0], np.concatenate([prompt, call, result]))
    assert llm.calls[0][2] == rollout_task().seed(0) and llm.calls[1][2] == rollout_task().seed(1)
    # a tiny word-level tokenizer's supervised example is the same token sequence
    ex_ids, ex_mask = TASK.supervised_example(TASK._prompt(5, 347, 581))
    np.testing.assert_array_equal(ex_ids[len(prompt):], r.completion_ids)
    np.testing.assert_array_equal(ex_mask[len(prompt):], r.loss_mask)


def test_answer_without_a_tool_is_one_turn():
    r = asyncio.run(tool_agent().run(rollout_task(), ScriptedLLM(["9 2 7"])))
    assert r.loss_mask.all() and r.reward == pytest.approx(2 / 3)


@pytest.mark.parametrize("text, want", [
    ("9 2 8", None),
    ("<call> calc 1 + 2 </call>", ToolCall("calc", "1 + 2")),
    ("  <call>python print(1)</call>\n", ToolCall("python", "print(1)")),
    ("<call> calc </call>", ToolCall("calc", "")),
    ("1 <call> calc 1 + 2 </call>", CallError),
    ("<call> calc 1 + 2 </call> 3", CallError),
    ("<call> calc 1 + 2", CallError),
    ("calc 1 + 2 </call>", CallError),
    ("<call> calc 1 </call> <call> calc 2 </call>", CallError),
    ("<call> 9calc 1 </call>", CallError),
])
def test_call_format_is_parsed_strictly(text, want):
    got = parse_call(text)
    assert got == want if want is None or isinstance(want, ToolCall) else isinstance(got, want)


@pytest.mark.parametrize("turn, message", [
    ("<call> calc 3 4 7 + </call>", "error calc takes integers joined by +"),
    ("<call> calc 3 4 7 + 1", "error malformed call"),
    ("<call> search 3 4 7 </call>", "error unknown tool 'search'"),
])
def test_bad_calls_get_an_error_message_and_the_episode_goes_on(turn, message):
    registry = ToolRegistry([Calculator()], 5.0)
    assert asyncio.run(registry.call(parse_call(turn))).startswith(message)
    llm = ScriptedLLM([turn, ANSWER])
    r = asyncio.run(tool_agent(tools=registry).run(rollout_task(), llm))
    assert len(llm.calls) == 2 and r.reward == 1.0  # the model saw the error and answered
    assert TOK.convert_tokens_to_ids("error") in r.completion_ids[r.loss_mask == 0]


def test_turn_and_token_limits_end_the_episode():
    llm = ScriptedLLM([CALL])  # calls the tool for ever
    agent = tool_agent(max_turns=2)
    traj = TrajectoryBuilder(rollout_task().prompt_ids, 40)
    assert asyncio.run(agent.episode(rollout_task(), llm, traj)) == Finish.MAX_TURNS
    assert traj.turns == 2 and len(llm.calls) == 2
    traj = TrajectoryBuilder(rollout_task().prompt_ids, 20)
    agent = tool_agent(max_turns=5)
    assert asyncio.run(agent.episode(rollout_task(), ScriptedLLM([CALL]), traj)) == Finish.MAX_TOKENS
    assert traj.num_tokens == 20  # the second call was cut to the 3 tokens left
    r = asyncio.run(tool_agent(max_turns=5, max_total_tokens=30).run(rollout_task(), ScriptedLLM([CALL])))
    assert len(r.completion_ids) <= 30 and r.reward == 0.0


def test_tool_that_times_out_answers_with_an_error():
    class Stuck:
        name = "stuck"

        async def run(self, argument: str) -> str:
            await asyncio.Event().wait()  # never set: only the timeout ends this call

    out = asyncio.run(ToolRegistry([Stuck()], 0.05).call(ToolCall("stuck", "")))
    assert out == "error stuck timed out after 0.05s"


# ------------------------------------------------------------------ how rollouts end


def test_rollouts_report_how_they_ended():
    from actors.rollout import Finish as AgentFinish
    from actors.agents.single_turn import SingleTurnAgent

    assert Finish is AgentFinish and tuple(f.value for f in Finish) == m.FINISH_REASONS
    run = lambda agent, llm: asyncio.run(agent.run(rollout_task(), llm))  # noqa: E731
    assert run(tool_agent(), ScriptedLLM([CALL, ANSWER])).finish == "answer"
    assert run(tool_agent(max_turns=2), ScriptedLLM([CALL])).finish == "max_turns"
    assert run(tool_agent(max_turns=5, max_total_tokens=30), ScriptedLLM([CALL])).finish == "max_tokens"
    cut_answer = asyncio.run(tool_agent().run(rollout_task(max_new_tokens=2), ScriptedLLM([ANSWER])))
    assert cut_answer.finish == "max_tokens"  # no call, but cut before its <eos>
    single = SingleTurnAgent(TASK.reward)
    assert run(single, ScriptedLLM([ANSWER])).finish == "answer"  # stopped at <eos>
    cut = asyncio.run(single.run(rollout_task(max_new_tokens=2), ScriptedLLM([ANSWER])))
    assert cut.finish == "max_tokens"  # cut at task.max_new_tokens
    assert _sample(0, cut)[0].finish == "max_tokens"
    assert _sample(1, RuntimeError("x"))[0].finish == "error"


@pytest.mark.parametrize("finish, ok", [
    ("answer", True), ("max_turns", True), ("max_tokens", True), ("", True),
    ("error", False), ("done", False)])
def test_learner_validates_the_end_reason(finish, ok):
    msg = _group_msg()
    for s in msg.samples:
        s.finish = finish
    if ok:
        to_group(msg, _lease(), 16, latest_version=5, max_tokens=8)
    else:
        with pytest.raises(InvalidTrajectory, match="finish must be one of"):
            to_group(msg, _lease(), 16, latest_version=5, max_tokens=8)


def test_step_metrics_report_the_ends_of_the_rollouts_received_since_the_last_step(tmp_path):
    from configs.schema import TetherConfig
    from learner.obs.metrics import MetricsLog

    cfg = TetherConfig()
    cfg.learner.tensorboard = False
    log = MetricsLog(tmp_path / "metrics.jsonl", cfg, None)
    assert log._ends({"answer": 3, "max_turns": 1}) == {
        "rollouts": 4, "end_answer_frac": 0.75, "end_max_turns_frac": 0.25,
        "end_max_tokens_frac": 0.0, "end_error_frac": 0.0}
    later = log._ends({"answer": 4, "max_turns": 1, "error": 2, "unreported": 1})
    assert later["rollouts"] == 4 and later["end_answer_frac"] == 0.25
    assert later["end_error_frac"] == 0.5
    assert log._ends({"answer": 4, "max_turns": 1, "error": 2, "unreported": 1})["rollouts"] == 0
    log.close()


# ------------------------------------------------------------------ python sandbox


@pytest.mark.parametrize("code, wall_s, want", [
    ("print(6 * 7)", 30, "42"),
    ("x = bytearray(8 * 1024**3)", 30, "error python failed: MemoryError"),
    ("while True: pass", 30, "error python killed by SIGXCPU (cpu time limit)"),  # 1 s of CPU
    ("import time\nwhile True: time.sleep(0.01)", 1.5, "error python timed out after 1.5s"),
    ("raise ValueError('bad')", 30, "error python failed: ValueError: bad"),
])
def test_python_tool_limits_time_and_memory(code, wall_s, want):
    registry = ToolRegistry([PythonTool(cpu_s=1, memory_mb=256)], timeout_s=wall_s)
    assert asyncio.run(registry.call(ToolCall("python", code))) == want


def test_python_tool_runs_under_uvloop_and_kills_on_timeout():
    import uvloop

    registry = ToolRegistry([PythonTool(cpu_s=5, memory_mb=256)], timeout_s=0.5)
    code = "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(60)"
    assert uvloop.run(registry.call(ToolCall("python", code))) == "error python timed out after 0.5s"


# ------------------------------------------------------------------ learner side


def _lease(min_version=3):
    return LeaseRecord(lease_id=7, prompt=Prompt(5, np.array([1, 4, 6], np.int32), {}),
                       actor_id="a", incarnation="i", num_samples=2, min_version=min_version)


def _group_msg(version_model=3, version_tool=-1, mask=(1, 0, 0, 1)):
    n = len(mask)
    tokens = dict(completion_ids=np.full(n, 6, np.int32),
                  logprobs=np.where(np.array(mask) == 1, -0.5, 0.0).astype(np.float32),
                  versions=np.where(np.array(mask) == 1, version_model, version_tool).astype(np.int32),
                  loss_mask=np.array(mask, np.uint8))
    return m.pack_group(lease_id=7, actor_id="a", prompt_id=5,
                        samples=[m.Sample(sample_index=i, reward=float(i)) for i in range(2)],
                        tokens=[tokens, tokens])


def test_tool_tokens_are_validated_but_not_counted_in_versions_or_staleness():
    g = to_group(_group_msg(), _lease(), 16, latest_version=5, max_tokens=8)
    assert g.min_version == 3 and g.max_version == 3  # the -1 of tool tokens is not a version
    stats = _staleness_metrics([g], version=5)
    assert stats["staleness_max"] == 2 and stats["staleness_mean"] == 2  # model tokens only
    with pytest.raises(InvalidTrajectory, match="versions of model tokens"):
        to_group(_group_msg(version_model=-1), _lease(), 16, latest_version=5, max_tokens=8)
    with pytest.raises(InvalidTrajectory, match="versions of tool tokens"):
        to_group(_group_msg(version_tool=9), _lease(), 16, latest_version=5, max_tokens=8)
    with pytest.raises(InvalidTrajectory, match="no model tokens"):
        to_group(_group_msg(mask=(0, 0)), _lease(), 16, latest_version=5, max_tokens=8)


def test_tool_tokens_get_no_gradient_and_are_not_in_token_means():
    g = TrajGroup.build(lease_id=1, prompt_id=0, actor_id="a", prompt_ids=np.array([1, 4]),
                  completions=[np.array([6, 7, 8, 9]), np.array([6, 7])],
                  logprobs=[np.array([-0.5, 0.0, 0.0, -0.5], np.float32), np.array([-0.5, -0.5], np.float32)],
                  versions=[np.array([3, -1, -1, 3]), np.array([3, 3])],
                  loss_masks=[np.array([1, 0, 0, 1], np.float32), np.ones(2, np.float32)],
                  rewards=np.array([1.0, 0.0], np.float32))
    b = collate([g], pad_id=0)
    assert b.num_tokens == 4  # 2 + 2 model tokens; tool and padding positions are not counted
    logp = torch.full(b.mask.shape, -0.7, requires_grad=True)
    staleness = (3 - b.versions) * b.mask.long()
    assert int(staleness.min()) >= 0
    loss, _ = policy_loss(logp, b.behavior, logp.detach(), torch.tensor([1.0, -1.0]), b.mask,
                          staleness, LearnerConfig(correction="decoupled"), 40)
    loss.backward()
    tool_cols = [2, 3]  # completion tokens 1 and 2 of row 0 sit in columns P-1+1, P-1+2
    assert torch.all(logp.grad[0, tool_cols] == 0) and torch.all(logp.grad[0, [1, 4]] != 0)
    # token_mean: the loss is the mean over the 4 model tokens, whatever the tool tokens hold
    per_token = -torch.tensor([1.0, 1.0, -1.0, -1.0])
    assert float(loss.detach()) == pytest.approx(float(per_token.mean()), abs=1e-6)


def test_an_agent_exception_becomes_a_failed_sample_with_its_reason():
    s, tokens = _sample(3, RuntimeError("tool crashed"))
    assert s.error == "RuntimeError: tool crashed" and tokens is None
    msg = m.pack_group(lease_id=1, actor_id="a", prompt_id=2, samples=[s], tokens=[tokens])
    assert msg.samples[0].num_tokens == 0 and msg.completion_ids.shape == (0,)


# ------------------------------------------------------------------ OpenAI-compatible endpoint


def _post(port: int, path: str, body: dict | bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_openai_client_agent_yields_the_same_trajectory_as_the_tool_agent():
    endpoint = OpenAIEndpoint(CHAT, 0, max_turns=3, max_total_tokens=40)
    agent = OpenAIAgent(endpoint, calculator_agent, TASK.reward)

    async def both():
        via_http = await agent.run(rollout_task(), ScriptedLLM([CALL, ANSWER]))
        await endpoint.close_server()
        return via_http, await tool_agent().run(rollout_task(), ScriptedLLM([CALL, ANSWER]))

    via_http, direct = asyncio.run(both())
    for field in ("completion_ids", "logprobs", "versions", "loss_mask"):
        np.testing.assert_array_equal(getattr(via_http, field), getattr(direct, field))
    assert via_http.reward == direct.reward == 1.0
    assert endpoint.sessions == {}


def test_openai_example_agent_answers_a_bad_call_with_an_error_and_goes_on():
    endpoint = OpenAIEndpoint(CHAT, 0, max_turns=3, max_total_tokens=40)
    agent = OpenAIAgent(endpoint, calculator_agent, TASK.reward)
    llm = ScriptedLLM(["<call> calc 3 4 7 + + </call>", ANSWER])

    async def go():
        r = await agent.run(rollout_task(), llm)
        await endpoint.close_server()
        return r

    r = asyncio.run(go())
    assert len(llm.calls) == 2 and r.reward == 1.0 and r.finish == "answer"
    assert TOK.convert_tokens_to_ids("error") in r.completion_ids[r.loss_mask == 0]


def test_openai_endpoint_speaks_the_wire_format_and_refuses_bad_calls():
    endpoint = OpenAIEndpoint(CHAT, 0, max_turns=2, max_total_tokens=40)
    task = rollout_task()
    prompt = CHAT.prompt_messages(task.prompt_ids)

    async def scenario():
        await endpoint.start()
        s = endpoint.open(task, ScriptedLLM([CALL, ANSWER, CALL]))
        path = f"/rollout/{s.rid}/v1/chat/completions"
        call = lambda p, body: asyncio.to_thread(_post, endpoint.port, p, body)  # noqa: E731
        out = {"unknown": await call("/rollout/nope/v1/chat/completions", {"messages": prompt}),
               "route": await call("/v2/complete", {"messages": prompt}),
               "json": await call(path, b"{not json"),
               "not_prompt": await call(path, {"messages": [{"role": "user", "content": "1 + 1"}]}),
               "n": await call(path, {"messages": prompt, "n": 2})}
        out["first"] = await call(path, {"model": "tether", "messages": prompt, "max_tokens": 50})
        reply = out["first"][1]["choices"][0]["message"]
        out["edited"] = await call(path, {"messages": [*prompt, {"role": "assistant", "content": "x"},
                                                       {"role": "tool", "content": "1"}]})
        history = [*prompt, reply, {"role": "tool", "content": "9 2 8"}]
        out["second"] = await call("/v1/chat/completions", {"messages": history, "user": s.rid})
        history += [out["second"][1]["choices"][0]["message"], {"role": "user", "content": "again"}]
        out["over"] = await call(path, {"messages": history})
        await endpoint.close_server()
        return out, endpoint.close(s.rid)

    out, s = asyncio.run(scenario())
    assert out["unknown"][0] == 404 and "no open rollout" in out["unknown"][1]["error"]["message"]
    assert out["route"][0] == 404
    assert out["json"][0] == 400 and "bad request body" in out["json"][1]["error"]["message"]
    assert out["not_prompt"][0] == 400 and "task prompt" in out["not_prompt"][1]["error"]["message"]
    assert out["n"][0] == 400 and "only n=1" in out["n"][1]["error"]["message"]
    # a client's own temperature is answered (recorded as not applied): tests/test_openai_resend.py
    status, first = out["first"]
    assert status == 200 and first["object"] == "chat.completion"
    assert first["choices"][0] == {"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": CALL}}
    assert first["usage"] == {"prompt_tokens": 9, "completion_tokens": 11, "total_tokens": 20}
    assert out["edited"][0] == 400 and "exactly as returned" in out["edited"][1]["error"]["message"]
    assert out["second"][0] == 200 and out["second"][1]["choices"][0]["message"]["content"] == ANSWER
    assert out["over"][1]["choices"][0]["finish_reason"] == "length"  # max_turns=2 reached
    assert s.finish_reason() == Finish.MAX_TURNS
    r = s.traj.rollout(TASK.reward(task.meta, s.traj.context()[len(task.prompt_ids):]),
                       s.finish_reason())
    assert r.reward == 1.0 and s.traj.turns == 2 and r.finish == "max_turns"
    assert r.loss_mask.sum() == len(ids(CALL)) + 1 + len(ids(ANSWER)) + 1


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_calculator_tool_task_learns_end_to_end(tmp_path, calculator_model_dir):
    """Real learner + 2 actor processes over ZeroMQ, multi-turn tool agent, calculator task."""
    run = tmp_path / "run"
    preset = procs.ROOT / "configs" / "toy_calculator.yaml"
    # the preset's 120 steps: at 80, one fresh-clone run gained only +0.107 (0.34 -> 0.45)
    lp = procs.learner(run, calculator_model_dir, preset=preset)
    s = procs.finish_clean(lp, run, load_config(preset).learner.max_steps, timeout=600)
    print("calculator eval reward", s["eval_reward_start"], "->", s["eval_reward_end"],
          "in", s["wall_seconds"], "s")
    assert s["eval_reward_end"] >= s["eval_reward_start"] + 0.15, s
    rows = procs.metrics(run)
    assert all(r["staleness_max"] <= 1 for r in rows)


def test_behavior_logprobs_of_multi_turn_rollouts_match_the_learner(tmp_path):
    """A real HF engine through the tool agent: the learner's logprobs of the collated
    multi-turn rows equal the engine's behavior logprobs on every model token."""
    from actors.engines.client import EngineClient
    from actors.engines.hf import HFEngine
    from models.logprobs import token_logprobs
    from models.tiny import build_model, save

    from learner.model_setup import warm_start

    model = build_model(seed=0, vocab_size=len(vocab_for("calculator")))
    warm_start(model, TASK, steps=50, lr=3e-3)  # so that it calls the tool
    save(model, TOK, tmp_path / "m")
    engine = HFEngine(tmp_path / "m")
    engine.load_weights(model.state_dict(), 0)
    agent = tool_agent(max_turns=3, max_total_tokens=40)
    tasks = [rollout_task(100 + 7 * i, 500 + 3 * i, index=i) for i in range(16)]

    async def run_all():
        client = EngineClient(engine)
        return await asyncio.gather(*(agent.run(t, client) for t in tasks))

    rollouts = asyncio.run(run_all())
    assert any((r.loss_mask == 0).any() for r in rollouts)  # some rollouts really used the tool
    for t, r in zip(tasks, rollouts):
        g = TrajGroup.build(lease_id=1, prompt_id=5, actor_id="a", prompt_ids=t.prompt_ids.astype(np.int64),
                      completions=[r.completion_ids.astype(np.int64)], logprobs=[r.logprobs],
                      versions=[r.versions], loss_masks=[r.loss_mask.astype(np.float32)],
                      rewards=np.zeros(1, np.float32))
        b = collate([g], pad_id=0)
        with torch.no_grad():
            lp = token_logprobs(model.eval(), b.input_ids, 1.0)
        on = b.mask > 0
        torch.testing.assert_close(lp[on], b.behavior[on], atol=2e-5, rtol=0)
