"""The learner's other models: the critic (a value model) and the frozen KL reference policy.

    critic     ValueModel = the policy's HF backbone (from model.path or model.critic_path)
               + a scalar head; trained by its own backend (AdamW at learner.critic_lr), so
               it is sharded like the policy under FSDP2. Needed by advantage gae / vtrace.
    reference  the HF causal LM in model.ref_path (default model.path: the initial weights),
               frozen, in a backend of its own (sharded likewise). Loaded when kl_coef > 0.
               With LoRA and no ref_path: the policy itself with its adapters disabled
               (`FrozenBase`, peft's disable_adapter): the frozen base, no second copy.

Both are built on every learner rank in the same order (FSDP2 collectives) by
learner/distributed.py `make_models`. The critic is
checkpointed beside the policy, in `step_N/critic` (learner/checkpoint.py format); the
reference needs no checkpoint: it never changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from configs.schema import TetherConfig
from learner import checkpoint
from learner.backends.base import Backend
from models.devices import compute

CRITIC_DIR = "critic"
"""Subdirectory of a checkpoint holding the critic."""


class ValueModel(torch.nn.Module):
    """V(prefix) for every position: the backbone's last hidden state through a linear head.
    `.model` is the backbone (FSDP2 shards `.model.layers`); the head starts at zero, so the
    first values are 0 whatever the seed."""

    NOT_IN_FILES = ("value_head.weight", "value_head.bias")
    """Parameters a sharded load (learner/backends/sharded_load.py) starts at zero."""

    def __init__(self, path: Path, meta: bool = False) -> None:
        """`meta`: on the meta device, for the FSDP2 backend to shard and then load."""
        from transformers import AutoModelForCausalLM

        from learner.backends.sharded_load import meta_causal_lm

        super().__init__()
        lm = meta_causal_lm(path) if meta else AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32)
        self.model = lm.model
        self.config = lm.config
        self.config.tie_word_embeddings = False  # no lm_head here: nothing is tied
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1,
                                          device="meta" if meta else None)
        if not meta:
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, L) -> values (rows, L - 1): column t is the value of the prefix ending at
        position t, i.e. of the state in which the token of column t is sampled.
        `position_ids`: packed rows, as the policy's (models/logprobs.py)."""
        if position_ids is not None:  # made beside the ids, which a backend may have moved
            position_ids = position_ids.to(input_ids.device)
        hidden = self.model(input_ids=input_ids, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        return self.value_head(hidden[:, :-1]).squeeze(-1).clone()  # not a view (FSDP2 hooks)


class FrozenBase:
    """The KL reference of a LoRA run: the policy backend's forward with the adapters off
    (peft's `disable_adapter`), i.e. exactly the frozen base model; nothing is loaded twice."""

    def __init__(self, policy: Backend) -> None:
        self.policy = policy

    def logprobs(self, input_ids: torch.Tensor, temperature: float,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        with self.policy.model.disable_adapter():
            return self.policy.logprobs(input_ids, temperature, position_ids)


@dataclass
class AlgoModels:
    """What the trainer needs besides the policy (None: not used by this config)."""

    reference: Backend | None = None
    critic: Backend | None = None

    def values(self, input_ids: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The critic's values for this rank's rows (differentiable), computed in model.dtype
        as the policy's logprobs are (autocast; under FSDP2 its MixedPrecisionPolicy)."""
        with compute(self.critic.device, self.critic.autocast_dtype):
            return self.critic.model(input_ids.to(self.critic.device), position_ids)

    def ref_logprobs(self, input_ids: torch.Tensor, temperature: float,
                     position_ids: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self.reference.logprobs(input_ids, temperature, position_ids)

    def save(self, path: Path) -> None:
        """Every rank: the critic into `path/critic` (nothing without a critic)."""
        if self.critic is not None:
            (path / CRITIC_DIR).mkdir(parents=True, exist_ok=True)
            self.critic.save_checkpoint(path / CRITIC_DIR, {})

    def load(self, path: Path) -> None:
        """Every rank: restore the critic from `path/critic`; a checkpoint without one is an
        error naming the setting that needs it."""
        if self.critic is None:
            return
        if not (path / CRITIC_DIR).exists():
            raise FileNotFoundError(f"{path} has no critic/ but learner.advantage needs one; "
                                    "resume with the advantage estimator it was written with")
        checkpoint.load(path / CRITIC_DIR, self.critic.model, self.critic.optimizer)


def needs_critic(cfg: TetherConfig) -> bool:
    return cfg.learner.advantage in ("gae", "vtrace")
