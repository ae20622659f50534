"""Where the policy runs and in which dtype: `learner.device`, `actors.engine.device`, `model.dtype`.

    learner  fp32 master weights + AdamW state on `learner.device`; forward passes in
             `model.dtype` (single: torch.autocast; fsdp2: FSDP2 MixedPrecisionPolicy with
             fp32 gradient reduction; megatron: torch.autocast around forward and backward,
             fp32 gradient reduction, learner/backends/megatron/backend.py). Published weights are fp32.
    engines  HF: the model itself in `model.dtype` on `actors.engine.device`; vLLM: `dtype=model.dtype`
             on vLLM's own platform (its wheel: CUDA or CPU).

Behavior logprobs (engine) and the learner's recomputed logprobs agree only when both compute
in the same dtype, so there is one field for both, and the learner refuses an actor whose
Hello names another dtype. float32 (the default) turns every mixed-precision path off: the CPU
code runs exactly as before.

Threads: on CPU every Tether process runs one torch thread (several processes share the
cores); on CUDA torch keeps its defaults. `learner.cpu_placement: split` instead pins the
learner's ranks and the local actor processes to disjoint cores (`split_cpus`), each with as
many torch threads as it has cores.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""`model.dtype` names -> torch dtypes."""


def resolve_device(name: str, key: str, local_rank: int = 0) -> torch.device:
    """`auto` | `cpu` | `cuda` -> a torch device (`auto`: CUDA when present, else cpu; CUDA
    devices are cuda:LOCAL_RANK). `key` names the config field in the error for a CUDA device
    on a machine without one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"{key} must be auto, cpu or cuda, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{key} is cuda but this machine has no usable CUDA device "
                         f"(torch {torch.__version__}, cuda build {torch.version.cuda})")
    return torch.device("cuda", local_rank)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {tuple(DTYPES)}, got {name!r}")
    return DTYPES[name]


def limit_cpu_threads(device: torch.device, threads: int = 1) -> None:
    """`threads` torch threads (one unless the process was given cores) on CPU; nothing on CUDA."""
    if device.type == "cpu":
        torch.set_num_threads(threads)


def split_cpus(cpus: list[int], ranks: int, actors: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the cores of each learner rank, the cores of each local actor): the first half of
    `cpus` (at least one) shared out over the ranks, the rest over the actors. A side with fewer
    cores than processes gives them one core each, round robin. Without actors, or on one core,
    every process gets every core."""
    if actors == 0 or len(cpus) < 2:
        return [list(cpus)] * ranks, [list(cpus)] * actors
    half = max(1, len(cpus) // 2)
    return _share(cpus[:half], ranks), _share(cpus[half:], actors)


def _share(cores: list[int], k: int) -> list[list[int]]:
    if len(cores) < k:
        return [[cores[i % len(cores)]] for i in range(k)]
    return [part.tolist() for part in np.array_split(np.array(cores), k)]


def pin(cores: list[int]) -> None:
    """Run this process (and what it starts later) on `cores` only."""
    os.sched_setaffinity(0, cores)


def compute(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The learner's forward-pass context: autocast to `dtype` (a no-op for float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
