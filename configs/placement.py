"""Which GPUs each process Tether starts on a node gets (`placement` in the config).

    node of 8 GPUs, learner on 4 ranks, two vLLM actors of tensor_parallel_size 2:

        GPU   0   1   2   3 | 4   5 | 6   7
              learner ranks | actor | actor
              0   1   2   3 |   0   |   1

Roles: the learner's local ranks (one GPU each: rank i of this node on `learner[i]`), each local
actor's engine (as many GPUs as the engine spans: its tensor-parallel size; none for an engine
on the CPU), and reward scorers (one list each; issue #43). `auto` gives the learner the first
GPUs and the actors consecutive blocks after them, in order. Every GPU belongs to at most one
process: an overlap, a GPU the node does not have, or too few GPUs stop the run with one line
naming the roles and GPUs (`PlacementError`).

Every process Tether starts gets its devices in `CUDA_VISIBLE_DEVICES` (`child_env`): an actor
then sees its GPUs as cuda:0.. and its engine spans all of them. The learner's ranks are started
by torchrun; each uses `cuda:<its GPU>`. Nothing of torchrun's rendezvous environment (RANK,
WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_*, ...) reaches a process that is not a learner rank.

Importing this module is cheap (no torch): config validation uses it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
"""What torchrun (torch/distributed/elastic/agent/server/local_elastic_agent.py) sets in the
environment of each rank, besides the TORCHELASTIC_* variables."""
TORCHRUN_PREFIXES = ("TORCHELASTIC_", "PET_")
"""torchrun's own variables (PET_*: its command-line settings read from the environment)."""

DEVICE_LIST = r"^\s*(\d+(\s*-\s*\d+)?)(\s*,\s*\d+(\s*-\s*\d+)?)*\s*$"
"""A GPU list: indices and ranges joined by commas ("0-3", "4,5", "0,2-3")."""


class PlacementError(ValueError):
    """An impossible or overlapping assignment; the message is one line naming roles and GPUs."""


def parse_devices(text: str, key: str) -> tuple[int, ...]:
    """"0-3" -> (0, 1, 2, 3); "4,5" -> (4, 5). `key` names the field in the error."""
    if not re.match(DEVICE_LIST, text):
        raise PlacementError(f"{key} must be GPU indices and ranges joined by commas (e.g. "
                             f"\"0-3\" or \"4,5\"), got {text!r}")
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise PlacementError(f"{key} has the empty range {part.strip()!r}")
        out.extend(range(a, b + 1))
    if len(set(out)) != len(out):
        raise PlacementError(f"{key} names a GPU twice: {text!r}")
    return tuple(out)


def span(gpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 3) -> "0-3"; (4, 6) -> "4,6"; () -> "none"."""
    if not gpus:
        return "none"
    if list(gpus) == list(range(gpus[0], gpus[0] + len(gpus))) and len(gpus) > 1:
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(map(str, gpus))


@dataclass(frozen=True)
class Placement:
    """The GPUs of every process on one node (indices as the node numbers them)."""

    gpus: int
    """GPUs on the node."""
    learner: tuple[tuple[int, ...], ...]
    """Per learner local rank: its GPU (one), or () on the CPU."""
    actors: tuple[tuple[int, ...], ...]
    """Per local actor: its engine's GPUs, or () on the CPU."""
    scorers: tuple[tuple[int, ...], ...] = ()
    """Per reward scorer process: its GPUs."""

    def roles(self) -> list[tuple[str, tuple[int, ...]]]:
        return ([(f"learner rank {i}", g) for i, g in enumerate(self.learner)]
                + [(f"actor {i}", g) for i, g in enumerate(self.actors)]
                + [(f"scorer {i}", g) for i, g in enumerate(self.scorers)])

    def describe(self) -> str:
        return "; ".join(f"{role}: GPU {span(g)}" for role, g in self.roles())


