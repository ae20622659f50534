"""Checkpoint housekeeping: a checkpoint that cannot fit fails before writing, with the cause
named; older checkpoints are pruned to learner.checkpoint_keep once a new one is complete."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest
import torch

from learner import checkpoint
from learner.backends.single import SingleProcessBackend
from learner.main import _checkpoint_dirs, _prune_checkpoints


def test_a_state_larger_than_the_disk_is_refused_with_the_cause(tmp_path):
    huge = {"model": {"w": torch.empty(2**42, device="meta")}}  # 16 TiB (+5%), never allocated
    with pytest.raises(OSError, match=r"step_3\.tmp needs about 17203\.26 GiB") as e:
        checkpoint.ensure_space(tmp_path / "checkpoints" / "step_3.tmp", huge)
    assert e.value.errno == errno.ENOSPC
    assert "learner.checkpoint_keep" in str(e.value)


def test_a_full_disk_leaves_no_partial_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    backend = SingleProcessBackend(tiny_model_dir, lr=1e-3, weight_decay=0.0, seed=0)
    real = shutil.disk_usage(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda p: usage(real.total, real.total - (1 << 20), 1 << 20))
    with pytest.raises(OSError, match=r"has 0\.00 GiB free"):
        backend.save_checkpoint(tmp_path / "step_1.tmp", {"version": 1})
    assert not (tmp_path / "step_1.tmp" / "dcp").exists()
    monkeypatch.undo()
    backend.save_checkpoint(tmp_path / "step_1.tmp", {"version": 1})  # room again: it writes
    assert (tmp_path / "step_1.tmp" / "state.json").exists()


@pytest.mark.parametrize("keep,left", [(2, ["step_40", "step_50"]), (1, ["step_50"]),
                                       (0, ["step_9", "step_10", "step_40", "step_50"])])
def test_prune_keeps_the_newest_by_step_number(tmp_path, keep, left):
    for name in ["step_9", "step_10", "step_40", "step_50", "step_60.tmp"]:
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    _prune_checkpoints(tmp_path, keep, 50)
    assert [p.name for p in _checkpoint_dirs(tmp_path)] == left
    assert not (tmp_path / "checkpoints" / "step_60.tmp").exists()  # a crash's leftover


def test_prune_never_takes_the_checkpoint_just_written(tmp_path):
    """A new run in a run_dir holding an earlier run's step_200 and step_300 writes step_100:
    that one stays (and the earlier run's are not this run's to delete)."""
    for name in ["step_50", "step_100", "step_200", "step_300"]:
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    _prune_checkpoints(tmp_path, 1, 100)
    assert [p.name for p in _checkpoint_dirs(tmp_path)] == ["step_100", "step_200", "step_300"]
