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

CUDA is never initialised here: `cuda_count` asks NVML (the driver's management library, the
same count torch's `device_count` takes before CUDA is up), never the CUDA runtime. An actor
must not initialise CUDA before its engine starts: vLLM and SGLang start their engine processes
after it, and a process forked from one that initialised CUDA fails at its first CUDA call
("CUDA error: initialization error"). tests/test_no_cuda_init.py guards the actor's start-up
path. `enable_tf32` is the one call that touches CUDA settings, and only in the learner.

Threads: on CPU every Tether process runs one torch thread (several processes share the
cores); on CUDA torch keeps its defaults. `learner.cpu_placement: split` instead pins the
learner's ranks and the local actor processes to disjoint cores (`split_cpus`), each with as
many torch threads as it has cores.
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np
import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""`model.dtype` names -> torch dtypes."""


def cuda_count() -> int:
    """CUDA devices this process may use (CUDA_VISIBLE_DEVICES applied), counted by NVML:
    CUDA itself is not initialised. 0 with a CPU-only torch, without an NVIDIA driver, or with
    CUDA_VISIBLE_DEVICES empty. -1 where NVML cannot tell (MIG instances named in
    CUDA_VISIBLE_DEVICES, a driver without NVML)."""
    if not torch.backends.cuda.is_built():
        return 0
    return torch.cuda._device_count_nvml()  # torch's own count before CUDA is initialised


def resolve_device(name: str, key: str, local_rank: int = 0) -> torch.device:
    """`auto` | `cpu` | `cuda` -> a torch device (`auto`: CUDA when present, else cpu; CUDA
    devices are cuda:LOCAL_RANK). `key` names the config field in the error for a CUDA device
    on a machine without one. Does not initialise CUDA (`cuda_count`); where NVML cannot count
    (-1), `auto` is cpu and `cuda` is trusted."""
    count = cuda_count() if name in ("auto", "cuda") else 0
    if name == "auto":
        if count < 0:
            log.warning("%s=auto: NVML cannot count the CUDA devices (CUDA_VISIBLE_DEVICES=%r); "
                        "using cpu (set %s=cuda to use them)", key,
                        os.environ.get("CUDA_VISIBLE_DEVICES"), key)
        name = "cuda" if count > 0 else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"{key} must be auto, cpu or cuda, got {name!r}")
    if count == 0:
        raise ValueError(f"{key} is cuda but this machine has no usable CUDA device "
                         f"(torch {torch.__version__}, cuda build {torch.version.cuda}, "
                         f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return torch.device("cuda", local_rank)


def resolve_dtype(name: str, device: torch.device) -> str:
    """`model.dtype` -> the dtype name a process computes in: `auto` is bfloat16 on CUDA and
    float32 on CPU; an explicit name is kept."""
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return name


def enable_tf32(device: torch.device) -> None:
    """On CUDA, float32 matmuls and convolutions use TF32 tensor cores (10-bit mantissa
    products, fp32 accumulation): ~8x the fp32 rate on an H100. Only fp32 work changes (the
    optimizer's, the fp32 loss math, and everything of a `model.dtype: float32` run); bf16
    autocast regions are unaffected. Nothing on CPU."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def torch_dtype(name: str, device: torch.device = torch.device("cpu")) -> torch.dtype:
    """A `model.dtype` name -> the torch dtype (`auto` resolved for `device`: resolve_dtype)."""
    name = resolve_dtype(name, device)
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
