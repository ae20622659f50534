"""End to end: a function-calling agent written with only the `openai` client
(actors/agents/openai/tools_example.py) learns the calculator tool task through real actor processes'
endpoints, a real learner and ZeroMQ."""

from __future__ import annotations

import glob

import pytest

import procs
from configs.loader import load_config


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the preset's 120 steps: 4 s/step here at load 10, 25 at load 25
def test_openai_function_calling_agent_learns_the_calculator_task(tmp_path, calculator_model_dir):
    run = tmp_path / "run"
    preset = procs.ROOT / "configs" / "toy_calculator.yaml"
    # kind=openai keeps the preset's max_turns and max_total_tokens (actors.agent=openai would not)
    lp = procs.learner(run, calculator_model_dir, "actors.agent.kind=openai",
                       "actors.agent.function=actors.agents.openai.tools_example:calculator_agent",
                       preset=preset)
    s = procs.finish_clean(lp, run, load_config(preset).learner.max_steps, timeout=1700)
    print("openai function-calling agent: calculator eval reward", s["eval_reward_start"], "->",
          s["eval_reward_end"], "in", s["wall_seconds"], "s; tool_parse_errors",
          s["tool_parse_errors"])
    # the same bar as the built-in tool agent's run (tests/test_agents.py)
    assert s["eval_reward_end"] >= s["eval_reward_start"] + 0.15, s
    rows = procs.metrics(run)
    assert all(r["tool_tokens_frac"] > 0 for r in rows[-10:])
    logs = "".join(open(p).read() for p in glob.glob(str(run / "logs" / "actor-*.log")))
    assert "agent failed" not in logs and "Traceback" not in logs, logs[-3000:]