def plan(gpus: int, learner_ranks: int, learner_spec: str, actors: int, engine_gpus: int,
         actor_specs: list[str], scorer_specs: list[str] = ()) -> Placement:
    """Place `learner_ranks` learner ranks (one GPU each; 0 when the learner runs on the CPU),
    `actors` local actors of `engine_gpus` GPUs each (0 = CPU engines) and the scorers on a node
    of `gpus` GPUs. `learner_spec` is "auto" or a GPU list of exactly one GPU per rank;
    `actor_specs` is [] (auto) or one GPU list per actor. Raises PlacementError."""
    learner = _learner(gpus, learner_ranks, learner_spec)
    taken = {g for gs in learner for g in gs}
    if actor_specs:
        if len(actor_specs) != actors:
            raise PlacementError(f"placement.actors lists {len(actor_specs)} GPU set(s) but "
                                 f"actors.num_local is {actors}")
        placed = tuple(parse_devices(s, f"placement.actors[{i}]") for i, s in enumerate(actor_specs))
        for i, gs in enumerate(placed):
            if len(gs) != engine_gpus:
                raise PlacementError(f"placement.actors[{i}] gives actor {i} GPU {span(gs)} "
                                     f"({len(gs)} GPUs) but its engine spans {engine_gpus}")
    else:
        free = [g for g in range(gpus) if g not in taken]
        need = actors * engine_gpus
        if need > len(free):
            raise PlacementError(
                f"placement: {actors} actor(s) of {engine_gpus} GPU(s) each need {need} GPUs "
                f"but this node has {gpus} (GPU {span(tuple(range(gpus)))}) and the learner's "
                f"{learner_ranks} rank(s) take GPU {span(tuple(sorted(taken)))}")
        placed = tuple(tuple(free[i * engine_gpus:(i + 1) * engine_gpus]) for i in range(actors))
    scorers = tuple(parse_devices(s, f"placement.scorers[{i}]") for i, s in enumerate(scorer_specs))
    out = Placement(gpus=gpus, learner=learner, actors=placed, scorers=scorers)
    check(out)
    return out


def _learner(gpus: int, ranks: int, spec: str) -> tuple[tuple[int, ...], ...]:
    if ranks == 0:
        return ()
    if spec == "auto":
        if ranks > gpus:
            raise PlacementError(f"placement: the learner's {ranks} rank(s) on this node need "
                                 f"{ranks} GPUs but it has {gpus}")
        return tuple((i,) for i in range(ranks))
    listed = parse_devices(spec, "placement.learner")
    if len(listed) != ranks:
        raise PlacementError(f"placement.learner gives GPU {span(listed)} ({len(listed)} GPUs) "
                             f"to {ranks} learner rank(s) on this node: one GPU per rank")
    return tuple((g,) for g in listed)


def check(p: Placement) -> None:
    """Every GPU exists and belongs to one process at most; raises PlacementError."""
    owner: dict[int, str] = {}
    for role, gs in p.roles():
        for g in gs:
            if g >= p.gpus:
                raise PlacementError(f"placement: {role} is given GPU {g} but this node has "
                                     f"{p.gpus} GPU(s){f' (0-{p.gpus - 1})' if p.gpus else ''}")
            if g in owner:
                raise PlacementError(f"placement: GPU {g} is given to both {owner[g]} and {role}")
            owner[g] = role


def child_env(gpus: tuple[int, ...], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process Tether starts that is not a learner rank: `base` (default:
    this process's) without torchrun's rendezvous variables, with CUDA_VISIBLE_DEVICES set to
    exactly `gpus` ("" = no GPU). The indices are those this process sees: where its own
    CUDA_VISIBLE_DEVICES restricts it (e.g. Slurm gave the learner's task some GPUs of the
    node), they are translated through it."""
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items()
           if k not in TORCHRUN_ENV and not k.startswith(TORCHRUN_PREFIXES)}
    visible = [v.strip() for v in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and any(g >= len(visible) for g in gpus):
        raise PlacementError(f"placement: GPU {span(gpus)} is not among the "
                             f"{len(visible)} this process sees (CUDA_VISIBLE_DEVICES="
                             f"{base['CUDA_VISIBLE_DEVICES']})")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[g] if visible else str(g) for g in gpus)
    return env
