"""bf16 weights and AdamW moments (learner/backends/optim.py, the backend's `param_dtype`)."""

from __future__ import annotations

import pytest
import torch

from configs.loader import ConfigError, load_config
from learner.backends.optim import BF16AdamW, round_stochastic_
from learner.backends.single import SingleProcessBackend


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and above each fp32 value (in magnitude: toward and away
    from zero), as fp32."""
    low = (x.view(torch.int32) & -65536).view(torch.float32)
    high = (low.view(torch.int32) + 65536).view(torch.float32)
    return low, high


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_picks_a_neighbour_and_is_exact_on_average(sign):
    gen = torch.Generator().manual_seed(0)
    x = sign * (1 + torch.rand(1 << 18, generator=gen) * 2**-7)  # between 1 and its next bf16
    low, high = _neighbours(x)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    round_stochastic_(out, x.clone(), gen)
    got = out.float()
    assert torch.all((got == low) | (got == high))
    # E[round(x)] = x: over 2**18 values the mean error is within ~4 standard errors of 0
    # (spacing 2**-7, so a standard error of ~2**-7 / sqrt(12 * 2**18) = 4e-6)
    assert abs((got - x).mean().item()) < 2e-5


def test_updates_far_below_bf16_spacing_add_up():
    """Weights at 1.0, a constant gradient, lr 1e-4: AdamW moves each weight by ~1e-4 a step,
    1/39 of the distance to the next bf16 below 1.0 (2**-8). Rounded to nearest, the weights
    never move; rounded stochastically they move as fp32 weights do, on average."""
    n, steps, lr = 1 << 16, 100, 1e-4
    ref = torch.nn.Parameter(torch.ones(n))
    nearest = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    sr = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opts = [torch.optim.AdamW([ref], lr=lr, weight_decay=0.0),
            torch.optim.AdamW([nearest], lr=lr, weight_decay=0.0),
            BF16AdamW([sr], lr=lr, weight_decay=0.0, seed=0)]
    for _ in range(steps):
        for p, opt in zip((ref, nearest, sr), opts):
            p.grad = torch.ones_like(p)
            opt.step()
    moved = 1 - ref.mean().item()
    assert moved == pytest.approx(steps * lr, rel=1e-3)
    assert torch.all(nearest == 1)  # torch AdamW on bf16 weights: every update lost
    assert 1 - sr.float().mean().item() == pytest.approx(moved, rel=0.02)


def test_one_step_is_fp32_adamw_rounded_to_a_neighbour():
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(4096, generator=gen).bfloat16()
    grad = torch.randn(4096, generator=gen).bfloat16()
    ref = torch.nn.Parameter(w0.float())
    got = torch.nn.Parameter(w0.clone())
    ref.grad, got.grad = grad.float(), grad.clone()
    torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1).step()
    opt = BF16AdamW([got], lr=1e-2, weight_decay=0.1)
    opt.step()
    low, high = _neighbours(ref.detach())
    tol = 1e-6 * ref.detach().abs()  # fp32 AdamW orders its operations differently
    g = got.detach().float()
    assert torch.all(((g - low).abs() <= tol) | ((g - high).abs() <= tol))
    assert {t.dtype for t in opt.state[got].values() if t.dim()} == {torch.bfloat16}
    assert not torch.equal(got.detach(), w0)


def test_bf16_weights_need_bf16_compute(tiny_model_dir):
    with pytest.raises(ValueError, match=r"param_dtype=bfloat16 needs model.dtype=bfloat16"):
        SingleProcessBackend(tiny_model_dir, 1e-3, 0.0, 0, dtype=torch.float32,
                             param_dtype="bfloat16")


def test_megatron_has_no_param_dtype():
    with pytest.raises(ConfigError, match="param_dtype"):
        load_config(None, ["learner.backend={kind: megatron, param_dtype: bfloat16}"])


def test_bf16_weights_checkpoint_round_trip(tiny_model_dir, tmp_path):
    """Weights and moments of a bf16 run come back exactly from its checkpoint."""
    def backend():
        return SingleProcessBackend(tiny_model_dir, 1e-3, 0.0, 0, dtype=torch.bfloat16,
                                    param_dtype="bfloat16")

    a = backend()
    ids = torch.randint(0, 10, (2, 6), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        a.step(-a.logprobs(ids, 1.0).mean(), 1.0)
    a.save_checkpoint(tmp_path / "ckpt", {"version": 2})
    b = backend()
    assert b.load_checkpoint(tmp_path / "ckpt")["version"] == 2
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(p, q), name
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        for k in ("exp_avg", "exp_avg_sq"):
            assert sb[k].dtype == torch.bfloat16 and torch.equal(sa[k], sb[k]), (name, k)
