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
when the prompt is rendered. verifiers is imported only here, and only when used (the
`verifiers` extra; the import takes seconds).
"""

from __future__ import annotations

from functools import cached_property

import msgspec
import numpy as np

from tasks.chat import make_chat_format
from actors.engines.base import LLMClient
from actors.agents.openai.server import OpenAIAgent, finished
from actors.rollout import Rollout, RolloutTask
from configs.imports import load_object
from configs.schema import TaskConfig
from tasks.base import Prompt
from tasks.data import DataError, DataTask, check_rows, split_rows

MODEL = "tether"
"""The model name verifiers sends (the endpoint serves one policy and ignores it)."""


class VerifiersEpisodeError(RuntimeError):
    """A verifiers episode ended without a usable trace: its errors, as verifiers recorded them."""


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"task.verifiers_env needs the verifiers package: pip install -e "
                          f"'.[verifiers]' ({e})") from e
    return vf


def load_verifiers_env(spec: str):
    """`task.verifiers_env` -> a `verifiers.v1.Env` (see the module docstring)."""
    vf = _vf()
    if ":" not in spec:
        return vf.load_environment(vf.resolve_env_config({"taskset": {"id": spec}}))
    obj = load_object(spec, "task.verifiers_env")
    if callable(obj) and not isinstance(obj, (vf.Env, vf.EnvConfig, type)):
        obj = obj()
    if isinstance(obj, vf.Env):
        return obj
    if isinstance(obj, vf.EnvConfig):
        return vf.load_environment(vf.resolve_env_config(obj))
    raise ValueError(f"task.verifiers_env {spec!r} is a {type(obj).__name__}: expected a "
                     f"verifiers.v1 Env or EnvConfig, or a function returning one")


def prompt_messages(env, data) -> list[dict]:
    """The chat messages the environment's (single) harness opens task `data` with."""
    from verifiers.v1.dialects.chat import message_to_wire

    vf = _vf()
    seats = env.config.agent_harnesses()
    if len(seats) != 1:
        raise ValueError(f"verifiers env {env.config.env_id!r} has {len(seats)} agent seats "
                         f"({sorted(seats)}): only single-agent environments run as an actor")
    system, prompt = vf.load_harness(next(iter(seats.values()))).resolve_prompt(data)
    if prompt is None:
        raise DataError(f"verifiers task {data.idx} has no prompt (the user opens it)")
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return [*messages, {"role": "user", "content": prompt}]
    return [*messages, *(message_to_wire(m) for m in prompt)]


class VerifiersTask(DataTask):
    """`task.name: verifiers`: the environment's taskset as the prompts (the data task's seeded
    epochs and held-out split); its rubric, in the actors, scores them."""

    name = "verifiers"

    def __init__(self, cfg: TaskConfig, tokenizer, seed: int = 0) -> None:
        super().__init__(msgspec.structs.replace(cfg, prompt_key="prompt", label_key="",
                                                 metadata_keys=""), tokenizer, seed)

    @cached_property
    def env(self):
        return load_verifiers_env(self.cfg.verifiers_env)

    @cached_property
    def _split(self) -> tuple[list[dict], list[dict]]:
        spec = self.cfg.verifiers_env
        if not self.env.taskset.bounded:
            raise DataError(f"task.verifiers_env {spec!r}: the taskset is infinite; give it a "
                            f"bounded one (verifiers' taskset.take(n))")
        rows = [{"prompt": prompt_messages(self.env, t.data), "vf_idx": t.data.idx}
                for t in self.env.taskset]
        train, held = split_rows(rows, self.cfg.eval_fraction, f"{spec} taskset")
        check_rows(train, f"{spec} taskset", self.cfg)
        check_rows(held, f"{spec} held-out tasks", self.cfg)
        return train, held

    @cached_property
    def chat(self):
        return make_chat_format(self.tokenizer)

    def _prompt(self, prompt_id: int, row: dict, row_index: int) -> Prompt:
        ids = self.chat.start(row["prompt"])
        meta = {"task": self.name, "row": str(row_index), "vf_idx": str(row["vf_idx"])}
        return Prompt(prompt_id=prompt_id, token_ids=np.asarray(ids, dtype=np.int32), meta=meta)

    async def reward(self, meta: dict[str, str], completion_ids: np.ndarray):
        raise NotImplementedError("a verifiers task is scored by the environment's rubric: "
                                  "run it with actors.agent=verifiers")


def make_task(cfg: TaskConfig, tokenizer, seed: int = 0) -> VerifiersTask:
    """`task.name: verifiers` (= `actors.agents.verifiers:make_task`)."""
    return VerifiersTask(cfg, tokenizer, seed)


class VerifiersAgent:
    """Plays the leased task's verifiers episode through the endpoint; its trace's reward is
    the sample's. Each episode holds its own verifiers interception server (verifiers' fallback
    outside `Env.serving()`), so nothing outlives a rollout or is tied to one event loop;
    environments that need
    env-level resources (shared tool servers, `start()`/`stop()`) are refused."""

    def __init__(self, agent: OpenAIAgent, env) -> None:
        vf = _vf()
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
        vf = _vf()
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
