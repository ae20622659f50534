"""One checkpoint format for every backend: `torch.distributed.checkpoint` directories.

    step_N/
      dcp/          model (+ AdamW state once it exists), written by every rank (its shards);
                    LoRA: the adapters and their AdamW state only
      backend.json  {"backend", "ranks", "optimizer"}: who wrote it (informational)
      state.json    the learner's own state (version, prompt cursor, leases, buffer counters)
      buffer.npz    the waiting groups (buffer/record.py codec; written by learner/main.py)

State dicts go through `get_state_dict` / `set_state_dict`, which name parameters the same
way for a plain module and an FSDP2-sharded one, so a checkpoint written by `single` resumes
under `fsdp2` on any number of ranks and the other way round. Without a process group (the
`single` backend) DCP reads and writes in this process alone. Frozen parameters (a LoRA run's
base) are left out: they never change, and the run rebuilds them from model.path.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves


def save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict,
         backend: str, rank: int, ranks: int) -> None:
    """Every rank calls this; rank 0 also writes backend.json and state.json (`extra`).

    A fresh AdamW has no state; get_state_dict would create it with a zero-gradient step
    (step count 1), which would change the run. Then only the model is saved."""
    with_optimizer = bool(optimizer.state)
    state = _state(model, optimizer, with_optimizer)
    ensure_space(path, state)
    dcp.save(state, checkpoint_id=str(path / "dcp"), no_dist=not dist.is_initialized())
    if rank == 0:
        (path / "backend.json").write_text(json.dumps(
            {"backend": backend, "ranks": ranks, "optimizer": with_optimizer}))
        (path / "state.json").write_text(json.dumps(extra, indent=1))
    if dist.is_initialized():
        dist.barrier()


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model (+ optimizer) from `path` on every rank; returns state.json."""
    if not (path / "backend.json").exists():
        raise ValueError(f"{path} is not a Tether checkpoint (no backend.json)")
    with_optimizer = json.loads((path / "backend.json").read_text())["optimizer"]
    state = _state(model, optimizer, with_optimizer)
    dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=not dist.is_initialized())
    if with_optimizer:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=_options(model))
    else:
        set_model_state_dict(model, state["model"], options=_options(model))
    return json.loads((path / "state.json").read_text())


def ensure_space(path: Path, state: dict, counted: bool = True) -> None:
    """Raise on every rank, before the model and optimizer are written, when the filesystem
    under `path` cannot hold the checkpoint.

    The estimate is the sum over ranks of their state's tensor bytes (`counted=False` for a rank
    whose tensors another rank also writes: Megatron's data-parallel replicas) plus 5% and
    64 MiB for DCP's metadata; every rank checks it against its own filesystem and all of them
    share one decision, so no rank is left waiting in `dcp.save` for one that gave up. A write
    that runs out of space midway fails inside torch.save with an unhelpful "unexpected pos"
    error and leaves a partial step_N.tmp; this names the cause instead."""
    total = sum((t.to_local() if isinstance(t, DTensor) else t).nbytes
                for t in tree_leaves(state) if isinstance(t, torch.Tensor)) if counted else 0
    where = next(p for p in (path, *path.parents) if p.exists())
    free = shutil.disk_usage(where).free
    if dist.is_initialized():
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        summed = torch.tensor([total], dtype=torch.float64, device=device)
        dist.all_reduce(summed)
        total = int(summed.item())
    need = int(total * 1.05) + (64 << 20)
    fits = need <= free
    if dist.is_initialized():
        flag = torch.tensor([int(fits)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item() and fits:
            raise OSError(errno.ENOSPC, f"checkpoint {path} needs about {need / 2**30:.2f} GiB: "
                          "another rank's filesystem has too little free space")
    if not fits:
        raise OSError(errno.ENOSPC, f"checkpoint {path} needs about {need / 2**30:.2f} GiB but "
                      f"{where} has {free / 2**30:.2f} GiB free; free space, or set "
                      "learner.checkpoint_keep lower or learner.checkpoint_every higher")


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool) -> dict:
    if not with_optimizer:
        return {"model": get_model_state_dict(model, options=_options(model))}
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    return {"model": model_state, "optimizer": optim_state}


def _options(model: torch.nn.Module) -> StateDictOptions:
    """Leave frozen parameters out (DCP still fails on any trainable key the checkpoint lacks;
    `strict=False` only lets the frozen ones stay as they were)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
