"""Agents written with openai-agents, LangGraph (langchain-openai) and pydantic-ai
(tests/thirdparty_agents.py, the `agents-thirdparty` extra) run unchanged as `actors.agent=openai`
on the calculator tool task: a learner with an in-process actor trains a few steps on their
rollouts (the tool called through the endpoint, its result sent back as a `role: tool` message),
both held-out evaluations run them on the learner's side, accounting balances, no rollout fails,
and nothing prints "Event loop is closed" (the learner ran each evaluation on a fresh event loop,
which broke the clients these libraries keep process-wide: see learner/evaluate.py)."""

from __future__ import annotations

import pytest

import procs
from configs.loader import load_config

PRESET = procs.ROOT / "configs" / "toy_calculator.yaml"
AGENTS = procs.ROOT / "tests" / "thirdparty_agents.py"


@pytest.mark.parametrize("library, module", [("openai_agents", "agents"),
                                             ("langgraph", "langgraph"),
                                             ("pydantic_ai", "pydantic_ai")])
def test_a_thirdparty_agent_trains_as_the_actors_agent(library, module, tmp_path, capfd,
                                                       calculator_model_dir):
    pytest.importorskip(module, reason="the agents-thirdparty extra (test.sh installs it)")
    steps = 2
    s, logs = procs.run_inproc(
        tmp_path / "run", calculator_model_dir, f"learner.max_steps={steps}",
        "learner.prompts_per_step=2", "learner.group_size=2", "task.eval_prompts=4",
        "actors.num_local=1", "actors.agent.kind=openai",
        f"actors.agent.function={AGENTS}:{library}", preset=PRESET)
    assert s["end_reason"] == "finished" and s["steps"] == steps and s["accounting_ok"], s
    assert s["groups"]["dropped"] == {} and s["rejected_messages"] == {}, s
    assert s["eval_errors_start"] == s["eval_errors_end"] == 0, s
    assert None not in (s["eval_reward_start"], s["eval_reward_end"]), s
    assert "error" not in s["rollout_ends"] and sum(s["rollout_ends"].values()) >= 8, s
    # the library ran the calculator and sent its result back: tool tokens reached the learner
    assert any(r["tool_tokens_frac"] > 0 for r in procs.metrics(tmp_path / "run"))
    text = "".join("\n".join(lines) for lines in logs.lines.values())
    out, err = capfd.readouterr()
    for where in (text, out, err):
        assert "agent failed" not in where and "Event loop is closed" not in where, where[-3000:]


def test_evaluations_share_one_event_loop_for_clients_kept_process_wide(calculator_model_dir,
                                                                        capfd):
    """Each held-out evaluation ran on a fresh event loop (asyncio.run): an agent whose library
    keeps one async client for the process failed the second evaluation's rollouts with
    "Event loop is closed" (or retried them, with tracebacks)."""
    from actors.engines.hf import HFEngine
    from configs.imports import load_object
    from learner.evaluate import LOOP, held_out
    from models.tiny import load_tokenizer
    from tasks import make_task

    cfg = load_config(PRESET, [f"model.path={calculator_model_dir}", "task.eval_prompts=4",
                               "actors.agent.kind=openai",
                               f"actors.agent.function={AGENTS}:shared_client"])
    tokenizer = load_tokenizer(calculator_model_dir)
    task, engine = make_task(cfg.task, tokenizer), HFEngine(calculator_model_dir)
    first, second = (held_out(engine, task, cfg, tokenizer) for _ in range(2))
    assert (first.errors, second.errors) == (0, 0) and first.reward == second.reward, (first, second)
    LOOP.run(load_object(f"{AGENTS}:SHARED", "the agent's session").close())
    out, err = capfd.readouterr()
    assert "Event loop is closed" not in out + err, err
