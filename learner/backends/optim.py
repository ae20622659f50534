"""The optimizer of the trained weights, by the backend section's `param_dtype`.

    float32   torch AdamW: fp32 weights, gradients and moments, 16 bytes a parameter
    bfloat16  `BF16AdamW`: bf16 weights, gradients and moments, 8 bytes a parameter (a model
              twice as large fits), each update computed in fp32 and rounded stochastically

Why stochastic rounding: bf16 keeps 8 bits of mantissa, so an update smaller than half the
spacing between a weight and its neighbour (~0.2 % of the weight) rounds to no change at all,
every step; learning rates of 1e-6 move almost nothing. Rounding up with probability equal to
the fraction of the spacing makes every rounding exact on average (E[round(x)] = x), so many
small steps add up as they would in fp32. The moments get the same rounding (the second
moment's decay by 0.999 a step is itself below bf16's resolution).

Memory: the update runs over each tensor in chunks of `CHUNK` elements, so its fp32
temporaries are a few chunks, never a copy of the largest tensor (a 152k-token embedding).
Works on FSDP2's sharded parameters (DTensor): each rank updates its local shard.
Resume is not bitwise: the rounding's random stream is not checkpointed (float32 resumes
bitwise as before).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

CHUNK = 1 << 22
"""Elements updated at once (fp32 temporaries: a few times 16 MiB)."""

_HIGH = -65536
"""int32 0xFFFF0000: the bits of a float32 that a bfloat16 keeps."""


def make_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                   param_dtype: str, seed: int = 0) -> torch.optim.Optimizer:
    """AdamW over `params` for weights held in `param_dtype` (module docstring)."""
    if param_dtype == "float32":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return BF16AdamW(params, lr=lr, weight_decay=weight_decay, seed=seed)


def round_stochastic_(dst: torch.Tensor, src: torch.Tensor, gen: torch.Generator) -> None:
    """dst (bfloat16) = src (float32) rounded to one of its two bf16 neighbours, the upper one
    with probability equal to src's distance from the lower one over their spacing. `src`
    is overwritten."""
    bits = src.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device,
                          generator=gen)
    bits.add_(noise).bitwise_and_(_HIGH)  # the magnitude's low 16 bits carry or not
    dst.copy_(src)  # exact: src now has bf16's bits only


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) for bfloat16 parameters, with
    bfloat16 moments and stochastically rounded writes (module docstring). The state has
    AdamW's keys (step, exp_avg, exp_avg_sq), so checkpoints save and load it the same way."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, seed: int = 0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.seed = seed
        self._gens: dict[torch.device, torch.Generator] = {}

    def _gen(self, device: torch.device) -> torch.Generator:
        if device not in self._gens:
            self._gens[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._gens[device]

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "BF16AdamW takes no closure"
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"BF16AdamW steps bfloat16 parameters, got {p.dtype}")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = float(state["step"])
                w, g = _local(p).view(-1), _local(p.grad).view(-1)
                m, v = _local(state["exp_avg"]).view(-1), _local(state["exp_avg_sq"]).view(-1)
                gen = self._gen(w.device)
                lr, wd = group["lr"], group["weight_decay"]
                scale = lr / (1 - b1 ** step)
                root_bc2 = math.sqrt(1 - b2 ** step)
                for s in range(0, w.numel(), CHUNK):
                    part = slice(s, s + CHUNK)
                    g32 = g[part].float()
                    m32 = m[part].float().lerp_(g32, 1 - b1)
                    v32 = v[part].float().mul_(b2).addcmul_(g32, g32, value=1 - b2)
                    w32 = w[part].float().mul_(1 - lr * wd)
                    w32.addcdiv_(m32, g32.copy_(v32).sqrt_().div_(root_bc2).add_(group["eps"]),
                                 value=-scale)
                    round_stochastic_(w[part], w32, gen)
                    round_stochastic_(m[part], m32, gen)
                    round_stochastic_(v[part], v32, gen)
        return None
