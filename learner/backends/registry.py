"""The training backends by kind: the one module that knows every backend.

`learner.backend` names a kind (configs/backends.py has each kind's settings); `make_backend`
builds it. Each kind's module is imported only when that kind is built (torch FSDP2 and
Megatron-core load only where they train), by the explicit imports in the factories below, so
tests/test_imports.py sees every edge. A new backend is a module in this folder, its section in
configs/backends.py and an entry in KINDS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from configs.backends import (BackendConfig, FSDP2BackendConfig, MegatronBackendConfig,
                              SingleBackendConfig)
from configs.schema import LoraConfig
from learner.backends.base import Backend

Factory = Callable[..., Backend]
"""(section, model_dir, lr, weight_decay, seed, device, dtype, model, lora,
activation_checkpointing) -> the backend."""


def _single(section: SingleBackendConfig, model_dir: Path, lr: float, weight_decay: float,
            seed: int, device: torch.device, dtype: torch.dtype,
            model: torch.nn.Module | None, lora: LoraConfig | None, ac: bool) -> Backend:
    from learner.backends.single import SingleProcessBackend

    return SingleProcessBackend(model_dir, lr, weight_decay, seed, device, dtype, model=model,
                                lora=lora, activation_checkpointing=ac,
                                param_dtype=section.param_dtype)


def _fsdp2(section: FSDP2BackendConfig, model_dir: Path, lr: float, weight_decay: float,
           seed: int, device: torch.device, dtype: torch.dtype,
           model: torch.nn.Module | None, lora: LoraConfig | None, ac: bool) -> Backend:
    from learner.backends.fsdp2 import FSDP2Backend

    return FSDP2Backend(model_dir, lr, weight_decay, seed, device, dtype, model=model, lora=lora,
                        activation_checkpointing=ac, param_dtype=section.param_dtype)


def _megatron(section: MegatronBackendConfig, model_dir: Path, lr: float, weight_decay: float,
              seed: int, device: torch.device, dtype: torch.dtype,
              model: torch.nn.Module | None, lora: LoraConfig | None, ac: bool) -> Backend:
    """No critic `model` and no `lora` (configs.schema.check_ranges refuses both)."""
    from learner.backends.megatron.backend import MegatronBackend

    return MegatronBackend(model_dir, lr, weight_decay, seed, device, section.tp, section.pp,
                           dtype, activation_checkpointing=ac)


@dataclass(frozen=True)
class BackendKind:
    make: Factory
    torchrun: bool
    """Runs as one process per torchrun rank (a process group); False: one plain process."""
    loads_sharded: bool = False
    """Builds its models on the meta device and loads each rank's shard (a model it is given,
    the critic, must then be built on the meta device too)."""


KINDS: dict[str, BackendKind] = {
    "single": BackendKind(_single, torchrun=False),
    "fsdp2": BackendKind(_fsdp2, torchrun=True, loads_sharded=True),
    "megatron": BackendKind(_megatron, torchrun=True),
}


def make_backend(section: BackendConfig, model_dir: Path, lr: float, weight_decay: float,
                 seed: int, device: torch.device, dtype: torch.dtype = torch.float32, *,
                 model: torch.nn.Module | None = None,
                 lora: LoraConfig | None = None,
                 activation_checkpointing: bool = False) -> Backend:
    """The backend `section` names, training the causal LM in `model_dir` (or `model`: the
    critic) on `device` with AdamW (lr, weight_decay; learner/backends/optim.py); `lora`: adapters on the frozen model;
    `activation_checkpointing`: each layer recomputed in the backward."""
    return KINDS[section.kind].make(section, Path(model_dir), lr, weight_decay, seed, device,
                                    dtype, model, lora, activation_checkpointing)


def runs_under_torchrun(section: BackendConfig) -> bool:
    """Whether the kind trains over torchrun ranks (and so needs torchrun's environment)."""
    return KINDS[section.kind].torchrun


def loads_sharded(section: BackendConfig) -> bool:
    """Whether the kind loads each rank's shard into a model built on the meta device."""
    return KINDS[section.kind].loads_sharded
