"""A small verifiers (0.4.0, `verifiers.v1`) environment for tests/test_verifiers_actor.py,
written only with verifiers' own classes: a taskset of reverse prompts in the tiny model's words
(`rev 3 1 4 1 =`), a task whose `@vf.reward` scores the last reply, and a harness that plays the
episode in-process through the interception endpoint it is handed (verifiers' harness contract
allows this; the bundled `null` / `bash` harnesses would `uv sync` a chat program first).

As a verifiers environment id this module is `verifiers_toy` (a package exporting its Taskset
and Harness in `__all__`); `ENV` is the config Tether's adapter loads with
`actors.verifiers_env=verifiers_toy:ENV` (a local subprocess runtime instead of the default
Prime sandbox).

With `VF_TOY_LOG` set, every score the rubric computes is appended to that file as a JSON line
({"trace", "task" (its idx), "reply", and "reversed_digits" or "answered"}): the test compares them with what the learner
received.
"""

from __future__ import annotations

import json
import os

import numpy as np
import openai
import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    answer: str
    """The prompt's digits reversed, space-separated ("1 4 1 3")."""


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.5)
    async def reversed_digits(self, task: ReverseData, trace: vf.Trace) -> float:
        """Digits of the answer in the last reply, position by position."""
        got, want = _reply(trace).split(), task.answer.split()
        score = sum(g == w for g, w in zip(got, want)) / len(want)
        _log(trace, "reversed_digits", score)
        return score

    @vf.reward(weight=0.125)
    async def answered(self, trace: vf.Trace) -> float:
        """1 if the model said anything: with reversed_digits, a reward no Tether task gives."""
        score = float(bool(_reply(trace)))
        _log(trace, "answered", score)
        return score


class ReverseTaskset(vf.Taskset[ReverseTask, vf.TasksetConfig]):
    def load(self):
        digits = np.random.default_rng(11).integers(0, 10, size=(64, 4)).tolist()
        for i, d in enumerate(digits):
            yield ReverseTask(ReverseData(id=f"rev-{i}", prompt=f"rev {' '.join(map(str, d))} =",
                                          answer=" ".join(map(str, d[::-1]))),
                              self.config.task)


class InProcessChat(vf.Harness[vf.HarnessConfig]):
    """One model turn, asked in-process through the rollout's interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["InProcessChat", "ReverseTaskset"]

ENV = vf.SingleAgentEnvConfig(
    taskset={"id": "verifiers_toy"},
    agent=vf.AgentConfig(runtime=vf.SubprocessConfig()),
)
"""The environment as Tether's adapter loads it (`verifiers_toy:ENV`)."""


def _reply(trace: vf.Trace) -> str:
    return trace.last_reply


def _log(trace: vf.Trace, name: str, score: float) -> None:
    if path := os.environ.get("VF_TOY_LOG"):
        with open(path, "a") as f:
            f.write(json.dumps({"trace": trace.id, "task": trace.task.data.idx,
                                "reply": _reply(trace), name: score}) + "\n")
