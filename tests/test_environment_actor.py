"""An environment (actors/agents/environment.py: an OpenAI-client rollout and a rubric, the shape of a
verifiers environment) runs as the agent of a real actor process, and its rubric's reward is
what the learner trains on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import procs
from tasks.environment import load_environment
from actors.agents.environment_example import CalculatorEnv
from transport.messages import FINISH_REASONS

PROBE = '''
from actors.agents.environment_example import CalculatorEnv


class ProbeEnv(CalculatorEnv):
    """The calculator episode, but a rubric no task reward can give (groups of 4 samples of a
    3-digit task average to multiples of 1/12)."""

    def rubric(self, messages, completion, meta):
        assert any(m["role"] == "assistant" for m in completion)
        return 0.375
'''


def test_an_environments_rubric_reward_reaches_the_learner(tmp_path, monkeypatch,
                                                          calculator_model_dir):
    (tmp_path / "probe_env.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", f"{procs.ROOT}:{tmp_path}")
    run = tmp_path / "run"
    steps = 3
    lp = procs.learner(run, calculator_model_dir, f"learner.max_steps={steps}",
                       "learner.prompts_per_step=4", "learner.group_size=4", "learner.log_every=1",
                       "task.eval_prompts=4", "actors.num_local=1", "actors.agent.kind=environment",
                       "actors.agent.environment=probe_env:ProbeEnv",
                       preset=procs.ROOT / "configs" / "toy_calculator.yaml")
    s = procs.finish_clean(lp, run, steps, timeout=600)
    rows = procs.metrics(run)
    assert [r["reward_mean"] for r in rows] == [0.375] * steps, rows
    assert s["eval_reward_start"] == s["eval_reward_end"] == 0.375
    assert all(r["tool_tokens_frac"] > 0 for r in rows)  # the episodes called the calculator
    assert set(s["rollout_ends"]) <= set(FINISH_REASONS) and "error" not in s["rollout_ends"]


def test_the_example_environments_rubric_scores_the_final_answer():
    env = load_environment("actors.agents.environment_example:CalculatorEnv")
    assert isinstance(env, CalculatorEnv)
    done = [{"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "9 2 8"}, {"role": "assistant", "content": "9 2 7"}]
    assert np.isclose(env.rubric([], done, {"target": "928"}), 2 / 3)
    assert env.rubric([], [], {"target": "928"}) == 0.0
    assert asyncio.iscoroutinefunction(env.rollout)


def test_the_environment_agent_records_the_endpoints_trajectory_and_scores_with_its_rubric():
    from actors.agents.environment import EnvironmentAgent
    from actors.agents.openai.server import OpenAIAgent, OpenAIEndpoint
    from test_agents import ANSWER, CALL, CHAT, ScriptedLLM, rollout_task, tool_agent

    endpoint = OpenAIEndpoint(CHAT, 0, max_turns=3, max_total_tokens=40)
    agent = EnvironmentAgent(OpenAIAgent(endpoint, None, lambda meta, ids: -1.0), CalculatorEnv())

    async def go():
        rs = await asyncio.gather(*(agent.run(rollout_task(index=i), ScriptedLLM([CALL, ANSWER]))
                                    for i in range(2)))
        await endpoint.close_server()
        await agent.client.close()
        return rs

    rollouts = asyncio.run(go())
    direct = asyncio.run(tool_agent().run(rollout_task(), ScriptedLLM([CALL, ANSWER])))
    for r in rollouts:
        for field in ("completion_ids", "logprobs", "versions", "loss_mask"):
            np.testing.assert_array_equal(getattr(r, field), getattr(direct, field))
        assert r.reward == 1.0 and r.finish == "answer"  # the rubric's, not the task's -1.0


DATA_ENV = '''
import json

from actors.agents.environment_example import CalculatorEnv


def rows(score, n):
    return [{"prompt": f"{a} 0 0 + 1 1 {a} =", "answer": int(f"{a}00") + int(f"11{a}"),
             "info": {"score": score}} for a in [1, 2, 3, 4, 5, 6, 7, 8, 9][:n]]


class DataEnv(CalculatorEnv):
    """Its own dataset: a rubric that returns the row's info.score (0.25 training, 0.75
    held out) once it has checked that the row's answer came with the row's prompt."""

    dataset = rows(0.25, 9)
    eval_dataset = rows(0.75, 3)

    def rubric(self, messages, completion, meta):
        a, _, b = messages[-1]["content"].removesuffix(" =").partition(" + ")
        assert json.loads(meta["answer"]) == int(a.replace(" ", "")) + int(b.replace(" ", "")), meta
        return json.loads(meta["info"])["score"]
'''


def test_an_environments_own_dataset_is_the_task(tmp_path, monkeypatch):
    """task.name=environment: the environment's dataset rows are the training prompts, its
    eval_dataset the held-out ones, and each row's other columns reach its rubric."""
    from models.tiny import build_model, build_tokenizer, save, vocab_for

    (tmp_path / "data_env.py").write_text(DATA_ENV)
    monkeypatch.setenv("PYTHONPATH", f"{procs.ROOT}:{tmp_path}")
    words = vocab_for("calculator")
    save(build_model(seed=0, vocab_size=len(words)), build_tokenizer(words), tmp_path / "model")
    run = tmp_path / "run"
    steps = 3
    lp = procs.learner(run, tmp_path / "model", f"learner.max_steps={steps}",
                       "learner.prompts_per_step=4", "learner.group_size=4", "learner.log_every=1",
                       "task.eval_prompts=3", "actors.num_local=1", "actors.agent.kind=environment",
                       "task.name=environment", "task.environment=data_env:DataEnv",
                       preset=procs.ROOT / "configs" / "toy_calculator.yaml")
    s = procs.finish_clean(lp, run, steps, timeout=600)
    assert [r["reward_mean"] for r in procs.metrics(run)] == [0.25] * steps
    assert s["eval_reward_start"] == s["eval_reward_end"] == 0.75


