"""The rollout engines by kind: the one module that knows every engine.

`actors.engine` names a kind (configs/engines.py has each kind's settings); `make_engine`
builds it from its typed section with the kind's own factory (`make` in its module). Each
kind's module is imported only when that kind is built (vLLM and SGLang load only in the actors
that use them), by the explicit imports below, so tests/test_imports.py sees every edge. A new
engine is a module (or folder) here with a `make(section, ctx)`, its section in
configs/engines.py and an entry in KINDS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from actors.engines.base import EngineContext, LLMClient
from configs.engines import EngineConfig, HFEngineConfig


Factory = Callable[[EngineConfig, EngineContext], LLMClient]


def _hf() -> Factory:
    from actors.engines.hf import make
    return make


def _vllm() -> Factory:
    from actors.engines.vllm.engine import make
    return make


def _sglang() -> Factory:
    from actors.engines.sglang.engine import make
    return make


def _simulated() -> Factory:
    from actors.engines.simulated import make
    return make


@dataclass(frozen=True)
class EngineKind:
    factory: Callable[[], Factory]
    """Imports the kind's module and returns its `make`."""
    loads_model: bool = True
    """False: the engine runs no model (simulated): the actor builds no tokenizer, task or
    agent, and every sample scores 0."""


KINDS: dict[str, EngineKind] = {
    "hf": EngineKind(_hf),
    "vllm": EngineKind(_vllm),
    "sglang": EngineKind(_sglang),
    "simulated": EngineKind(_simulated, loads_model=False),
}


def make_engine(section: EngineConfig, ctx: EngineContext) -> LLMClient:
    """The engine `section` names (blocks for its start-up: seconds to a minute)."""
    return KINDS[section.kind].factory()(section, ctx)


def loads_model(section: EngineConfig) -> bool:
    return KINDS[section.kind].loads_model


def device_of(section: EngineConfig) -> str:
    """Where the engine's model runs: `actors.engine.device` for hf; vLLM and SGLang run on
    their wheel's platform (CUDA when present, else the CPU: `auto`)."""
    return section.device if isinstance(section, HFEngineConfig) else "auto"
