"""Trajectory validation: every way a GroupResult can be wrong is refused with a reason."""

import numpy as np
import pytest

from learner.leases import LeaseRecord
from buffer.record import TOKEN_FIELDS
from learner.validate import InvalidTrajectory, to_group
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
    return m.Sample(sample_index=i, reward=reward), dict(completion_ids=ids, logprobs=lp,
                                                        versions=ver, loss_mask=mask)


def _msg(samples, prompt_id=5):
    """The group as actors send it (transport.messages.pack_group: one column per field;
    samples of different dtypes promote to one)."""
    return m.pack_group(lease_id=7, actor_id="a", prompt_id=prompt_id,
                        samples=[s for s, _ in samples], tokens=[t for _, t in samples])


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
    ([_sample(0), _sample(1, lp=[-0.5, -0.5])], "logprobs: shape .* add up to 6"),
    ([_sample(0), _sample(1, ids=())], "sample 1: num_tokens 0 is not in 1..5"),
    ([_sample(0), _sample(1, ids=(6,) * 9)], "sample 1: num_tokens 9 .* token limit"),
    ([_sample(0), _sample(1, ver=[3, 9, 3])], "versions"),
    ([_sample(0), _sample(1, ver=[3, 2, 3])], "min_version"),
    ([_sample(0), _sample(1, mask=[1, 2, 1])], "loss_mask"),
    ([_sample(0), _sample(1, reward=float("nan"))], "reward"),
    ([_sample(i, lp=np.array([-1, -1, -1], np.int32)) for i in range(2)], "floating"),
    ([_sample(i, mask=np.array([1., 1., 1.], np.float32)) for i in range(2)], "integer arrays"),
    # sent wider than the record's int32 / uint8: checked before narrowing, so nothing wraps
    # into range (2**32 + 6 would be id 6 as int32, a mask of 257 would be 1 as uint8)
    ([_sample(0), _sample(1, ids=np.array([6, 2**32 + 6, 2], np.int64))], "outside vocabulary"),
    ([_sample(0), _sample(1, ver=np.array([3, 2**32 + 3, 3], np.int64))], "versions"),
    ([_sample(0), _sample(1, mask=np.array([1, 257, 1], np.int32))], "loss_mask"),
    ([_sample(0), _sample(1, mask=np.array([1, -1, 1], np.int32))], "loss_mask"),
])
def test_invalid_groups_are_refused_with_a_reason(samples, reason):
    with pytest.raises(InvalidTrajectory, match=reason):
        to_group(_msg(samples), _lease(), VOCAB, latest_version=4, max_tokens=5)


def test_array_bytes_that_do_not_fit_the_shape_are_refused():
    msg = _msg([_sample(0), _sample(1)])
    msg.completion_ids = m.Array("int32", (6,), b"\x00" * 5)
    with pytest.raises(InvalidTrajectory, match="completion_ids: .* needs 24 bytes, got 5"):
        to_group(msg, _lease(), VOCAB, latest_version=4, max_tokens=5)


def test_an_unknown_dtype_is_refused():
    msg = _msg([_sample(0), _sample(1)])
    msg.versions = m.Array("bfloat16", (6,), b"\x00" * 12)
    with pytest.raises(InvalidTrajectory, match="versions: array dtype 'bfloat16' is not one of"):
        to_group(msg, _lease(), VOCAB, latest_version=4, max_tokens=5)


def test_samples_in_any_order_keep_their_own_tokens():
    """An actor may list its samples in any order; each sample's tokens follow its position
    in the message, and the record is in sample_index order."""
    msg = _msg([_sample(1, ids=(6, 7), reward=0.0), _sample(0, ids=(2, 3, 4), reward=1.0)])
    g = to_group(msg, _lease(), VOCAB, latest_version=4, max_tokens=5)
    assert [c.tolist() for c in g.completions] == [[2, 3, 4], [6, 7]]
    assert g.rewards.tolist() == [1.0, 0.0]
    with pytest.raises(InvalidTrajectory, match="sample 1: token id outside"):
        to_group(_msg([_sample(1, ids=(6, 99)), _sample(0)]), _lease(), VOCAB, latest_version=4,
                 max_tokens=5)


def test_wrong_prompt_id_is_refused():
    msg = _msg([_sample(0), _sample(1)], prompt_id=6)
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


def test_the_record_keeps_the_received_bytes_when_sent_in_its_dtypes():
    """Columns sent in the record's dtypes (as actors send them) are not copied: the record's
    arrays are read-only views of the received message. A column sent wider is a copy. Either
    way they hold the values that were sent."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, VOCAB, 5).astype(np.int32) for _ in range(2)]
    for dtype, in_place in ((np.int32, True), (np.int64, False)):
        msg = m.Decoders().trajectory.decode(m.encoder().encode(
            _msg([_sample(i, ids=ids[i].astype(dtype)) for i in range(2)])))
        g = to_group(msg, _lease(), VOCAB, latest_version=4, max_tokens=5)
        sent = np.frombuffer(msg.completion_ids.data, dtype)
        for i in range(2):
            np.testing.assert_array_equal(g.completions[i], ids[i])
            assert np.shares_memory(g.completions[i], sent) == in_place
            assert not g.completions[i].flags.writeable or not in_place
