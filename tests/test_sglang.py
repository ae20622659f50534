"""The SGLang engine for real, on CPU: logprobs, weight updates, in-flight updates, actor processes.

Runs in the SGLang lane of ./test.sh (its own venv, .venv-sglang, with the CPU `sgl_kernel` shim
of tests/sglang_cpu_shim on the path); skipped where SGLang is not installed. One engine is
started per module and reused; its update_mode is switched per test. The engine checks shared
with vLLM's are in tests/engine_refs.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang", reason="SGLang is tested in its own lane (scripts/env_sglang.sh)")

import engine_refs as refs  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from actors.engines.sglang.engine import SGLangEngine

    with refs.started_engine(lambda: SGLangEngine(tiny_model_dir, "keep", 0, 8192, 0.0)) as eng:
        yield eng


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_learner_then_after_update(engine, tiny_model_dir, temperature):
    refs.check_logprobs_then_after_update(engine, tiny_model_dir, temperature)


def test_update_changes_logprobs_to_new_version(engine, tiny_model_dir):
    """The same seeded request before and after an update: different weights, different
    logprobs, and each matches its own version's weights."""
    prompts = refs.prompts(tiny_model_dir, 4)
    a, b = refs.noisy_state(tiny_model_dir, 0.3, seed=5), refs.noisy_state(tiny_model_dir, 0.3, seed=6)
    outs = {}
    for v, state in ((30, a), (31, b)):
        refs.load(engine, state, v)
        outs[v] = refs.generate(engine, prompts, 5, 1.0)
        model = refs.hf_model(tiny_model_dir, state)
        for p, c in zip(prompts, outs[v]):
            assert (c.versions == v).all()
            assert np.abs(refs.reference(model, p, c.token_ids, 1.0) - c.logprobs).max() < 1e-3
    model_a = refs.hf_model(tiny_model_dir, a)
    p, c = prompts[0], outs[31][0]
    assert np.abs(refs.reference(model_a, p, c.token_ids, 1.0) - c.logprobs).max() > 1e-2


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_inflight_update_versions_and_logprobs(engine, tiny_model_dir, mode):
    refs.check_inflight_update(engine, tiny_model_dir, mode)


def test_streamed_load_holds_requests_and_a_broken_stream_keeps_the_engine_closed(
        engine, tiny_model_dir):
    refs.check_streamed_load(engine, tiny_model_dir)


def test_versions_arrive_by_the_learners_broadcast_over_gloo(engine, tiny_model_dir):
    """transport.weights_via=nccl's SGLang path, run on CPU with gloo: the learner's
    broadcaster (transport/weightsrc/nccl.py) sends two versions over one group into the
    running engine (update_weights_from_distributed); its logprobs then match each version."""
    import torch

    from transport.weights import pack
    from transport.weightsrc.nccl import NcclBroadcaster, broadcast_manifest

    sender = NcclBroadcaster("127.0.0.1", 1, torch.device("cpu"), "torch")
    assert sender.plan(1).backend == "gloo"
    ps = refs.prompts(tiny_model_dir, 4)
    for v, seed in ((50, 8), (51, 9)):
        state = refs.noisy_state(tiny_model_dir, 0.3, seed=seed)
        packed = pack(state, v, 64 * 1024)
        sender.broadcast(packed)
        engine.loop.run_until_complete(
            engine.receive_broadcast(broadcast_manifest(packed.manifest), sender.plan(1)))
        model = refs.hf_model(tiny_model_dir, state)
        for p, c in zip(ps, refs.generate(engine, ps, 5, 1.0)):
            assert (c.versions == v).all()
            assert np.abs(refs.reference(model, p, c.token_ids, 1.0) - c.logprobs).max() < 1e-3


