"""The HF engine: seeded, batch-independent sampling and behavior logprobs that match the learner."""

import numpy as np
import pytest
import torch

from actors.engines.base import GenerateRequest, sample_seed
from actors.engines.hf import HFEngine
from learner.backends.single import SingleProcessBackend
from learner.algo.batch import collate
from models.logprobs import token_logprobs
from transport.weights import pack, unpack

from buffer.record import TrajGroup


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from safetensors.torch import load_file

    e = HFEngine(tiny_model_dir)
    e.load_weights(load_file(str(tiny_model_dir / "model.safetensors")), version=0)
    return e


def _req(prompt, i, mnt=6):
    return GenerateRequest(np.asarray(prompt, dtype=np.int32), mnt, 1.0, sample_seed(0, 7, i))


PROMPT = [1, 4, 7, 8, 9, 6, 5]
OTHER = [1, 4, 10, 11, 12, 13, 5]


def test_samples_do_not_depend_on_batch_composition(engine):
    alone = engine.generate([_req(PROMPT, 3)])[0]
    crowd = engine.generate([_req(OTHER, i) for i in range(5)] + [_req(PROMPT, 3)]
                            + [_req(PROMPT, i) for i in range(4)])[5]
    np.testing.assert_array_equal(alone.token_ids, crowd.token_ids)
    np.testing.assert_array_equal(alone.logprobs, crowd.logprobs)  # bitwise
    assert alone.versions.tolist() == [0] * len(alone.token_ids)


def test_seeds_vary_by_sample_and_version(tiny_model_dir):
    """Same weights under another version number: the same requests sample differently (the
    version is mixed into the seed), and each version reproduces itself exactly."""
    from safetensors.torch import load_file

    state = load_file(str(tiny_model_dir / "model.safetensors"))
    e = HFEngine(tiny_model_dir)
    e.load_weights(state, version=0)
    reqs = [_req(PROMPT, i) for i in range(16)]
    outs = e.generate(reqs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # sample index changes the sample
    again = e.generate(reqs)
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(outs, again))
    e.load_weights(state, version=1)
    v1 = e.generate(reqs)
    assert all(o.versions.tolist() == [1] * len(o.token_ids) for o in v1)
    changed = sum(not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(outs, v1))
    assert changed >= 8, f"only {changed}/16 samples changed with the version"
    e.load_weights(state, version=0)
    back = e.generate(reqs)
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(outs, back))


def test_behavior_logprobs_match_learner_recompute(engine, tiny_model_dir):
    backend = SingleProcessBackend(tiny_model_dir, lr=1e-3, weight_decay=0.0, seed=0)
    outs = engine.generate([_req(PROMPT, i) for i in range(8)])
    g = TrajGroup.build(lease_id=0, prompt_id=0, actor_id="engine", prompt_ids=PROMPT,
                        rewards=np.zeros(8), completions=[o.token_ids for o in outs],
                        logprobs=[o.logprobs for o in outs], versions=[o.versions for o in outs],
                        loss_masks=[np.ones(len(o.token_ids)) for o in outs])
    tb = collate([g], pad_id=0)
    with torch.no_grad():
        learner_lp = backend.logprobs(tb.input_ids, 1.0)
    diff = ((learner_lp - tb.behavior) * tb.mask).abs().max().item()
    assert diff < 1e-5


def test_weight_update_changes_logprobs_to_the_new_weights(engine, tiny_model_dir):
    backend = SingleProcessBackend(tiny_model_dir, lr=1e-3, weight_decay=0.0, seed=0)
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    packed = pack(backend.state_dict(), version=1, bucket_bytes=64 * 1024)  # several buckets
    assert packed.manifest.num_buckets > 3
    fresh = HFEngine(tiny_model_dir)
    fresh.load_weights(unpack(packed.manifest, list(packed.buckets)), version=1)
    out = fresh.generate([_req(PROMPT, 0)])[0]
    assert out.versions.tolist() == [1] * len(out.token_ids)
    ids = torch.tensor([PROMPT + out.token_ids.tolist()])
    with torch.no_grad():
        ref = token_logprobs(backend.model, ids, 1.0)[0, len(PROMPT) - 1:]
    np.testing.assert_allclose(out.logprobs, ref.numpy(), atol=1e-5)


def test_unpack_rejects_a_manifest_that_does_not_fit(tiny_model_dir):
    from safetensors.torch import load_file

    packed = pack(load_file(str(tiny_model_dir / "model.safetensors")), 0, 1 << 20)
    with pytest.raises(ValueError, match="buckets"):
        unpack(packed.manifest, [])
    short = [b[:-4] for b in packed.buckets]
    with pytest.raises(ValueError, match="overruns"):
        unpack(packed.manifest, short)


