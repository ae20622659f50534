"""verifiers environments as the agent (`actors.agent=verifiers`, `task.name=verifiers`).

verifiers (0.4.0, `verifiers.v1`, the library prime-rl's environments are written in) plays an
episode by running its harness program against an interception server of its own (one per
episode here), which relays
every model call with its eval client (`verifiers/v1/clients/eval.py`) to an OpenAI-compatible
base URL; the task's `@vf.reward` functions then score the trace. The base URL here is the
rollout's session on the actor's endpoint (actors/agents/openai/server.py), so every sampled token is
recorded exactly, with its weight version, and the trace's reward is the sample's reward:

    VerifiersAgent.run(task, llm)
      open an endpoint session ──▶ env.run_episode(vf task, ModelContext(base_url of the session,
                                   temperature = task.temperature))
        harness ─HTTP─▶ verifiers interception ─EvalClient─▶ endpoint ─▶ llm.generate (recorded)
      close ──▶ reward = trace.reward (the weighted sum of its rewards), scores = each reward's
                score ──▶ Rollout (token ids, masks, versions from the endpoint)

    task.verifiers_env = "package.module:ATTR"   a vf.Env, a vf.EnvConfig, or a zero-argument
                                                 function returning either
                       = "my-env"                a verifiers environment id: an installed package
                                                 exporting its Taskset (and Harness) in __all__

The prompts are the environment's taskset (VerifiersTask below): every task's first messages, as
the environment's harness resolves them (`Harness.resolve_prompt`: the system prompt, then the
prompt), rendered by the chat format the endpoint checks the first call against; its `idx`
travels in the lease's meta and the actor plays that task of its own copy of the taskset
(`load()` must yield the same tasks in every process). A fixed `task.eval_fraction` of the
tasks is held out. Episodes with more than one trace (multi-agent envs) and tasks whose harness
sends tools are refused: one endpoint session is one conversation, and the tools must be known
when the prompt is rendered. The prompts, the environment's loading and the
verifiers import are tasks/verifiers.py's.
"""

from __future__ import annotations

from actors.agents.openai.server import OpenAIAgent, finished
from actors.engines.base import LLMClient
from actors.rollout import Rollout, RolloutTask
from tasks.verifiers import import_verifiers

MODEL = "tether"
"""The model name verifiers sends (the endpoint serves one policy and ignores it)."""


class VerifiersEpisodeError(RuntimeError):
    """A verifiers episode ended without a usable trace: its errors, as verifiers recorded them."""


class VerifiersAgent:
    """Plays the leased task's verifiers episode through the endpoint; its trace's reward is
    the sample's. Each episode holds its own verifiers interception server (verifiers' fallback
    outside `Env.serving()`), so nothing outlives a rollout or is tied to one event loop;
    environments that need
    env-level resources (shared tool servers, `start()`/`stop()`) are refused."""

    def __init__(self, agent: OpenAIAgent, env) -> None:
        vf = import_verifiers()
        env_id = env.config.env_id
        if env.taskset.toolsets(env.taskset.config):
            raise ValueError(f"verifiers env {env_id!r} has shared tool servers: not supported "
                             f"as an actor (the tools would have to be in the rendered prompt)")
        if type(env).start is not vf.Env.start or type(env).stop is not vf.Env.stop:
            raise ValueError(f"verifiers env {env_id!r} overrides start()/stop(): env-level "
                             f"resources are not supported as an actor (episodes run outside "
                             f"Env.serving())")
        self.agent = agent
        self.env = env
        self.tasks = {t.data.idx: t for t in env.taskset}

    async def run(self, task: RolloutTask, llm: LLMClient) -> Rollout:
        vf = import_verifiers()
        vf_task = self.tasks[int(task.meta["vf_idx"])]

        async def episode(base_url: str, messages: list[dict]):
            ctx = vf.ModelContext(model=MODEL,
                                  client=vf.EvalClientConfig(base_url=base_url,
                                                             api_key_var="TETHER_ENDPOINT_KEY"),
                                  sampling=vf.Sampling(temperature=task.temperature))
            return await self.env.run_episode(vf_task, ctx)

        session, ep = await self.agent.serve(task, llm, episode)
        errors = [*ep.errors, *(e for t in ep.traces for e in t.errors)]
        if not ep.ok or errors:
            raise VerifiersEpisodeError("; ".join(f"{e.type}: {e.message}" for e in errors)
                                        or "episode not ok")
        if len(ep.traces) != 1:
            raise VerifiersEpisodeError(f"the episode has {len(ep.traces)} traces: one endpoint "
                                        f"session is one conversation")
        trace = ep.traces[0]
        scores = {name: r.score for name, r in trace.rewards.items() if r is not None}
        return finished(session, trace.reward, scores)
