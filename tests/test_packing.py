"""Packed micro-batches (`learner.pack_rows`, learner/algo/microbatch.py, models/packing.py):
the plan fits the budget and keeps every row once, a packed forward gives each row's own
logprobs and never lets one row see another, and a step's gradients and statistics equal the
unpacked micro-batched and the one-batch step's, with a critic and the reference, with LoRA,
and on two FSDP2 ranks with stand-ins (fp32; measured gaps in the tests)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers.masking_utils
from safetensors.torch import load_file

import fsdp_worker
from learner.algo import microbatch
from learner.algo.batch import TokenBatch, collate, padded_length
from learner.backends.single import SingleProcessBackend
from models import packing
from test_fsdp import TOL, _max_diff, _single, _torchrun
from test_microbatch import BUDGET, _updates


def _share(model_dir):
    cfg = fsdp_worker.config(model_dir)
    return collate(fsdp_worker.synthetic_groups(cfg, 0), pad_id=0), cfg


def test_packed_plan_fits_the_budget_and_restarts_positions_per_row(tiny_model_dir):
    mb, _ = _share(tiny_model_dir)
    parts = microbatch.plan(mb.lengths, BUDGET, pack=True)
    rows = torch.cat([p.rows for p in parts])
    assert sorted(rows.tolist()) == list(range(len(mb.lengths)))  # every row once
    assert len(parts) <= len(microbatch.plan(mb.lengths, BUDGET))
    for p in parts:
        assert torch.equal(p.packed, mb.lengths[p.rows])
        ids, pos = p.inputs(mb)
        assert ids.shape == pos.shape == (1, int(p.packed.sum()))
        assert ids.shape[1] <= BUDGET or len(p.rows) == 1
        want_ids = torch.cat([mb.input_ids[r, :n] for r, n in zip(p.rows, p.packed)])
        want_pos = torch.cat([torch.arange(n) for n in p.packed])
        assert torch.equal(ids[0], want_ids) and torch.equal(pos[0], want_pos)
        # outputs: packed output j (predicting token j+1) back at its row's column
        back = p.outputs(torch.arange(1, ids.shape[1], dtype=torch.float32)[None])
        for i, n in enumerate(p.packed.tolist()):
            start = int(p.packed[:i].sum())
            assert back[i, :n - 1].tolist() == list(range(start + 1, start + n))
            assert not back[i, n - 1:].any()  # its last token (next row's first): dropped
    alone = microbatch.plan(torch.tensor([5, 60, 7, 9]), 21, pack=True)  # longer: alone
    assert [(p.rows.tolist(), p.packed.tolist()) for p in alone] == [([1], [60]),
                                                                     ([0, 2, 3], [5, 7, 9])]
    assert len(microbatch.plan(torch.tensor([5, 60, 7, 9]), 21)) == 3  # bucketed: 9 x 3 > 21
    first_fit = microbatch.plan(torch.tensor([10, 8, 6, 4]), 14, pack=True)  # 4 joins 10
    assert [p.rows.tolist() for p in first_fit] == [[0, 3], [1, 2]]
    stand_in = microbatch.padded(alone, 3)[-1]
    assert stand_in.padding and stand_in.packed.tolist() == [5]


def test_packed_forward_gives_each_rows_own_logprobs(tiny_model_dir):
    mb, cfg = _share(tiny_model_dir)
    L = cfg.learner
    backend = SingleProcessBackend(cfg.model.path, L.lr, L.weight_decay, L.seed)
    lp = lambda ids, pos: backend.logprobs(ids, 1.0, pos)  # noqa: E731
    with torch.no_grad():
        alone = microbatch.per_token([microbatch.MicroBatch(rows=torch.tensor([r]), length=int(n))
                                      for r, n in enumerate(mb.lengths)], mb, lp)
        packed = microbatch.per_token(microbatch.plan(mb.lengths, BUDGET, pack=True), mb, lp)
    gap = (packed - alone).abs().max()
    assert gap <= 1e-5, gap  # measured 9.5e-7 (CPU kernels round other lengths differently)


def test_a_row_never_sees_the_rows_before_it_in_its_pack(tiny_model_dir, monkeypatch):
    """Changing a pack's first row leaves the second's logprobs bitwise the same; with the
    row boundaries hidden from transformers (attention crosses rows), they change, and the
    start-up check refuses the model."""
    mb, cfg = _share(tiny_model_dir)
    L = cfg.learner
    backend = SingleProcessBackend(cfg.model.path, L.lr, L.weight_decay, L.seed)
    part = next(p for p in microbatch.plan(mb.lengths, BUDGET, pack=True) if len(p.rows) > 1)
    other = mb.input_ids.clone()
    first = int(part.rows[0])
    other[first] = (other[first] + 1) % 16  # every token of the first row changed
    lp = lambda ids, pos: backend.logprobs(ids, 1.0, pos)  # noqa: E731

    def second_row(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return part.run(lp, TokenBatch(
                input_ids=ids, mask=mb.mask, behavior=mb.behavior, versions=mb.versions,
                rewards=mb.rewards, num_groups=mb.num_groups, lengths=mb.lengths))[1:]

    assert torch.equal(second_row(mb.input_ids), second_row(other))
    packing.require_rows_apart("the policy", backend.model, lp)
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices",
                        lambda position_ids: None)
    assert not torch.equal(second_row(mb.input_ids), second_row(other))
    with pytest.raises(ValueError, match="the policy lets packed rows attend to each other"):
        packing.require_rows_apart("the policy", backend.model, lp)


def test_packed_step_equals_unpacked_and_one_batch(tiny_model_dir):
    """The policy's and the critic's gradients of each update (ALGO_OVERRIDES: a critic, the
    reference KL, the entropy bonus), and the step's metrics."""
    overrides = [*fsdp_worker.ALGO_OVERRIDES, "learner.max_grad_norm=0"]
    one, one_grads = _updates(fsdp_worker.config(tiny_model_dir, *overrides))
    micro = [f"learner.max_tokens_per_microbatch={BUDGET}"]
    bucketed, bucketed_grads = _updates(fsdp_worker.config(tiny_model_dir, *overrides, *micro))
    packed, packed_grads = _updates(fsdp_worker.config(tiny_model_dir, *overrides, *micro,
                                                       "learner.pack_rows=true"))
    assert one_grads.keys() == bucketed_grads.keys() == packed_grads.keys()
    for want, want_grads in ((one, one_grads), (bucketed, bucketed_grads)):
        for name, g in want_grads.items():
            diff = (packed_grads[name] - g).norm()
            # measured: at most 1.5e-6 of the norm
            assert diff <= 1e-5 * g.norm(), f"{name}: relative difference {diff / g.norm():.2e}"
        for k, v in want.items():
            assert packed[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_lora_packed_step_equals_one_batch(tiny_model_dir):
    """LoRA (LORA_OVERRIDES: the tied head's adapter too, the frozen base as the KL
    reference) packs: each update's adapter gradients equal the one-batch step's (measured: at
    most 2.2e-6 of the norm)."""
    def adapter_grads(*extra: str) -> dict[str, torch.Tensor]:
        cfg = fsdp_worker.config(tiny_model_dir, *fsdp_worker.LORA_OVERRIDES,
                                 "learner.max_grad_norm=0", *extra)
        backend, trainer = _single(cfg)
        grads, apply, updates = {}, backend.apply_gradients, [0]

        def capture(max_grad_norm):
            updates[0] += 1
            grads.update({f"{updates[0]}.{n}": p.grad.clone()
                          for n, p in backend.model.named_parameters() if p.grad is not None})
            return apply(max_grad_norm)
        backend.apply_gradients = capture
        trainer.step(fsdp_worker.synthetic_groups(cfg, 0), 0)
        return grads

    one = adapter_grads()
    packed = adapter_grads(f"learner.max_tokens_per_microbatch={BUDGET}", "learner.pack_rows=true")
    assert one.keys() == packed.keys() and all("lora_" in k for k in one)
    for name, g in one.items():
        diff = (packed[name] - g).norm()
        assert diff <= 1e-5 * g.norm(), f"{name}: relative difference {diff / g.norm():.2e}"


def test_packed_fsdp2_step_equals_single_process_one_batch(tmp_path, tiny_model_dir):
    """Two FSDP2 ranks (gloo) with PACKED_OVERRIDES, the critic and the reference checked
    and run packed, rank 0 with 3 stand-ins: the single process's one-batch metrics and
    policy gradients (measured: gradients 3.4e-8 apart, metrics 2.4e-7)."""
    cfg = fsdp_worker.config(tiny_model_dir, "learner.max_grad_norm=0", "learner.minibatches=1",
                             *fsdp_worker.ALGO_OVERRIDES)
    groups = fsdp_worker.synthetic_groups(cfg, 0)
    counts = [len(microbatch.plan(collate(half, 0, padded_length(groups)).lengths, 20, pack=True))
              for half in (groups[:len(groups) // 2], groups[len(groups) // 2:])]
    assert counts == [8, 11]
    _torchrun("tests/fsdp_worker.py", "packed", str(tmp_path), str(tiny_model_dir))
    backend, trainer = _single(cfg)
    ref = trainer.step(groups, 0)
    got = json.loads((tmp_path / "grads_packed.json").read_text())
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=TOL, abs=TOL), k
    grads = {n: p.grad for n, p in backend.model.named_parameters()}
    assert _max_diff(load_file(str(tmp_path / "grads_packed.safetensors")), grads) <= TOL
