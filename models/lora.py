"""LoRA adapters: the wire names of their tensors and the exact merge into a base state dict.

    learner (peft)                          wire (transport/weights.py)         engines
    base_model.model.X.base_layer.weight -> X.weight          (kind "base", once per actor)
    base_model.model.X.lora_A.default.weight -> X.lora_A.weight   (kind "adapter", per version)
                                                        W' = W + (alpha / rank) * B @ A

Names on the wire are HF module names (those of the base model's own state dict), so an engine
needs no peft: `merge` adds every adapter's product to its base weight. The learner's forward
computes x W^T + s (x A^T) B^T instead; the two agree to float rounding (~1e-7), and every
engine merges with this one function, so two engines given the same tensors are bitwise equal.
An adapter on `lm_head` of a tied model adapts the head only: merged, the head is untied
(E + s B A) and the embedding stays E (models/tied.py).

`wrap` builds the learner's trainable peft model (peft imported only there). Each A starts
from `initial_a`, drawn from the run seed and the adapter's name alone: a process that builds
the model on the meta device and loads only its shards (FSDP2) starts from the same adapters as
one that builds the whole model, whatever order either creates them in.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping

import torch

from models.tied import EMBED, HEAD

PEFT_PREFIX = "base_model.model."
"""What peft's LoraModel puts before the wrapped model's own parameter names."""


def wrap(model: torch.nn.Module, rank: int, alpha: float, dropout: float,
         targets: list[str]) -> torch.nn.Module:
    """`model` as a peft model: only the adapters require grad. B starts at zero (peft's
    default), so the wrapped model computes exactly what `model` did."""
    import warnings

    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():  # a tied lm_head target: peft warns that merging it into
        # the shared weight would change the embedding; Tether never does (models/tied.py), and
        # does not want `ensure_weight_tying` (it would adapt the embedding with the same A, B)
        warnings.filterwarnings("ignore", message=".*tied_target_modules.*")
        warnings.filterwarnings("ignore", message=".*ensure_weight_tying.*")
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                                                target_modules=targets, bias="none"))


def initial_a(peft_name: str, shape: tuple[int, ...], seed: int,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The starting value of adapter A `peft_name` (rank x in_features): uniform in
    +-1/sqrt(in_features), the bound of peft's default (kaiming-uniform, a = sqrt(5)), from a
    generator seeded by `seed` and the adapter's wire name. B starts at zero (peft's default)."""
    key = hashlib.sha256(f"{seed}:{hf_name(peft_name)}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    bound = 1 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=gen) * (2 * bound) - bound).to(dtype)


def is_a(peft_name: str) -> bool:
    return ".lora_A." in peft_name


def hf_name(peft_name: str) -> str:
    """A peft parameter name -> its wire name (the base model's module path)."""
    name = peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def split_state(items) -> tuple[dict, dict]:
    """(peft name, tensor) pairs -> (base tensors, adapter tensors), both by wire name."""
    base, adapter = {}, {}
    for name, t in items:
        (adapter if ".lora_" in name else base)[hf_name(name)] = t
    return base, adapter


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merge(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
          scale: float) -> dict[str, torch.Tensor]:
    """`base` with every adapted weight replaced by W + scale * B @ A (float32); the other
    tensors are `base`'s own (not copied). An adapter on a tied head (a base without
    `lm_head.weight`) yields an untied one, `lm_head.weight` = E + scale * B @ A, and
    `model.embed_tokens.weight` stays E (models/tied.py). Raises ValueError on an adapter whose
    layer is not in `base`, or whose A or B is missing or mis-shaped."""
    out = dict(base)
    for module, (a, b) in _pairs(adapter):
        key = f"{module}.weight"
        w = base.get(key, base.get(EMBED) if key == HEAD else None)  # a tied head is E
        if w is None:
            raise ValueError(f"adapter for {module}: the base has no {key}")
        if a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter for {module}: A {tuple(a.shape)}, B {tuple(b.shape)} do "
                             f"not fit {key} {tuple(w.shape)}")
        out[key] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def _pairs(adapter: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, tuple]]:
    """(module, (A, B)) for every adapted module; every tensor must be one of such a pair."""
    modules = sorted({n.rsplit(".lora_", 1)[0] for n in adapter})
    for module in modules:
        names = (f"{module}.lora_A.weight", f"{module}.lora_B.weight")
        if not all(n in adapter for n in names):
            raise ValueError(f"adapter tensors for {module} are not one lora_A + one lora_B")
        yield module, (adapter[names[0]], adapter[names[1]])
    if len(adapter) != 2 * len(modules):
        raise ValueError(f"adapter has tensors that are not lora_A / lora_B pairs: "
                         f"{sorted(n for n in adapter if not is_adapter(n))}")


def write_adapter(directory, adapter: Mapping[str, torch.Tensor], rank: int, alpha: float,
                  targets: list[str]) -> None:
    """`adapter` (wire names) as a PEFT adapter directory: adapter_config.json +
    adapter_model.safetensors under peft's names, what vLLM's LoRARequest loads. Written to a
    temporary directory and renamed, so a reader never sees half of it."""
    import json
    import os
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({PEFT_PREFIX + k: v.contiguous() for k, v in adapter.items()},
              str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none"}))
    os.replace(tmp, directory)