def test_the_environment_task_renders_the_rows_as_the_endpoint_does(tmp_path, monkeypatch):
    from tasks.chat import make_chat_format
    from tasks.environment import make_task
    from configs.schema import TaskConfig
    from models.tiny import build_tokenizer, vocab_for
    from tasks.calculator import CalculatorTask
    from tasks.data import DataError

    tok = build_tokenizer(vocab_for("calculator"))
    task = make_task(TaskConfig(name="environment",
                                environment="actors.agents.environment_example:CalculatorEnv"), tok)
    p = task.train_prompt(0)
    a, b = (int(x.replace(" ", "")) for x in tok.decode(p.token_ids[1:-1]).split(" + "))
    assert p.meta["target"] == str(a + b)
    # the calculator task's prompt of the same pair is the same ids; the endpoint accepts it
    want = CalculatorTask(tok).train_prompt(0)
    assert p.token_ids[0] == want.token_ids[0] and p.token_ids[-1] == want.token_ids[-1]
    chat = make_chat_format(tok)
    np.testing.assert_array_equal(chat.start(chat.prompt_messages(p.token_ids)), p.token_ids)
    assert task.num_train == 900 and len({q.meta["row"] for q in task.eval_prompts(100)}) == 100

    (tmp_path / "nodata.py").write_text("class Env:\n    async def rollout(self, *a): ...\n"
                                        "    def rubric(self, *a): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = make_task(TaskConfig(name="environment", environment="nodata:Env"), tok)
    with pytest.raises(DataError, match="'nodata:Env' has no dataset"):
        bad.train_prompt(0)


@pytest.mark.parametrize("overrides, key", [
    (["task.name=environment", "actors.agent=environment"], "task.environment"),
    (["task.name=environment", "task.environment=a:B"], "actors.agent"),
    (["task.name=environment", "task.environment=a:B", "actors.agent=environment",
      "actors.agent.environment=c:D"], "actors.agent.environment"),
])
def test_environment_task_config_errors_name_the_field(overrides, key):
    from configs.loader import ConfigError, load_config

    with pytest.raises(ConfigError, match=key):
        load_config(procs.ROOT / "configs" / "toy_calculator.yaml", overrides)
