"""An environment (actors/environment.py: an OpenAI-client rollout and a rubric, the shape of a
verifiers environment) runs as the agent of a real actor process, and its rubric's reward is
what the learner trains on."""

from __future__ import annotations

import asyncio

import numpy as np

import procs
from actors.environment import load_environment
from actors.environment_example import CalculatorEnv
from transport.messages import FINISH_REASONS

PROBE = '''
from actors.environment_example import CalculatorEnv


class ProbeEnv(CalculatorEnv):
    """The calculator episode, but a rubric no task reward can give (groups of 4 samples of a
    3-digit task average to multiples of 1/12)."""

    def rubric(self, messages, completion, meta):
        assert any(m["role"] == "assistant" for m in completion)
        return 0.375
'''


def test_an_environments_rubric_reward_reaches_the_learner(tmp_path, monkeypatch):
    (tmp_path / "probe_env.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", f"{procs.ROOT}:{tmp_path}")
    run = tmp_path / "run"
    steps = 3
    lp = procs.learner(run, tmp_path / "model", f"learner.max_steps={steps}",
                       "learner.prompts_per_step=4", "learner.group_size=4", "learner.log_every=1",
                       "task.eval_prompts=4", "actors.num_local=1", "actors.agent=environment",
                       "actors.environment=probe_env:ProbeEnv",
                       preset=procs.ROOT / "configs" / "toy_calculator.yaml")
    s = procs.finish_clean(lp, run, steps, timeout=600)
    rows = procs.metrics(run)
    assert [r["reward_mean"] for r in rows] == [0.375] * steps, rows
    assert s["eval_reward_start"] == s["eval_reward_end"] == 0.375
    assert all(r["tool_tokens_frac"] > 0 for r in rows)  # the episodes called the calculator
    assert set(s["rollout_ends"]) <= set(FINISH_REASONS) and "error" not in s["rollout_ends"]


def test_the_example_environments_rubric_scores_the_final_answer():
    env = load_environment("actors.environment_example:CalculatorEnv")
    assert isinstance(env, CalculatorEnv)
    done = [{"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "9 2 8"}, {"role": "assistant", "content": "9 2 7"}]
    assert np.isclose(env.rubric([], done, {"target": "928"}), 2 / 3)
    assert env.rubric([], [], {"target": "928"}) == 0.0
    assert asyncio.iscoroutinefunction(env.rollout)


def test_the_environment_agent_records_the_endpoints_trajectory_and_scores_with_its_rubric():
    from actors.environment import EnvironmentAgent
    from actors.openai_server import OpenAIAgent, OpenAIEndpoint
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
