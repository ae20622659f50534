"""Trajectory validation: every way a GroupResult can be wrong is refused with a reason."""

import numpy as np
import pytest

from learner.leases import LeaseRecord
from buffer.record import TOKEN_FIELDS
from learner.validate import _VIEW_TOKENS, InvalidTrajectory, to_group
from tasks.base import Prompt
from transport import messages as m

VOCAB = 16


def _lease(n=2, min_version=3):
    return LeaseRecord(lease_id=7, prompt=Prompt(5, np.array([1, 4, 6], np.int32), {}),
                       actor_id="a", incarnation="i", num_samples=n, min_version=min_version)


def _sample(i, ids=(6, 7, 2), lp=None, ver=None, mask=None, reward=1.0):
    k = len(ids)
    lp = np.full(k, -0.5, np.float32) if lp is None else (
        lp if isinstance(lp, np.ndarray) else np.asarray(lp, np.float32))
    ver = np.full(k, 3, np.int32) if ver is None else np.asarray(ver)
    mask = np.ones(k, np.uint8) if mask is None else np.asarray(mask)
    ids = ids if isinstance(ids, np.ndarray) else np.asarray(ids, np.int32)
    return m.Sample(sample_index=i, completion_ids=m.Array.from_numpy(ids),
                    logprobs=m.Array.from_numpy(lp), versions=m.Array.from_numpy(ver),
                    loss_mask=m.Array.from_numpy(mask), reward=reward)


def _msg(samples):
    return m.GroupResult(lease_id=7, actor_id="a", prompt_id=5, samples=samples)


def test_valid_group_converts():
    g = to_group(_msg([_sample(1), _sample(0)]), _lease(), VOCAB, latest_version=4, max_tokens=5)
    assert g.lease_id == 7 and g.rewards.tolist() == [1.0, 1.0] and g.min_version == 3
    np.testing.assert_array_equal(g.prompt_ids, [1, 4, 6])  # the prompt comes from the lease


@pytest.mark.parametrize("samples, reason", [
    ([_sample(0)], "sample indices"),
    ([_sample(0), _sample(0)], "sample indices"),
    ([_sample(0), _sample(1, lp=[-0.5, np.nan, -0.1])], "finite"),
    ([_sample(0), _sample(1, lp=[-0.5, -np.inf, -0.1])], "finite"),
    ([_sample(0), _sample(1, lp=[-0.5, 0.7, -0.1])], "<= 0"),
    ([_sample(0), _sample(1, ids=(6, 99, 2))], "outside vocabulary"),
    ([_sample(0), _sample(1, ids=(6, -1, 2))], "outside vocabulary"),
    ([_sample(0), _sample(1, lp=[-0.5, -0.5])], "one length"),
    ([_sample(0), _sample(1, ids=())], "one length"),
    ([_sample(0), _sample(1, ids=(6,) * 9)], "limit"),
    ([_sample(0), _sample(1, ver=[3, 9, 3])], "versions"),
    ([_sample(0), _sample(1, ver=[3, 2, 3])], "min_version"),
    ([_sample(0), _sample(1, mask=[1, 2, 1])], "loss_mask"),
    ([_sample(0), _sample(1, reward=float("nan"))], "reward"),
    ([_sample(0), _sample(1, lp=np.array([-1, -1, -1], np.int32))], "floating"),
    # sent wider than the record's int32 / uint8: checked before narrowing, so nothing wraps
    # into range (2**32 + 6 would be id 6 as int32, a mask of 257 would be 1 as uint8)
    ([_sample(0), _sample(1, ids=np.array([6, 2**32 + 6, 2], np.int64))], "outside vocabulary"),
    ([_sample(0), _sample(1, ver=np.array([3, 2**32 + 3, 3], np.int64))], "versions"),
    ([_sample(0), _sample(1, mask=np.array([1, 257, 1], np.int32))], "loss_mask"),
])
def test_invalid_groups_are_refused_with_a_reason(samples, reason):
    with pytest.raises(InvalidTrajectory, match=reason):
        to_group(_msg(samples), _lease(), VOCAB, latest_version=4, max_tokens=5)


def test_array_bytes_that_do_not_fit_the_shape_are_refused():
    bad = _sample(1)
    bad = m.Sample(sample_index=1, completion_ids=m.Array("int32", (3,), b"\x00" * 5),
                   logprobs=bad.logprobs, versions=bad.versions, loss_mask=bad.loss_mask, reward=0.0)
    with pytest.raises(InvalidTrajectory, match="needs 12 bytes"):
        to_group(_msg([_sample(0), bad]), _lease(), VOCAB, latest_version=4, max_tokens=5)


def test_wrong_prompt_id_is_refused():
    msg = m.GroupResult(lease_id=7, actor_id="a", prompt_id=6, samples=[_sample(0), _sample(1)])
    with pytest.raises(InvalidTrajectory, match="prompt_id"):
        to_group(msg, _lease(), VOCAB, latest_version=4, max_tokens=5)


def test_record_dtypes_whatever_was_sent():
    """Columns sent in other allowed dtypes are cast to the record's (buffer/record.py
    TOKEN_FIELDS) with their values unchanged."""
    wide = _sample(1, ids=np.array([6, 7, 2], np.int64), lp=np.full(3, -0.5, np.float16),
                   ver=np.array([3, 4, 3], np.int64), mask=np.array([1, 0, 1], np.int64))
    g = to_group(_msg([_sample(0), wide]), _lease(), VOCAB, latest_version=4, max_tokens=5)
    for f in TOKEN_FIELDS:
        assert all(a.dtype == f.dtype for a in getattr(g, f.name)), f.name
    assert g.completions[1].tolist() == [6, 7, 2] and g.versions[1].tolist() == [3, 4, 3]
    assert g.loss_masks[1].tolist() == [1, 0, 1] and g.logprobs[1].tolist() == [-0.5] * 3


def test_large_groups_keep_the_received_bytes_small_ones_a_copy():
    """From _VIEW_TOKENS tokens a group's record arrays are views of the received message (no
    copy kept); below, copies. Either way they hold the values that were sent."""
    rng = np.random.default_rng(0)
    for n, in_place in ((_VIEW_TOKENS // 2, True), (4, False)):
        ids = [rng.integers(0, VOCAB, n).astype(np.int32) for _ in range(2)]
        msg = m.Decoders().trajectory.decode(m.encoder().encode(
            _msg([_sample(i, ids=ids[i]) for i in range(2)])))
        g = to_group(msg, _lease(), VOCAB, latest_version=4, max_tokens=n)
        for i in range(2):
            np.testing.assert_array_equal(g.completions[i], ids[i])
            sent = np.frombuffer(msg.samples[i].completion_ids.data, np.int32)
            assert np.shares_memory(g.completions[i], sent) == in_place
            assert not g.completions[i].flags.writeable or not in_place
