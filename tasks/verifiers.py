"""verifiers environments as the task (`task.name: verifiers`): the environment's taskset.

    task.verifiers_env = "package.module:ATTR"   a vf.Env, a vf.EnvConfig, or a zero-argument
                                                 function returning either
                       = "my-env"                a verifiers environment id: an installed package
                                                 exporting its Taskset (and Harness) in __all__

The prompts are the environment's taskset (VerifiersTask below): every task's first messages, as
the environment's harness resolves them (`Harness.resolve_prompt`: the system prompt, then the
prompt), rendered by the chat format the actor's endpoint checks the first call against; its
`idx` travels in the lease's meta and the actor's `verifiers` agent
(actors/agents/verifiers.py) plays that task of its own copy of the taskset (`load()` must yield
the same tasks in every process). A fixed `task.eval_fraction` of the tasks is held out.
verifiers is imported only here, and only when used (the `verifiers` extra; the import takes
seconds).
"""

from __future__ import annotations

from functools import cached_property

import msgspec
import numpy as np

from configs.imports import load_object
from configs.schema import TaskConfig
from tasks.base import Prompt
from tasks.chat import make_chat_format
from tasks.data import DataError, DataTask, check_rows, split_rows


def import_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"task.verifiers_env needs the verifiers package: pip install -e "
                          f"'.[verifiers]' ({e})") from e
    return vf


def load_verifiers_env(spec: str):
    """`task.verifiers_env` -> a `verifiers.v1.Env` (see the module docstring)."""
    vf = import_verifiers()
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

    vf = import_verifiers()
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
    """`task.name: verifiers` (tasks/registry.py)."""
    return VerifiersTask(cfg, tokenizer, seed)
