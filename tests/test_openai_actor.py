"""`actors.agent=openai` inside a real actor process: a learner process spawns an actor process
that runs the urllib OpenAI-client example agent through its own chat-completions endpoint, on
the calculator tool task, over ZeroMQ."""

from __future__ import annotations

import glob

import procs
from transport.messages import FINISH_REASONS


def test_openai_client_agent_in_an_actor_process_trains_multi_turn(tmp_path, calculator_model_dir):
    run = tmp_path / "run"
    preset = procs.ROOT / "configs" / "toy_calculator.yaml"
    steps, prompts, samples = 8, 4, 4
    lp = procs.learner(run, calculator_model_dir, f"learner.max_steps={steps}",
                       f"learner.prompts_per_step={prompts}", f"learner.group_size={samples}",
                       "learner.log_every=1", "task.eval_prompts=8", "actors.num_local=1",
                       "actors.agent.kind=openai",  # with the preset's turn and token budgets
                       "actors.agent.function=actors.agents.openai.example:calculator_agent", preset=preset)
    s = procs.finish_clean(lp, run, steps, timeout=600)
    # every rollout reported how it ended; the warm-started model calls the calculator, so
    # rollouts are multi-turn (tool tokens between model turns) and mostly end in an answer
    ends = s["rollout_ends"]
    assert set(ends) <= set(FINISH_REASONS) and "error" not in ends, ends
    assert sum(ends.values()) >= steps * prompts * samples and ends.get("answer", 0) > 0, ends
    rows = procs.metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["tool_tokens_frac"] > 0 for r in rows), [r["tool_tokens_frac"] for r in rows]
    assert all(sum(r[f"end_{e}_frac"] for e in FINISH_REASONS) in (0, 1) or
               abs(sum(r[f"end_{e}_frac"] for e in FINISH_REASONS) - 1) < 1e-9 for r in rows)
    (actor_log,) = glob.glob(str(run / "logs" / "actor-*.log"))
    text = open(actor_log).read()
    assert "OpenAI-compatible endpoint on http://127.0.0.1:" in text and "groups generated" in text
    assert "agent failed" not in text and "Traceback" not in text, text[-3000:]
