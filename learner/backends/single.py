"""The `single` backend: one process, one device (`learner.backend: single`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from configs.schema import LORA_HEAD as HEAD_TARGET, LoraConfig
from learner import checkpoint
from learner.backends.base import (ADAPTER_DIR, cast, checkpoint_layers, param_torch_dtype,
                                   trainable, with_lora)
from learner.backends.optim import make_optimizer
from models import lora as lora_lib
from models.devices import compute
from models.logprobs import token_logprobs, token_logprobs_entropy
from models.tied import untie, without_tied


class SingleProcessBackend:
    dp_rank = 0
    dp_size = 1

    def __init__(self, model_dir: Path, lr: float, weight_decay: float, seed: int,
                 device: torch.device = torch.device("cpu"),
                 dtype: torch.dtype = torch.float32, model: torch.nn.Module | None = None,
                 lora: LoraConfig | None = None, activation_checkpointing: bool = False,
                 param_dtype: str = "float32") -> None:
        """Weights in `param_dtype` on `device` (optim.py); forward passes in `dtype`
        (models/devices.py). `model`: train this module instead of the HF causal LM in
        `model_dir` (the critic). `lora`: train adapters of that rank on the frozen model (rank
        0 = full weights). `activation_checkpointing`: recompute each layer in the backward
        (`checkpoint_layers`)."""
        from transformers import AutoModelForCausalLM

        weights = param_torch_dtype(param_dtype, dtype)
        torch.manual_seed(seed)
        self.device = device
        self.dtype = dtype
        self.autocast_dtype = dtype
        """What a forward of `model` outside `logprobs` runs under (models/devices.py compute)."""
        self.model_dir = Path(model_dir)
        model = model if model is not None else AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=weights)
        self.model, self.lora = with_lora(model.to(weights), lora, seed)
        if activation_checkpointing:
            checkpoint_layers(self.model)
        self.model.to(device).train()
        self.optimizer = make_optimizer(trainable(self.model), lr, weight_decay, param_dtype, seed)

    def logprobs(self, input_ids: torch.Tensor, temperature: float,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        with compute(self.device, self.dtype):
            return token_logprobs(self.model, input_ids, temperature, position_ids=position_ids)

    def logprobs_entropy(self, input_ids: torch.Tensor, temperature: float,
                         entropy_grad: bool = False, position_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        with compute(self.device, self.dtype):
            return token_logprobs_entropy(self.model, input_ids, temperature, entropy_grad,
                                          position_ids=position_ids)

    def step(self, loss: torch.Tensor, max_grad_norm: float) -> float:
        """Backward + optimizer step; returns the gradient norm before clipping."""
        self.zero_grad()
        self.backward(loss)
        return self.apply_gradients(max_grad_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def apply_gradients(self, max_grad_norm: float) -> float:
        if max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        else:
            norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in self.model.parameters()
                                  if p.grad is not None))
        self.optimizer.step()
        return float(norm)

    def reduce_stats(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return stats

    def named_full_tensors(self, dtype: torch.dtype | None = None
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.state_dict().items():
            yield name, cast(t, dtype)

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.adapter_state().items()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights for publishing, without tied duplicates (LoRA: the base)."""
        named = ((k, v.detach()) for k, v in self.model.state_dict().items())
        if self.lora is not None:
            named = lora_lib.split_state(named)[0].items()
        return dict(without_tied(named, self.model.config.tie_word_embeddings))

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """LoRA: the adapter tensors by wire name (models/lora.py)."""
        return lora_lib.split_state((k, v.detach()) for k, v in self.model.state_dict().items())[1]

    def save_checkpoint(self, path: Path, extra: dict) -> None:
        path.mkdir(parents=True, exist_ok=True)
        checkpoint.save(path, self.model, self.optimizer, extra, "single", 0, 1)

    def load_checkpoint(self, path: Path) -> dict:
        return checkpoint.load(path, self.model, self.optimizer)

    def gather_export(self, path: Path) -> Callable[[], None]:
        """One process: nothing to gather; the write is the whole export."""
        return lambda: self.export_hf(path)

    def export_hf(self, path: Path) -> None:
        """The current policy as an HF model directory (safetensors + config + tokenizer);
        LoRA: peft's merge_and_unload of a copy, and the adapter directory in path/adapter. An
        adapter on a tied head is merged into an untied copy of it (peft would merge it into
        the embedding it shares): the export has its own head, `tie_word_embeddings: false`."""
        import copy

        from models.tiny import load_tokenizer

        if self.lora is None:
            self.model.save_pretrained(path, safe_serialization=True)
        else:
            # the adapters only (peft would add a copy of an adapted head's frozen base)
            self.model.save_pretrained(path / ADAPTER_DIR, safe_serialization=True,
                                       save_embedding_layers=False)
            merged = copy.deepcopy(self.model)
            if HEAD_TARGET in self.lora.targets:  # merge into a head of its own, E stays
                untie(merged.get_base_model())
            merged.merge_and_unload().save_pretrained(path, safe_serialization=True)
        load_tokenizer(self.model_dir).save_pretrained(path)
