import threading

from buffer.accounting import DropReason, Drops
from buffer.replay import ReplayBuffer

from helpers import FakeTask, make_group
from learner.leases import LeaseTable


def test_take_drops_stale_groups_and_counts_them():
    buf = ReplayBuffer(capacity=8, max_staleness=1)
    for i, v in enumerate([0, 1, 2, 3]):
        buf.put(make_group(i, v))
    # At version 3, groups sampled at 0 and 1 are 3 and 2 versions old: too stale for eta=1.
    got = buf.take(2, version=3, timeout=1)
    assert [g.lease_id for g in got] == [2, 3]
    c = buf.counts()
    assert c["received"] == 4 and c["consumed"] == 2 and c["dropped"] == {"stale": 2}
    assert c["size"] == 0


def test_staleness_uses_the_oldest_token_version():
    buf = ReplayBuffer(capacity=4, max_staleness=1)
    g = make_group(0, 5)
    g.versions[1][0] = 3  # one token of one sample is older
    buf.put(g)
    assert buf.take(1, version=5, timeout=0.05) is None
    assert buf.counts()["dropped"] == {"stale": 1}


def test_take_times_out_and_returns_none_when_short():
    buf = ReplayBuffer(capacity=4, max_staleness=0)
    buf.put(make_group(0, 0))
    assert buf.take(2, version=0, timeout=0.05) is None
    assert len(buf) == 1  # nothing lost by the timeout


def test_take_wakes_when_a_producer_fills_it():
    """The producer fills the buffer only once the taker is blocked inside `take`, so the
    batch can only arrive through the wake-up (the taker's timeout is an hour)."""
    buf = ReplayBuffer(capacity=4, max_staleness=0)
    got = []
    taker = threading.Thread(target=lambda: got.append(buf.take(2, version=0, timeout=3600)))
    taker.start()
    assert buf.wait_for_takers(1, timeout=10)
    buf.put(make_group(0, 0))
    buf.put(make_group(1, 0))
    taker.join(timeout=10)
    assert not taker.is_alive(), "take() was not woken by put()"
    assert [g.lease_id for g in got[0]] == [0, 1]


def test_capacity_is_bounded():
    buf = ReplayBuffer(capacity=2, max_staleness=0)
    buf.put(make_group(0, 0))
    buf.put(make_group(1, 0))
    assert not buf.has_room()
    import pytest

    with pytest.raises(RuntimeError, match="full"):
        buf.put(make_group(2, 0))


def test_close_wakes_a_blocked_take():
    buf = ReplayBuffer(capacity=2, max_staleness=0)
    got = []
    taker = threading.Thread(target=lambda: got.append(buf.take(1, version=0, timeout=3600)))
    taker.start()
    assert buf.wait_for_takers(1, timeout=10)
    buf.close()
    taker.join(timeout=10)
    assert not taker.is_alive(), "close() did not wake the blocked take()"
    assert got == [None]


def test_capacity_rule_eta0_grants_one_batch_per_version():
    table = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=0)
    assert len(table.grant("a", "i0", 10, version=0)) == 4
    assert table.grant("a", "i0", 10, version=0) == []
    got = table.grant("b", "i0", 10, version=1)
    assert len(got) == 4 and all(r.min_version == 1 for r in got)
    assert [r.prompt.prompt_id for r in got] == [4, 5, 6, 7]


def test_no_lease_is_granted_for_a_step_past_max_steps():
    """The last version's announcement used to admit a batch for a step that never came."""
    drops = Drops()
    table = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=2, drops=drops,
                       max_steps=2)
    assert len(table.grant("a", "i0", 100, version=0)) == 8  # steps 1 and 2, not 3
    assert table.grant("a", "i0", 100, version=2) == []
    drops.add(DropReason.STALE, 1)  # a dropped group is still replaced
    assert len(table.grant("a", "i0", 100, version=2)) == 1


def test_capacity_rule_eta2_and_drops_free_capacity():
    drops = Drops()
    table = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=2, drops=drops)
    buf = ReplayBuffer(capacity=16, max_staleness=2, drops=drops)
    assert len(table.grant("a", "i0", 100, version=0)) == 12
    assert table.grant("a", "i0", 100, version=0) == []
    # Two groups dropped stale in the buffer (the one shared tally) may be replaced.
    buf.put_many([make_group(i, version=0) for i in range(2)])
    assert buf.take(1, version=3, timeout=0) is None
    assert drops.counts() == {"stale": 2}
    assert len(table.grant("a", "i0", 100, version=0)) == 2


def test_expired_leases_are_regranted_and_accounted():
    table = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=0)
    recs = table.grant("dead", "i0", 3, version=0)
    assert table.expire_actor("dead") == 3
    again = table.grant("alive", "i0", 4, version=0)
    assert [r.prompt.prompt_id for r in again] == [0, 1, 2, 3]
    assert table.complete(recs[0].lease_id, "dead") is None  # late result of an expired lease
    c = table.counts()
    assert c["granted"] == 7 and c["dropped"] == {"expired": 3} and c["outstanding"] == 4