def test_filesystem_weights_load_from_disk(engine, tiny_model_dir, tmp_path):
    """transport.weights_via=filesystem: the version file the learner writes loads with
    update_weights_from_disk and the logprobs are that version's."""
    from transport.weights import write_file

    engine.update_mode = "keep"
    state = refs.noisy_state(tiny_model_dir, 0.2, seed=7)
    packed = write_file(state, 40, tmp_path / "weights", keep=3)
    engine.loop.run_until_complete(engine.load_file(packed.manifest.path, 40))
    prompts = refs.prompts(tiny_model_dir, 8)
    model = refs.hf_model(tiny_model_dir, state)
    for p, c in zip(prompts, refs.generate(engine, prompts, 5, 0.7)):
        assert (c.versions == 40).all()
        assert np.abs(refs.reference(model, p, c.token_ids, 0.7) - c.logprobs).max() < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_sglang_actor_processes_and_a_vllm_actor_learn_the_toy_task(tmp_path, tiny_model_dir):
    """One run covers two claims: two SGLang actor processes (spawned by the learner from
    configs/toy_reverse_sglang.yaml, update_mode keep) learn the toy task, and a vLLM actor
    from the main venv (torch 2.13.0, beside this venv's torch 2.14.1) joins the same learner
    as a mixed fleet. Every actor keeps taking new versions and contributes groups."""
    import procs

    main_python = procs.ROOT / ".venv" / "bin" / "python"
    main_python = os.environ.get("TETHER_MAIN_PYTHON", str(main_python))
    assert Path(main_python).exists(), f"the main venv's python {main_python} (./test.sh makes it)"
    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "learner.checkpoint_every=0", procs.UNTIL_LEARNED,
                       preset=procs.ROOT / "configs" / "toy_reverse_sglang.yaml")
    lp.wait_for("learner listening", timeout=300)
    ap = procs.actor(run, "vllm-0", "actors.engine=vllm", "actors.engine.kv_cache_gb=0.25",
                     python=main_python)
    try:
        lp.wait_for(r"actor vllm-0 joined \(engine 'vllm'\)", timeout=300)
        s = procs.finish_clean(lp, run, 500, timeout=1700)
        assert ap.finish(timeout=120) == 0, ap.tail()
    finally:
        ap.kill()
    print(f"2 SGLang + 1 vLLM actors: held-out reward {s['eval_reward_start']:.3f} -> "
          f"{s['eval_reward_end']:.3f} in {s['steps']} steps ({s['end_reason']}), "
          f"{s['wall_seconds']:.0f} s")
    assert s["eval_reward_end"] >= 0.8, (s, procs.learning_curve(run))
    sglang_logs = [p.read_text() for p in sorted((run / "logs").glob("actor-*.log"))]
    assert len(sglang_logs) == 2, sglang_logs
    vllm_log = "".join(ap.lines)
    for text in sglang_logs:  # both SGLang actors ran SGLang and kept taking new versions
        assert "SGLangEngine" in text, text[-2000:]
        assert text.count("loaded weights v") >= 50, text[-3000:]
    assert "vllm" in vllm_log.lower() and vllm_log.count("loaded weights v") >= 20, vllm_log[-2000:]
    done = [int(re.search(r"done: (\d+) groups generated", text).group(1))
            for text in (*sglang_logs, vllm_log)]
    assert min(done) >= 20, done  # every actor, of both engines, really contributed


def test_an_sglang_actor_trains_on_versions_broadcast_by_the_learner(tmp_path, tiny_model_dir):
    """transport.weights_via=nccl end to end on CPU: the learner (gloo, its CPU device)
    parks the SGLang actor's requests, offers each version with its NcclPlan and broadcasts
    it; the actor receives every version it trains on that way, none over ZeroMQ."""
    import procs

    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "learner.checkpoint_every=0", "learner.max_steps=4",
                       "actors.num_local=1", "transport.weights_via=nccl",
                       "transport.nccl_engines=1", "task.eval_prompts=0",
                       preset=procs.ROOT / "configs" / "toy_reverse_sglang.yaml")
    procs.finish_clean(lp, run, 4, timeout=600)
    text = (run / "logs" / "actor-0.log").read_text()
    broadcast = re.findall(r"loaded weights v(\d+) \(full, by gloo broadcast\)", text)
    assert len(broadcast) >= 2 and "0" in broadcast, text[-3000:]
    assert not re.search(r"loaded weights v\d+ \(full, [\d.]+ MB", text), text[-3000:]
    assert "broadcast v0 to 1 engine(s)" in lp.tail(200000), lp.tail()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkilled_sglang_actor_leaves_no_engine_processes(tmp_path, tmp_path_factory,
                                                           tiny_model_dir):
    """SGLang's scheduler and detokenizer are children of the actor; a SIGKILLed actor cannot
    shut them down, and they must not outlive it. Nor can it remove SGLang's ipc socket files:
    they are in the actor's scratch directory, which its keeper removes (actors/scratch.py).
    (TMPDIR is not under tmp_path: socket paths beneath it must stay within 107 bytes.)"""
    import signal

    import procs

    run, tmpdir = tmp_path / "run", tmp_path_factory.mktemp("tmp")
    lp = procs.learner(run, tiny_model_dir, "actors.num_local=0", "learner.max_steps=100000",
                       preset=procs.ROOT / "configs" / "toy_reverse_sglang.yaml")
    lp.wait_for("learner listening", timeout=120)
    ap = procs.actor(run, "s0", env={"TMPDIR": str(tmpdir)})
    try:
        ap.wait_for(r"loaded weights v\d+", timeout=600)
        names, alive = procs.end_actor(ap, signal.SIGKILL)
        assert not alive, f"still running after the actor was killed: {alive}"
        assert sorted(p.name for p in tmpdir.iterdir()) == [], "left in the actor's temp dir"
        assert {"sglang::scheduler", "sglang::detokenizer", "keeper"} <= set(names), names
    finally:
        ap.kill()
        lp.p.send_signal(signal.SIGTERM)
        assert lp.finish(timeout=120) == 0, lp.tail()
