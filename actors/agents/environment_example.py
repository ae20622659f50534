"""An example environment for `actors.agent=environment` (actors/agents/environment.py): the
calculator episode played through an OpenAI client with function calling, scored by its own
rubric (the fraction of the target's digits in the final answer, like a verifiers rubric's
reward function over the completion messages).

    actors.agent=environment actors.agent.environment=actors.agents.environment_example:CalculatorEnv

With its own prompts (`dataset`: 3-digit additions from a fixed seed) instead of the calculator
task's:

    task.name=environment task.environment=actors.agents.environment_example:CalculatorEnv
    actors.agent=environment
"""

from __future__ import annotations

import json
from functools import cached_property

import numpy as np

from actors.agents.openai.example import calculate
from actors.agents.openai.tools_example import TOOLS


class CalculatorEnv:
    max_turns = 4
    tools = TOOLS

    @cached_property
    def dataset(self) -> list[dict]:
        """1000 rows {"prompt": "3 4 7 + 5 8 1 =", "target": "928"} (task.name=environment)."""
        pairs = np.random.default_rng(7).integers(100, 1000, size=(1000, 2))
        return [{"prompt": f"{' '.join(str(a))} + {' '.join(str(b))} =", "target": str(a + b)}
                for a, b in pairs.tolist()]

    async def rollout(self, client, model: str, messages: list[dict], meta: dict) -> list[dict]:
        completion: list[dict] = []
        for _ in range(self.max_turns):
            choice = (await client.chat.completions.create(
                model=model, messages=[*messages, *completion], tools=TOOLS)).choices[0]
            completion.append(choice.message.model_dump(exclude_none=True))
            if choice.finish_reason != "tool_calls":
                break
            for call in choice.message.tool_calls:
                argument = json.loads(call.function.arguments)["argument"]
                completion.append({"role": "tool", "tool_call_id": call.id,
                                   "content": calculate(argument)})
        return completion

    def rubric(self, messages: list[dict], completion: list[dict], meta: dict) -> float:
        """Digits of the target in the last assistant message, position by position."""
        answers = [m.get("content") or "" for m in completion if m["role"] == "assistant"]
        got, target = (answers[-1] if answers else "").split(), list(meta["target"])
        return sum(g == t for g, t in zip(got, target)) / len(target)