def test_lease_state_round_trip_keeps_outstanding_until_unclaimed():
    table = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=0)
    recs = table.grant("a", "i0", 4, version=0)
    table.complete(recs[0].lease_id, "a")
    fresh = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=0)
    fresh.load_state(table.state())
    assert fresh.cursor == 4 and sorted(fresh.outstanding) == [1, 2, 3]
    assert fresh.complete(2, "a") is not None  # the actor delivered after the restart
    assert fresh.complete(2, "a") is None  # ...once
    assert fresh.expire_unclaimed({"b"}, granted_before=float("inf")) == 2
    assert [r.prompt.prompt_id for r in fresh.grant("b", "i0", 3, 0)] == [1, 3]


def test_reconnect_keeps_the_leases_held_restart_expires_them():
    table = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=0)
    a, b, c = table.grant("a", "first", 3, version=0)
    assert table.expire_actor("a", "first", held={a.lease_id, b.lease_id, c.lease_id}) == 0
    assert table.expire_actor("a", "first", held={a.lease_id, b.lease_id}) == 1  # c: not held
    assert table.expire_actor("a", "second", held={a.lease_id}) == 2  # a new process holds none
    assert list(table.retry) == [c.prompt.prompt_id, a.prompt.prompt_id, b.prompt.prompt_id]


def test_resume_voids_the_lease_ids_granted_after_the_checkpoint():
    """The run that died granted leases after its checkpoint; the resumed run's ids start a
    random multiple of RESUME_GAP above, so a late result of such a lease is void, never a new
    lease's (nor one of another run resumed from the same checkpoint)."""
    from learner.leases import RESUME_GAP

    table = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=2)
    before = table.grant("a", "i0", 2, version=0)
    checkpoint = table.state()
    after = table.grant("a", "i0", 2, version=0)  # lost with the run that died
    resumed = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=2)
    resumed.load_state(checkpoint)
    assert resumed.void.start == 2 and [r.lease_id for r in before] == [0, 1]
    new = resumed.grant("a", "i0", 2, version=0)
    first = new[0].lease_id
    assert first >= 2 + RESUME_GAP and (first - 2) % RESUME_GAP == 0 and new[1].lease_id == first + 1
    twin = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=2)
    twin.load_state(checkpoint)  # a second run resumed from the same checkpoint: its own ids
    assert twin.grant("a", "i0", 1, version=0)[0].lease_id != first
    assert resumed.held_by("a") == [0, 1, first, first + 1]
    assert [r.prompt.prompt_id for r in new] == [r.prompt.prompt_id for r in after]  # again
    for r in after:
        assert resumed.is_void(r.lease_id) and resumed.complete(r.lease_id, "a") is None
    assert not any(resumed.is_void(r.lease_id) for r in (*before, *new))
    assert resumed.complete(before[0].lease_id, "a") is not None  # restored: still deliverable


def test_reuse_serves_a_group_max_reuse_times_then_consumes_it():
    buf = ReplayBuffer(capacity=8, max_staleness=3, max_reuse=2)
    for i in range(2):
        buf.put(make_group(i, 0))
    first = buf.take(2, version=0, timeout=1)
    second = buf.take(2, version=1, timeout=1)
    assert [g.lease_id for g in first] == [g.lease_id for g in second] == [0, 1]
    assert [g.uses for g in second] == [2, 2]
    c = buf.counts()
    assert c["consumed"] == 2 and c["served"] == 4 and c["size"] == 0 and c["dropped"] == {}


def test_reused_group_going_stale_counts_as_consumed_not_dropped():
    buf = ReplayBuffer(capacity=8, max_staleness=1, max_reuse=5)
    buf.put(make_group(0, 0))
    buf.take(1, version=0, timeout=1)
    assert buf.take(1, version=2, timeout=0.05) is None  # too stale now: leaves the buffer
    assert buf.counts()["consumed"] == 1 and buf.counts()["dropped"] == {}


def test_sampling_newest_and_uniform():
    newest = ReplayBuffer(capacity=8, max_staleness=9, sampling="newest")
    uniform = ReplayBuffer(capacity=8, max_staleness=9, sampling="uniform", seed=3)
    for i in range(6):
        newest.put(make_group(i, 0))
        uniform.put(make_group(i, 0))
    assert [g.lease_id for g in newest.take(2, 0, 1)] == [4, 5]
    picked = [g.lease_id for g in uniform.take(3, 0, 1)]
    assert len(set(picked)) == 3 and picked != [0, 1, 2]
    again = ReplayBuffer(capacity=8, max_staleness=9, sampling="uniform", seed=3)
    for i in range(6):
        again.put(make_group(i, 0))
    assert [g.lease_id for g in again.take(3, 0, 1)] == picked  # seeded


def test_closed_leases_are_remembered_for_duplicate_detection():
    table = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=0)
    a, b = table.grant("a", "i0", 2, version=0)
    assert table.complete(a.lease_id, "a") is a
    from buffer.accounting import DropReason

    table.drop(b, DropReason.INVALID)
    assert table.complete(a.lease_id, "a") is None and table.is_closed(a.lease_id)
    assert table.is_closed(b.lease_id) and not table.is_closed(99)
    c = table.grant("a", "i0", 1, version=0)[0]
    assert not table.is_closed(c.lease_id)  # outstanding, not closed
    restored = LeaseTable(FakeTask(), prompts_per_step=4, group_size=2, max_staleness=0)
    restored.load_state(table.state())
    assert restored.is_closed(a.lease_id) and not restored.is_closed(c.lease_id)
