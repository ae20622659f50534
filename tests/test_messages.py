import msgspec
import numpy as np
import pytest

from transport import messages as m


def _group(n=3):
    return m.pack_group(lease_id=4, actor_id="a", prompt_id=9,
                        samples=[m.Sample(sample_index=0, reward=0.5)],
                        tokens=[dict(completion_ids=np.arange(n, dtype=np.int32),
                                     logprobs=-np.ones(n, dtype=np.float32),
                                     versions=np.zeros(n, dtype=np.int32),
                                     loss_mask=np.ones(n, dtype=np.uint8))])


@pytest.mark.parametrize("msg", [
    m.Hello(protocol_version=m.PROTOCOL_VERSION, actor_id="a", engine="hf"),
    m.WorkRequest(actor_id="a", max_groups=2),
    m.Heartbeat(actor_id="a", weight_version=3),
    m.Goodbye(actor_id="a"),
])
def test_actor_to_learner_round_trip(msg):
    dec = m.Decoders()
    assert dec.from_actor.decode(m.encoder().encode(msg)) == msg


@pytest.mark.parametrize("msg", [
    m.Reject(reason="no"),
    m.HeartbeatAck(latest_version=7),
    m.VersionAnnounce(version=8),
    m.Shutdown(reason="done"),
    m.LeaseGrant(leases=[m.Lease(lease_id=1, prompt_id=2,
                                 prompt_ids=m.Array.from_numpy(np.array([1, 4, 5], np.int32)),
                                 num_samples=8, min_version=3, seed=0, max_new_tokens=6,
                                 temperature=1.0, meta={"target": "21"})], latest_version=3),
    m.Welcome(protocol_version=1, actor_id="a", trajectory_endpoint="tcp://x:1",
              weights_endpoint="tcp://x:2", latest_version=0, heartbeat_s=1.0, peer_timeout_s=5.0,
              model_files={"config.json": b"{}"}, run_id="r"),
])
def test_learner_to_actor_round_trip(msg):
    assert m.Decoders().to_actor.decode(m.encoder().encode(msg)) == msg


def test_trajectory_round_trip_keeps_arrays_exact():
    msg = _group(5)
    back = m.Decoders().trajectory.decode(m.encoder().encode(msg))
    assert back == msg and back.samples[0].num_tokens == 5
    np.testing.assert_array_equal(back.completion_ids.to_numpy(), np.arange(5))
    assert back.logprobs.to_numpy().dtype == np.float32


def test_arrays_travel_as_raw_bytes():
    a = m.Array.from_numpy(np.arange(1000, dtype=np.float32))
    assert len(m.encoder().encode(a)) < 4000 + 64  # 4 bytes per value, not a list of floats


@pytest.mark.parametrize("payload", [b"", b"\x00\x01garbage", b"\xc1", np.random.default_rng(0).bytes(64)])
def test_malformed_bytes_are_rejected_with_an_error(payload):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        m.Decoders().from_actor.decode(payload)


def test_wrong_type_and_unknown_tag_are_rejected():
    enc = m.encoder()
    with pytest.raises(msgspec.ValidationError, match="actor_id"):
        m.Decoders().from_actor.decode(enc.encode({"type": "hello", "protocol_version": 1,
                                                   "actor_id": 5, "engine": "hf"}))
    with pytest.raises(msgspec.ValidationError):
        m.Decoders().from_actor.decode(enc.encode({"type": "pickle_me", "x": 1}))
    # A learner->actor type is not accepted on the actor->learner channel.
    with pytest.raises(msgspec.ValidationError):
        m.Decoders().from_actor.decode(enc.encode(m.Shutdown(reason="x")))


def test_array_with_inconsistent_shape_or_dtype_is_rejected():
    with pytest.raises(ValueError, match="needs 12 bytes"):
        m.Array(dtype="float32", shape=(3,), data=b"\x00" * 8).to_numpy()
    with pytest.raises(ValueError, match="dtype"):
        m.Array(dtype="object", shape=(1,), data=b"\x00" * 8).to_numpy()
    with pytest.raises(ValueError, match="negative"):
        m.Array(dtype="int32", shape=(-1,), data=b"").to_numpy()
