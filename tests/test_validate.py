"""Trajectory validation: every way a GroupResult can be wrong is refused with a reason."""

import numpy as np
import pytest

from learner.leases import LeaseRecord
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
    return m.Sample(sample_index=i, completion_ids=m.Array.from_numpy(np.asarray(ids, np.int32)),
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
