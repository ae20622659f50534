"""Ecosystem environments as the agent (`actors.agent=environment`), over the OpenAI-client path.

    actors.agent.environment = "package.module:ENV"      an object (or a zero-argument factory) with

        async def rollout(self, client: openai.AsyncOpenAI, model: str,
                          messages: list[dict], meta: dict) -> list[dict]
            plays one episode through `client` (its own tools, turns, parsing) and returns the
            completion messages (what it added after `messages`)
        def rubric(self, messages: list[dict], completion: list[dict], meta: dict) -> float
            the reward (may be async)

    EnvironmentAgent.run(task, llm)
      open an endpoint session -> AsyncOpenAI(base_url of the session)
      env.rollout(client, "tether", prompt messages, task.meta)    every model call recorded
      close -> reward = env.rubric(...) -> Rollout (token ids, masks, versions from the endpoint)

Optional attributes of the environment:

        dataset          its prompts: a list of row dicts (or a `datasets.Dataset`), each with
                         the prompt under `task.prompt_key` (a string or chat messages) and any
                         other columns (e.g. `answer`, `info`)
        eval_dataset     held-out rows of the same shape (else `task.eval_fraction` of dataset)
        tools            OpenAI tool definitions its episodes send: rendered into the prompts

With `task.name: environment` the environment's own dataset is the task (tasks/environment.py,
which also loads the environment and lists its optional attributes); `actors.agent.environment`
defaults to `task.environment`.

This is the shape in which verifiers environments run their episodes (an OpenAI client, a
model name, the prompt, the row's info) and score them (a rubric over the conversation), without
the package; environments written with verifiers itself run through actors/agents/verifiers.py.
"""

from __future__ import annotations

import inspect

from actors.agents.openai.server import OpenAIAgent, finished
from actors.engines.base import LLMClient
from actors.rollout import Rollout, RolloutTask
from tasks.environment import Environment


class EnvironmentAgent:
    """Runs the environment's episode through the endpoint; its rubric gives the reward."""

    def __init__(self, agent: OpenAIAgent, env: Environment) -> None:
        self.agent = agent
        self.env = env
        self.client = None
        """One AsyncOpenAI client (one connection pool) for every rollout, made on first use on
        the actor's loop; each rollout gets a copy with its session's base URL."""

    async def run(self, task: RolloutTask, llm: LLMClient) -> Rollout:
        import openai  # the `agents` extra

        if self.client is None:
            # default retries: the endpoint answers a repeated call with the answer it gave
            self.client = openai.AsyncOpenAI(base_url="http://127.0.0.1", api_key="-")

        async def episode(base_url: str, messages: list[dict]) -> tuple[list[dict], list[dict]]:
            client = self.client.with_options(base_url=base_url)
            return messages, await self.env.rollout(client, "tether", list(messages), task.meta)

        session, (messages, completion) = await self.agent.serve(task, llm, episode)
        reward = self.env.rubric(messages, completion, task.meta)
        if inspect.isawaitable(reward):
            reward = await reward
        return finished(session, float(reward))
