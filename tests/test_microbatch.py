"""Micro-batches by token budget (learner/algo/microbatch.py): the accumulated gradients of the
policy and the critic, and the step's statistics, equal the one-batch step's for each loss
aggregation (fp32; micro-batches cut rows to their own padded length, so CPU kernels round
differently: 1e-5 relative, the norm of the difference over the norm)."""

from __future__ import annotations

import pytest
import torch

import fsdp_worker
from learner.algo import microbatch
from learner.algo.batch import collate
from learner.algo.trainer import Trainer
from learner.backends.single import SingleProcessBackend
from learner.distributed import Ranks, make_models

BUDGET = 48
"""Tokens per micro-batch: the synthetic batch's 32 rows of 9 to 24 tokens take 14 of them."""


def _updates(cfg) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step on synthetic batch 0 (two minibatches): its metrics and each update's policy
    and critic gradients (captured before the optimizer steps; the critic's second update is
    the first with backbone gradients: its head starts at zero)."""
    L = cfg.learner
    backend = SingleProcessBackend(cfg.model.path, L.lr, L.weight_decay, L.seed)
    models = make_models(cfg, Ranks(0, 1, torch.device("cpu")))
    trainer = Trainer(cfg, backend, pad_id=0, models=models)
    grads: dict[str, torch.Tensor] = {}
    for prefix, b in (("policy.", backend), ("critic.", models.critic)):
        def capture(max_grad_norm, b=b, apply=b.apply_gradients, prefix=prefix, calls=[0]):
            calls[0] += 1
            grads.update({f"{prefix}{calls[0]}.{n}": p.grad.clone()
                          for n, p in b.model.named_parameters() if p.grad is not None})
            return apply(max_grad_norm)
        b.apply_gradients = capture
    return trainer.step(fsdp_worker.synthetic_groups(cfg, 0), 0), grads


@pytest.mark.parametrize("agg", fsdp_worker.LOSS_AGGS)
def test_microbatched_step_equals_one_batch(tiny_model_dir, agg):
    overrides = [*fsdp_worker.ALGO_OVERRIDES, f"learner.loss_agg={agg}", "learner.max_grad_norm=0"]
    one, one_grads = _updates(fsdp_worker.config(tiny_model_dir, *overrides))
    cfg = fsdp_worker.config(tiny_model_dir, *overrides,
                             f"learner.max_tokens_per_microbatch={BUDGET}")
    micro, micro_grads = _updates(cfg)
    assert one_grads.keys() == micro_grads.keys()
    assert "critic.2.model.embed_tokens.weight" in one_grads
    for name, g in one_grads.items():
        diff = (micro_grads[name] - g).norm()
        assert diff <= 1e-5 * g.norm(), f"{name}: relative difference {diff / g.norm():.2e}"
        assert g.norm() > 0 or name.startswith("critic.1.")  # zero head: no backbone gradient
    assert one.keys() == micro.keys()
    for k, v in one.items():
        assert micro[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_plan_packs_rows_by_length_within_the_budget(tiny_model_dir):
    cfg = fsdp_worker.config(tiny_model_dir)
    mb = collate(fsdp_worker.synthetic_groups(cfg, 0), pad_id=0)
    parts = microbatch.plan(mb.lengths, BUDGET)
    rows = torch.cat([p.rows for p in parts])
    assert sorted(rows.tolist()) == list(range(len(mb.lengths)))  # every row once
    assert len(parts) > 3 and len({p.length for p in parts}) > 2  # cut to their own lengths
    for p in parts:
        assert p.length == int(mb.lengths[p.rows].max())
        assert len(p.rows) * p.length <= BUDGET or len(p.rows) == 1
    padded = sum(len(p.rows) * p.length for p in parts)
    assert padded < mb.input_ids.numel()
    alone = microbatch.plan(torch.tensor([5, 60, 7]), 20)  # a row over the budget goes alone
    assert [(p.rows.tolist(), p.length) for p in alone] == [([1], 60), ([0, 2], 7)]


def test_activation_checkpointing_keeps_the_gradients_and_drops_saved_activations(tiny_model_dir):
    """learner.activation_checkpointing: the same step (bitwise: the recomputation repeats the
    forward's kernels), and the policy's forward keeps far fewer bytes for the backward."""
    def run(ac: bool):
        cfg = fsdp_worker.config(tiny_model_dir, "learner.max_grad_norm=0",
                                 f"learner.activation_checkpointing={str(ac).lower()}")
        L = cfg.learner
        backend = SingleProcessBackend(cfg.model.path, L.lr, L.weight_decay, L.seed,
                                       activation_checkpointing=ac)
        saved = 0

        def pack(t):
            nonlocal saved
            saved += t.numel() * t.element_size()
            return t
        ids = collate(fsdp_worker.synthetic_groups(cfg, 0), pad_id=0).input_ids
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            backend.logprobs(ids, 1.0).sum()
        trainer = Trainer(cfg, backend, pad_id=0)
        trainer.step(fsdp_worker.synthetic_groups(cfg, 0), 0)
        return saved, backend.state_dict()

    plain_saved, plain = run(False)
    ac_saved, ac = run(True)
    assert ac_saved < plain_saved / 2, (ac_saved, plain_saved)
    for k in plain:
        assert torch.equal(plain[k], ac[k]), k
