"""FSDP2 backend: the policy sharded over the learner's torchrun ranks (data parallel).

    every rank:  logprobs(own rows) -> loss share -> backward -> reduce-scatter (sum) -> AdamW
                 on its shards; publishing all-gathers one parameter at a time (rank 0 keeps it)

The model is built on the meta device, each decoder layer and then the root are `fully_shard`ed over a 1-D mesh of all ranks (gloo on
CPU, NCCL on GPUs), then each rank reads only its shards from the safetensors files
(learner/backends/sharded_load.py): no rank holds the whole model. Gradients are summed over
ranks, not averaged: the trainer gives each rank
its share of the minibatch loss (learner/algo/loss.py `LossNorm`), so the sum is the single-process
gradient. Clipping uses the global norm over all shards.

LoRA (`learner.lora`): the peft model is sharded the same way (its decoder layers, then the
root); frozen base shards have no gradients, AdamW holds the adapters' shards only. Publishing
gathers the base once and the adapters every version (models/lora.py names).

Checkpoints are `torch.distributed.checkpoint` directories (learner/checkpoint.py: each rank
writes its shards of the model and the AdamW state; they load into any number of ranks, and
into the `single` backend). The run directory must be on a filesystem every rank sees.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from configs.schema import LoraConfig
from learner import checkpoint
from learner.backends import sharded_load
from learner.backends.base import (ADAPTER_DIR, adapter_starts, cast, checkpoint_layers,
                                   param_torch_dtype, trainable, with_lora)
from learner.backends.optim import make_optimizer
from models import lora as lora_lib
from models.logprobs import token_logprobs, token_logprobs_entropy
from models.tied import HEAD, without_tied


class FSDP2Backend:
    def __init__(self, model_dir: Path, lr: float, weight_decay: float, seed: int,
                 device: torch.device, dtype: torch.dtype = torch.float32,
                 model: torch.nn.Module | None = None, lora: LoraConfig | None = None,
                 activation_checkpointing: bool = False, param_dtype: str = "float32") -> None:
        """Weights (their shards) in `param_dtype` (optim.py). `model`: shard and train this
        module (with `.model.layers`, e.g. the critic) instead of the HF causal LM in
        `model_dir`. `lora`: train adapters of that rank on the frozen model (rank 0 = full
        weights). `activation_checkpointing`: each layer is recomputed in the backward
        (learner/backends/base.py `checkpoint_layers`, set before fully_shard: the
        recomputation runs inside the layer's FSDP2 unshard)."""
        weights = param_torch_dtype(param_dtype, dtype)
        torch.manual_seed(seed)
        self.device = device
        self.autocast_dtype = torch.float32  # the MixedPrecisionPolicy below computes in dtype
        self.dp_rank = dist.get_rank()
        self.dp_size = dist.get_world_size()
        self.model_dir = Path(model_dir)
        if model is None:
            model = sharded_load.meta_causal_lm(self.model_dir, weights)
        model, self.lora = with_lora(model.to(weights), lora, seed)
        starts = adapter_starts(model, seed) if self.lora is not None else {}
        starts |= {name: torch.zeros(p.shape, dtype=p.dtype)  # the critic's value head
                   for name, p in model.named_parameters()
                   if name in getattr(model, "NOT_IN_FILES", ())}
        if activation_checkpointing:
            checkpoint_layers(model)
        meta = sharded_load.is_meta(model)
        if not meta:
            model.to(device)
        model.train()
        mesh = init_device_mesh(device.type, (self.dp_size,))
        # float32: no policy (as before); else shards in `weights`, `dtype` compute, fp32 reduction
        mp = {} if dtype == torch.float32 else {
            "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}
        layers = (model.get_base_model() if self.lora is not None else model).model.layers
        for layer in layers:
            fully_shard(layer, mesh=mesh, **mp)
        fully_shard(model, mesh=mesh, **mp)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # sum, not average, over ranks (see docstring)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        if meta:  # each rank allocates and reads its shards only
            sharded_load.materialise(model, self.model_dir, device,
                                     starts=starts, file_name=lora_lib.hf_name)
        self.model = model
        self.optimizer = make_optimizer(trainable(model), lr, weight_decay, param_dtype,
                                        seed + self.dp_rank)

    def logprobs(self, input_ids: torch.Tensor, temperature: float,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return token_logprobs(self.model, input_ids.to(self.device), temperature,
                              position_ids=position_ids)

    def logprobs_entropy(self, input_ids: torch.Tensor, temperature: float,
                         entropy_grad: bool = False, position_ids: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs_entropy(self.model, input_ids.to(self.device), temperature,
                                      entropy_grad, position_ids=position_ids)

    def step(self, loss: torch.Tensor, max_grad_norm: float) -> float:
        """Backward + optimizer step; returns the global gradient norm before clipping."""
        self.zero_grad()
        self.backward(loss)
        return self.apply_gradients(max_grad_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        """Each backward reduce-scatters (sums) its gradients into the sharded ones: several
        micro-batches accumulate in shards, never in a whole unsharded copy."""
        loss.backward()

    def apply_gradients(self, max_grad_norm: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
        self.optimizer.step()
        return float(norm)

    def reduce_stats(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for op, keys in ((dist.ReduceOp.SUM, [k for k in stats if not k.endswith("_max")]),
                         (dist.ReduceOp.MAX, [k for k in stats if k.endswith("_max")])):
            if keys:  # the same keys on every rank
                t = torch.stack([stats[k].detach().float() for k in keys]).to(self.device)
                dist.all_reduce(t, op=op)
                out.update(zip(keys, t.cpu()))
        return {k: out[k] for k in stats}

    def named_full_tensors(self, dtype: torch.dtype | None = None
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """All-gathers one tensor at a time (a collective: every rank must iterate to the end),
        each shard cast to `dtype` first; LoRA: the frozen base only."""
        yield from self._gathered(adapters=False, dtype=dtype)

    def named_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: the adapters, all-gathered one at a time (a collective, like the above)."""
        yield from self._gathered(adapters=True)

    def _gathered(self, adapters: bool, dtype: torch.dtype | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        named = self.model.state_dict().items()
        if self.lora is not None:
            named = ((lora_lib.hf_name(k), t) for k, t in named
                     if lora_lib.is_adapter(lora_lib.hf_name(k)) == adapters)
        for name, t in without_tied(named, self.model.config.tie_word_embeddings):
            t = cast(t.detach(), dtype)  # a DTensor casts its local shard
            yield name, (t.full_tensor() if isinstance(t, DTensor) else t).cpu()

    def save_checkpoint(self, path: Path, extra: dict) -> None:
        checkpoint.save(path, self.model, self.optimizer, extra, "fsdp2", self.dp_rank, self.dp_size)

    def load_checkpoint(self, path: Path) -> dict:
        return checkpoint.load(path, self.model, self.optimizer)

    def export_hf(self, path: Path) -> None:
        """Rank 0 writes safetensors + config + tokenizer; the full weights exist only there.
        LoRA: the merged model (models/lora.py `merge`) and the adapter in path/adapter; an
        adapter on a tied head makes the merged model untied (its own head, E unchanged)."""
        self.gather_export(path)()
        dist.barrier()

    def gather_export(self, path: Path) -> Callable[[], None]:
        """All-gather every tensor (a collective; rank 0 keeps them on the CPU); returns rank
        0's write of the files (a no-op elsewhere), which needs no other rank."""
        tensors = {}
        for name, t in self.named_full_tensors():
            if self.dp_rank == 0:
                tensors[name] = t.contiguous()
        adapter = dict(self.named_adapter_tensors()) if self.lora is not None else None
        if self.dp_rank != 0:
            return lambda: None
        return lambda: self._write_export(path, tensors, adapter)

    def _write_export(self, path: Path, tensors: dict, adapter: dict | None) -> None:
        """Rank 0: the gathered tensors (LoRA: merged with the adapter) as an HF directory."""
        from models.tiny import load_tokenizer

        if adapter is not None:
            L = self.lora
            lora_lib.write_adapter(path / ADAPTER_DIR, adapter, L.rank, L.alpha, L.targets)
            tensors = lora_lib.merge(tensors, adapter, L.scale)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        config = self.model.config
        if HEAD in tensors and config.tie_word_embeddings:  # an adapted tied head: untied
            config = copy.deepcopy(config)
            config.tie_word_embeddings = False
        config.save_pretrained(path)
        if (self.model_dir / "generation_config.json").exists():
            shutil.copy(self.model_dir / "generation_config.json", path)
        load_tokenizer(self.model_dir).save_pretrained(path)