def test_unpack_gives_every_tensor_back_from_one_copy_per_bucket():
    """Mixed dtypes and an empty tensor come back equal. pack aligns every tensor to 16 bytes,
    so every tensor is a view: those of a read-only bucket share one copy of it (not one per
    tensor); a writable bucket is used in place. A float32 tensor at an offset that is not a
    multiple of 4 (a manifest not made by pack) gets a copy of its own."""
    import msgspec

    state = {"h": torch.arange(3, dtype=torch.bfloat16), "f": torch.linspace(0, 1, 5),
             "b": torch.ones(1, dtype=torch.bfloat16), "e": torch.zeros(0, 4),
             "g": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    packed = pack(state, 0, 1 << 20)
    offsets = [m.offset for m in packed.manifest.tensors]
    assert packed.manifest.num_buckets == 1 and offsets == [0, 16, 48, 64, 64]
    for buckets in (list(packed.buckets), [bytes(b) for b in packed.buckets]):
        out = unpack(packed.manifest, buckets)
        assert list(out) == list(state)
        for name, t in state.items():
            assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
        base = out["h"].data_ptr()  # the bucket's copy (or the writable bucket itself)
        assert out["g"].data_ptr() == base + 64 and out["f"].data_ptr() == base + 16
    out = unpack(packed.manifest, list(packed.buckets))  # bytearrays: writable
    out["g"][0, 0] = 7.0  # the writable bucket was not copied: its bytes changed too
    assert torch.frombuffer(packed.buckets[0][64:68], dtype=torch.float32).item() == 7.0
    raw = bytearray(packed.buckets[0])
    raw[6:26] = raw[16:36]  # f moved to offset 6: misaligned for float32
    f = msgspec.structs.replace(packed.manifest.tensors[1], offset=6)
    moved = msgspec.structs.replace(packed.manifest, tensors=[packed.manifest.tensors[0], f])
    out = unpack(moved, [bytes(raw)])
    assert torch.equal(out["f"], state["f"]) and out["f"].data_ptr() != out["h"].data_ptr() + 6


def test_kv_cache_sampling_draws_from_the_full_context_distribution(engine):
    """Each token must be sampled given the whole prefix: replay every row with the same
    generator but a full forward pass per token (no cache) and get the same tokens."""
    from actors.engines.base import versioned_seed

    reqs = [_req(PROMPT if i % 2 else OTHER, i, mnt=6) for i in range(16)]
    outs = engine.generate(reqs)
    same = 0
    with torch.no_grad():
        for r, c in zip(reqs, outs):
            g = torch.Generator().manual_seed(versioned_seed(r.seed, engine.version))
            ids = torch.tensor([list(r.prompt_ids)], dtype=torch.long)
            for _ in range(len(c.token_ids)):
                logits = engine.model(input_ids=ids, use_cache=False).logits[0, -1]
                nxt = torch.multinomial(torch.softmax(logits.float() / r.temperature, -1), 1,
                                        generator=g)
                ids = torch.cat([ids, nxt[None]], dim=1)
            same += ids[0, len(r.prompt_ids):].tolist() == c.token_ids.tolist()
    assert same >= 15, f"only {same}/16 samples match full-context sampling"


def test_sampling_logprobs_skip_the_extra_pass_and_agree_to_rounding(engine, tiny_model_dir):
    """actors.engine.logprobs=sampling: the same samples; logprobs read off the sampling steps agree
    with the full forward's (the default) to float rounding, but are not bitwise the same pass."""
    from safetensors.torch import load_file

    fast = HFEngine(tiny_model_dir, logprobs="sampling")
    fast.load_weights(load_file(str(tiny_model_dir / "model.safetensors")), version=0)
    reqs = [_req(PROMPT, i) for i in range(8)] + [_req(OTHER, i) for i in range(8)]
    calls = []
    hook = fast.model.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    got = fast.generate(reqs)
    hook.remove()
    want = engine.generate(reqs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    # one bucket (equal prompt lengths): the prompt, then one token a call; the default adds a
    # pass over prompt + max_new_tokens
    assert calls[0] == len(PROMPT) and set(calls[1:]) == {1} and len(calls) <= 6, calls


def test_borrowed_weights_are_the_buckets_themselves_and_sample_as_a_copy_does(tiny_model_dir):
    """The learner's evaluation engine borrows the published buckets (no copy of the model):
    the same samples and logprobs as loaded weights; released, it holds no storage at all."""
    backend = SingleProcessBackend(tiny_model_dir, lr=1e-3, weight_decay=0.0, seed=0)
    with torch.no_grad():
        for p in backend.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    packed = pack(backend.state_dict(), version=3, bucket_bytes=64 * 1024)
    loaded = HFEngine(tiny_model_dir)
    loaded.load_packed(packed.manifest, list(packed.buckets))
    borrowed = HFEngine(tiny_model_dir)
    borrowed.release_weights()
    assert all(p.is_meta for p in borrowed.model.parameters())
    borrowed.borrow_packed(packed.manifest, list(packed.buckets))
    spans = [(a, a + len(b)) for b in packed.buckets
             for a in [np.frombuffer(b, np.uint8).ctypes.data]]
    for p in borrowed.model.parameters():  # every parameter lies inside a published bucket
        assert any(a <= p.data_ptr() < b for a, b in spans)
    a, b = loaded.generate([_req(PROMPT, 1)])[0], borrowed.generate([_req(PROMPT, 1)])[0]
    assert a.versions.tolist() == b.versions.tolist() == [3] * len(a.token_ids)
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    borrowed.release_weights()
    assert all(p.is_meta for p in borrowed.model.parameters())
