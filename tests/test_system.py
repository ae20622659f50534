"""Learner and actors end to end: as separate processes over real ZeroMQ sockets on loopback
(faults, fuzzing, restarts), or in one process (transport.kind=inproc) where a test checks
protocol, accounting and learning rather than sockets."""

from __future__ import annotations

import json
import re
import signal
import time

import numpy as np
import pytest
import zmq

import procs
from transport import messages as m


def _check_accounting(s: dict) -> None:
    g = s["groups"]
    assert s["accounting_ok"]
    assert g["granted"] == g["consumed"] + sum(g["dropped"].values()) + g["outstanding"] + g["in_buffer"]


def test_learner_with_two_local_actors_trains_and_accounts(tmp_path, tiny_model_dir):
    """Protocol and accounting with two actors, in one process (transport.kind=inproc)."""
    run = tmp_path / "run"
    s, logs = procs.run_inproc(run, tiny_model_dir, "learner.max_steps=8", "learner.log_every=1",
                               "max_staleness=1")
    assert s["steps"] == 8 and procs.summary(run) == s
    _check_accounting(s)
    assert s["groups"]["consumed"] == 8 * 16
    assert s["rejected_messages"] == {}  # every trajectory used weights >= its lease's min_version
    rows = procs.metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["staleness_max"] <= 1 for r in rows)
    assert any(r["staleness_max"] == 1 for r in rows)  # the actors really ran ahead
    # Both actors took part, and each loaded a run of successive versions.
    for name in ("actor-local-0", "actor-local-1"):
        text = "\n".join(logs.lines.get(name, []))
        versions = [int(v) for v in re.findall(r"loaded weights v(\d+)", text)]
        assert versions and versions == sorted(versions) and versions[-1] >= 6, text[-2000:]
        assert "groups generated" in text
    assert (run / "final_model" / "model.safetensors").exists()
    assert (run / "config.yaml").exists() and (run / "endpoints.json").exists()


def test_max_train_minutes_ends_the_run_at_its_wall_time(tmp_path, tiny_model_dir):
    """learner.max_train_minutes: the run ends on time, far short of max_steps, then evaluates
    and writes its summary as a finished run would, with its accounting balanced."""
    run = tmp_path / "run"
    s, _ = procs.run_inproc(run, tiny_model_dir, "learner.max_steps=100000",
                            "learner.max_train_minutes=0.1")
    assert s["end_reason"] == "time_limit"
    assert 1 <= s["steps"] < 100000
    assert [r["step"] for r in procs.metrics(run)] == list(range(1, s["steps"] + 1))
    assert (run / "final_model" / "config.json").exists() and "eval_reward_end" in s
    _check_accounting(s)


def test_stop_at_reward_ends_the_run_at_the_first_step_its_window_reaches(tmp_path,
                                                                           tiny_model_dir):
    """learner.stop_at_reward: the run ends at the first step whose last stop_reward_window
    sampled-reward means average to the target (not before, not after), then evaluates and
    writes its summary as a finished run would."""
    run, window, target = tmp_path / "run", 5, 0.45
    s, _ = procs.run_inproc(run, tiny_model_dir, "learner.max_steps=400",
                            f"learner.stop_at_reward={target}",
                            f"learner.stop_reward_window={window}")
    rewards = [r["reward_mean"] for r in procs.metrics(run)]
    reached = [i + 1 for i in range(window - 1, len(rewards))
               if sum(rewards[i + 1 - window:i + 1]) / window >= target]
    assert s["end_reason"] == "reward_reached", (s["steps"], rewards)
    assert reached == [s["steps"]] == [len(rewards)], (reached, rewards)
    assert (run / "final_model" / "config.json").exists() and "eval_reward_end" in s
    _check_accounting(s)


def test_an_actor_pointed_at_a_service_that_is_not_tether_says_so_and_exits(tmp_path):
    """Whatever answers at the learner's address speaks something else (here a ROUTER that
    answers the actor's Hello with a well-formed message of an unknown type, as another
    ZeroMQ service on a reused port might): the actor exits 3 naming the address, instead of
    ending in a decoder traceback."""
    import msgspec

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ap = procs.Proc(["-m", "actors", "-c", str(procs.PRESET), "--actor-id", "lost",
                     f"run_dir={tmp_path / 'run'}", f"tcp://127.0.0.1:{port}"],
                    tmp_path / "actor.log")
    try:
        assert router.poll(120_000), ap.tail()  # the actor's Hello
        identity, _hello = router.recv_multipart()
        router.send_multipart([identity, msgspec.msgpack.encode({"type": "hello", "id": 1})])
        assert ap.finish(timeout=60) == 3, ap.tail()
    finally:
        ap.kill()
        router.close()
        ctx.term()
    assert f"actor lost cannot join: tcp://127.0.0.1:{port} answered with something that is " \
           "not a Tether learner's message" in "".join(ap.lines), ap.tail()


def test_weights_through_a_shared_directory(tmp_path, tiny_model_dir):
    """transport.weights_via=filesystem: actors read each version's safetensors file; the
    socket carries only the notice, and old files are pruned to max_staleness + 3."""
    run, shared = tmp_path / "run", tmp_path / "shared"
    s, logs = procs.run_inproc(run, tiny_model_dir, "learner.max_steps=8", "max_staleness=1",
                               "transport.weights_via=filesystem", f"transport.weights_dir={shared}")
    assert s["steps"] == 8 and s["rejected_messages"] == {}
    _check_accounting(s)
    files = sorted(p.name for p in shared.glob("v*.safetensors"))
    assert files == [f"v{v:08d}.safetensors" for v in range(5, 9)], files
    for name in ("actor-local-0", "actor-local-1"):
        loaded = re.findall(r"loaded weights v(\d+) \(full\) from (\S+)", "\n".join(logs.lines[name]))
        assert loaded and all(path.startswith(str(shared)) for _, path in loaded), loaded


def test_separate_actor_killed_and_restarted_rejoins(tmp_path, tiny_model_dir):
    """Learner and actor started as separate commands; SIGKILL the actor, start it again."""
    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "actors.num_local=0", "learner.max_steps=12",
                       "learner.log_every=1", "transport.heartbeat_s=0.25",
                       "transport.peer_timeout_s=2", "max_staleness=1")
    a = a2 = None
    try:
        lp.wait_for(r"learner listening", timeout=120)
        a = procs.actor(run, "node-b")
        lp.wait_for(r"step 4/12", timeout=360)
        a.kill()  # SIGKILL mid-run: the learner must notice, expire its leases, and wait
        lp.wait_for(r"actor node-b silent .* declared dead", timeout=60)
        lp.wait_for(r"waiting for trajectories: .* actors connected 0", timeout=60)
        a2 = procs.actor(run, "node-b")
        got = int(a2.wait_for(r"loaded weights v(\d+)", timeout=240).group(1))
        assert got >= 4  # the restarted actor starts from the current version, not v0
        assert lp.finish(timeout=300) == 0, lp.tail()
        assert a2.finish(timeout=60) == 0
    finally:
        for p in (a, a2, lp):
            if p is not None:
                p.kill()
    s = procs.summary(run)
    assert s["steps"] == 12
    _check_accounting(s)
    assert s["groups"]["dropped"].get("expired", 0) >= 1
    assert "groups generated" in a2.tail()


def _fuzz_frames(rng: np.random.Generator, valid: list[bytes], n: int) -> list[bytes]:
    """Random bytes, and valid messages truncated, extended or with bytes flipped."""
    out = []
    for i in range(n):
        base = bytearray(valid[i % len(valid)])
        kind = i % 4
        if kind == 0:
            out.append(rng.bytes(int(rng.integers(0, 300))))
            continue
        if kind == 1:
            base = base[: int(rng.integers(0, len(base)))]
        elif kind == 2:
            base += rng.bytes(int(rng.integers(1, 50)))
        for _ in range(int(rng.integers(1, 4))):
            if base:
                base[int(rng.integers(0, len(base)))] = int(rng.integers(0, 256))
        out.append(bytes(base))
    return out


def test_fuzzed_frames_on_every_socket_are_counted_and_training_goes_on(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "learner.max_steps=15", "learner.log_every=1",
                       "transport.max_message_bytes=1000000", "transport.weight_bucket_bytes=500000")
    lp.wait_for(r"step 2/15", timeout=180)
    eps = procs.json.loads((run / "endpoints.json").read_text())
    enc = m.encoder()
    arr = m.Array.from_numpy(np.array([6, 7, 2], np.int32))
    valid = [enc.encode(x) for x in (
        m.Hello(protocol_version=m.PROTOCOL_VERSION, actor_id="fuzz", engine="hf"),
        m.WorkRequest(actor_id="fuzz", max_groups=2), m.Heartbeat(actor_id="fuzz", weight_version=0),
        m.WeightRequest(actor_id="fuzz", have_version=-1),
        m.GroupResult(lease_id=0, actor_id="fuzz", prompt_id=0,
                      samples=[m.Sample(sample_index=0, reward=1.0, num_tokens=3)],
                      completion_ids=arr, logprobs=arr, versions=arr, loss_mask=arr))]
    rng = np.random.default_rng(0)
    ctx = zmq.Context()
    socks = []
    per_socket = 10_000
    for kind, name in ((zmq.DEALER, "control"), (zmq.PUSH, "trajectory"), (zmq.DEALER, "weights")):
        s = ctx.socket(kind)
        s.setsockopt(zmq.SNDHWM, 0)
        s.connect(eps[name])
        socks.append(s)
        for frame in _fuzz_frames(rng, valid, per_socket):
            s.send(frame)
    big = ctx.socket(zmq.PUSH)
    big.connect(eps["trajectory"])
    big.send(b"\x00" * 2_000_000)  # over ZMQ_MAXMSGSIZE: zmq drops the connection, not the learner
    # a well-formed Hello with the wrong protocol version gets a clear rejection
    probe = ctx.socket(zmq.DEALER)
    probe.connect(eps["control"])
    probe.send(enc.encode(m.Hello(protocol_version=99, actor_id="old", engine="hf")))
    assert probe.poll(30_000)
    reply = m.Decoders().to_actor.decode(probe.recv())
    assert isinstance(reply, m.Reject)
    assert "v99" in reply.reason and f"v{m.PROTOCOL_VERSION}" in reply.reason
    assert lp.finish(timeout=300) == 0, lp.tail()
    for sock in (*socks, big, probe):
        sock.close(linger=0)
    ctx.term()
    s = procs.summary(run)
    assert s["steps"] == 15
    _check_accounting(s)
    rejected = sum(s["rejected_messages"].values())
    assert rejected >= 0.95 * 3 * per_socket, s["rejected_messages"]
    assert s["rejected_messages"]["protocol_version"] >= 1
    assert s["disconnects"].get("trajectory", 0) >= 1  # the oversized frame's connection
    # nothing from the fuzzer reached the buffer: everything received was a granted lease
    assert s["buffer"]["received"] == s["groups"]["consumed"] + s["groups"]["in_buffer"] + \
        s["groups"]["dropped"].get("stale", 0)


@pytest.mark.slow
def test_toy_task_learns_end_to_end(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    s, _ = procs.run_inproc(run, tiny_model_dir, "learner.checkpoint_every=0",
                            "learner.trace_steps=3", procs.UNTIL_LEARNED)
    print(f"toy, 2 HF actors: held-out {s['eval_reward_start']:.3f} -> {s['eval_reward_end']:.3f}"
          f" in {s['steps']} steps ({s['end_reason']}), {s['wall_seconds']:.0f} s")
    assert procs.trained(s, 500), s
    assert s["eval_reward_start"] <= 0.45
    assert s["eval_reward_end"] >= 0.6 and s["eval_reward_end"] > s["eval_reward_start"] + 0.3, (
        procs.learning_curve(run))
    _check_accounting(s)
    _check_timeline(run, actors=2, traced=range(6, 9))


def _check_timeline(run, actors: int, traced: range) -> None:
    """Every row's learner fractions sum to 1, the actors' work-loop fractions too once their
    spans arrive; trace.json holds the traced steps of the learner and of every actor."""
    from learner.obs.timeline import LEARNER_PHASES
    from transport.messages import ACTOR_STATES

    rows = procs.metrics(run)
    for r in rows:
        learner = [r[f"time_frac_{p}"] for p in LEARNER_PHASES] + [r["time_frac_other"]]
        assert min(learner) >= 0 and sum(learner) == pytest.approx(1.0), r
    with_actors = [r for r in rows if "actor_frac_generate" in r]
    assert len(with_actors) >= len(rows) - 20, len(with_actors)  # from the first heartbeats on
    for r in with_actors:
        assert sum(r[f"actor_frac_{s}"] for s in ACTOR_STATES) == pytest.approx(1.0), r
        assert r["actor_idle_ratio"] == pytest.approx(1.0 - r["actor_frac_generate"])
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    expected = ["learner"] + [f"actor local-{i}" for i in range(actors)]
    assert sorted(names.values()) == sorted(expected)
    spans = [e for e in events if e["ph"] == "X"]
    learner = [e for e in spans if e["pid"] == 0]
    assert sum(e["name"] == "backward_optimizer" for e in learner) == len(traced)
    lo, hi = json.loads((run / "trace.json").read_text())["otherData"]["window_us"]
    assert all(lo <= e["ts"] and e["ts"] + e["dur"] <= hi for e in learner)
    for pid in set(names) - {0}:
        mine = [e for e in spans if e["pid"] == pid]
        assert any(e["name"] == "generate" for e in mine), names[pid]
        assert all(lo <= e["ts"] <= hi for e in mine)  # spans that began in the traced steps


def test_checkpoint_then_resume_continues_the_run(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    first = procs.learner(run, tiny_model_dir, "learner.max_steps=4", "learner.checkpoint_every=2",
                          "learner.prompts_per_step=8")
    assert first.finish(timeout=240) == 0, first.tail()
    s1 = procs.summary(run)
    second = procs.learner(run, tiny_model_dir, "learner.max_steps=8", "learner.resume=true",
                           "learner.prompts_per_step=8")
    second.wait_for(r"resumed from .*step_4 at v4", timeout=120)
    assert second.finish(timeout=240) == 0, second.tail()
    s2 = procs.summary(run)
    assert s2["steps"] == 8
    _check_accounting(s2)
    assert s2["groups"]["granted"] > s1["groups"]["granted"]
    assert [r["step"] for r in procs.metrics(run)] == list(range(1, 9))  # appended, not restarted
    # what was in flight when the first run ended is accounted for, not lost silently
    assert s2["groups"]["consumed"] == 8 * 8
    # learner.checkpoint_keep=2: step_2 went once step_8 was complete
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_4", "step_8"]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_learner_stop_leaves_no_orphan_actors(tmp_path, tiny_model_dir, sig):
    """SIGTERM: checkpoint + clean stop. SIGKILL: local actors notice their parent is gone."""
    import os
    import signal

    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "learner.max_steps=100000", "learner.log_every=1",
                       "transport.heartbeat_s=0.2", "transport.peer_timeout_s=1")
    lp.wait_for(r"step 3/", timeout=180)
    actor_pids = [int(p) for p in os.popen(f"pgrep -P {lp.p.pid} -f 'actors'").read().split()]
    assert len(actor_pids) == 2
    lp.p.send_signal(getattr(signal, sig))
    lp.finish(timeout=120)
    for pid in actor_pids:  # each actor must exit by itself: wait on a pidfd (not our child)
        assert procs.wait_pid_exit(pid, timeout=60), f"actor {pid} still running after {sig}"
    if sig == "SIGTERM":
        s = procs.summary(run)
        assert s["end_reason"] == "interrupted"
        assert (run / "checkpoints" / f"step_{s['steps']}").exists()


GATED_REWARD = """
import os

GATE = {gate!r}


def reward(completion, completion_ids, label, metadata):
    # The first call (the learner's held-out evaluation, in start-up) meets the test at the
    # FIFO `ready`, then blocks on the FIFO `gate` until the test opens it; later calls score.
    if not os.path.exists(os.path.join(GATE, "first")):
        os.mkdir(os.path.join(GATE, "first"))
        open(os.path.join(GATE, "ready"), "w").close()
        open(os.path.join(GATE, "gate")).read()
    return sum(a == b for a, b in zip(completion.split(), label)) / 4
"""


def test_sigterm_during_start_up_stops_the_run_cleanly_before_its_first_step(tmp_path,
                                                                              tiny_model_dir):
    """A SIGTERM (Slurm's scancel, a supervisor) before the first step: no step runs, the run
    ends as an interrupted one (checkpoint, summary, exit 0) and its local actors exit. (It used
    to raise KeyboardInterrupt out of start-up: a traceback, exit -2, no summary.) The start
    evaluation, which the first step waits for (served by the actors since issue 40, so the
    learner's start-up itself no longer holds it), is held at a FIFO by the reward function, so
    the signal arrives before the first step every time; the final evaluation then completes
    once the gate opens."""
    import os

    import psutil

    gate = tmp_path / "gate"
    gate.mkdir()
    for fifo in ("ready", "gate"):
        os.mkfifo(gate / fifo)
    (tmp_path / "gated_reward.py").write_text(GATED_REWARD.format(gate=str(gate)))
    rng = np.random.default_rng(0)
    data = tmp_path / "rev.jsonl"
    data.write_text("".join(json.dumps({"prompt": "rev " + " ".join(n) + " =", "label": n[::-1]})
                            + "\n" for n in (str(k).zfill(4) for k in rng.choice(10_000, 100,
                                                                                  replace=False))))
    run = tmp_path / "run"
    lp = procs.learner(run, tiny_model_dir, "task.name=data", f"task.data_path={data}",
                       f"task.reward={tmp_path / 'gated_reward.py'}:reward",
                       "task.reward_timeout_s=300", "task.eval_prompts=8")
    try:
        with open(gate / "ready"):  # blocks until the evaluation's first reward call opens it
            pass
        # the learner says it waits for the evaluation every WAIT_LOG_S (5 s): the signal goes
        # once it has (sent at once, it came before the line on a quick machine, and the
        # assertion below failed); samples scored by the other reward workers may be in
        lp.wait_for(r"evaluation [0-7]/8 in before the first step", timeout=60)
        lp.p.send_signal(signal.SIGTERM)
        lp.wait_for("interrupted at v0", timeout=60)
        with open(gate / "gate", "w"):  # releases the evaluation
            pass
        assert lp.finish(timeout=300) == 0, lp.tail()
    finally:
        lp.kill()
        # a failed run leaves its reward worker waiting at the gate: open and close it, so the
        # worker reads EOF and ends (O_RDWR never blocks on a FIFO)
        os.close(os.open(gate / "gate", os.O_RDWR))
    out = "".join(lp.lines)
    assert "Traceback" not in out, lp.tail()
    assert "interrupted at v0" in out, lp.tail()
    assert re.search(r"evaluation [0-7]/8 in before the first step", out), lp.tail()  # waited
    s = procs.summary(run)
    assert s["end_reason"] == "interrupted" and s["steps"] == 0 and s["accounting_ok"], s
    assert (run / "checkpoints" / "step_0").exists()
    left = [q.pid for q in psutil.process_iter(["cmdline"])
            if any(str(run) in part for part in (q.info["cmdline"] or []))]
    assert all(procs.wait_pid_exit(pid, timeout=60) for pid in left), left


def test_resumed_learner_keeps_only_the_leases_an_actor_still_holds(tmp_path, tiny_model_dir):
    """After a restart from a checkpoint, an actor's Hello says which of the checkpoint's
    leases it still holds: the others (delivered to the run that died, or lost) expire and their
    prompts are granted again at once, under new lease ids; Welcome.leases_kept tells the actor
    which of its old leases are still wanted. (The resumed learner otherwise waited forever for leases
    no actor held: tests/test_system.py's kill-and-resume test hung once under load.) The actor
    is a scripted DEALER socket: the test decides exactly what it holds."""
    from learner.leases import RESUME_GAP

    run = tmp_path / "run"
    # no held-out evaluation: its leases would go first, and this scripted actor serves none
    args = ["actors.num_local=0", "learner.max_steps=50", "transport.peer_timeout_s=60",
            "task.eval_prompts=0"]
    dec = m.Decoders().to_actor
    enc = m.encoder()
    ctx = zmq.Context()

    def ask(sock, msg, want):
        """Send `msg`, return the first `want` that comes back (within 60 s)."""
        sock.send(enc.encode(msg))
        deadline = time.monotonic() + 60
        while (left := deadline - time.monotonic()) > 0 and sock.poll(left * 1000):
            if isinstance(reply := dec.decode(sock.recv()), want):
                return reply
        raise AssertionError(f"no {want.__name__} from the learner within 60 s")

    hello = dict(protocol_version=m.PROTOCOL_VERSION, actor_id="x", engine="hf", incarnation="i1")
    lp = procs.learner(run, tiny_model_dir, *args)
    lp2 = None
    try:
        lp.wait_for(r"learner listening", timeout=120)
        ctl = ctx.socket(zmq.DEALER)
        ctl.connect(json.loads((run / "endpoints.json").read_text())["control"])
        assert ask(ctl, m.Hello(**hello), m.Welcome).leases_kept == []
        leases = ask(ctl, m.WorkRequest(actor_id="x", max_groups=4), m.LeaseGrant).leases
        assert [x.lease_id for x in leases] == [0, 1, 2, 3]
        lp.wait_for(r"v0 waiting for trajectories", timeout=120)  # in its loop: SIGTERM saves
        lp.p.send_signal(signal.SIGTERM)  # checkpoint step_0: the four leases outstanding
        assert lp.finish(timeout=120) == 0, lp.tail()
        ctl.close(linger=0)

        lp2 = procs.learner(run, tiny_model_dir, *args, "learner.resume=true")
        lp2.wait_for(r"resumed from .*step_0 at v0 \(prompt cursor 4, 4 leases outstanding", 120)
        lp2.wait_for(r"learner listening", timeout=120)
        eps = json.loads((run / "endpoints.json").read_text())
        ctl = ctx.socket(zmq.DEALER)
        ctl.connect(eps["control"])
        welcome = ask(ctl, m.Hello(**hello, leases_held=[1]), m.Welcome)  # 0, 2, 3 were sent
        assert welcome.leases_kept == [1]
        lp2.wait_for(r"expired 3 lease\(s\) \(actor x\)", timeout=60)
        again = ask(ctl, m.WorkRequest(actor_id="x", max_groups=3), m.LeaseGrant).leases
        first = again[0].lease_id  # a random multiple of RESUME_GAP above the checkpoint's 4
        assert first >= 4 + RESUME_GAP and (first - 4) % RESUME_GAP == 0
        assert [x.lease_id for x in again] == [first, first + 1, first + 2]
        assert [x.prompt_id for x in again] == [leases[i].prompt_id for i in (0, 2, 3)]
        traj = ctx.socket(zmq.PUSH)
        traj.connect(eps["trajectory"])
        for lease_id in (2, 5):  # expired here; granted after the checkpoint (void)
            traj.send(enc.encode(m.pack_group(lease_id=lease_id, actor_id="x", prompt_id=0,
                                              samples=[], tokens=[])))
        lp2.wait_for(r"rejected message #1 \(void_lease\): lease 5 ", timeout=60)
        lp2.wait_for(r"v0 waiting for trajectories", timeout=120)
        lp2.p.send_signal(signal.SIGTERM)
        assert lp2.finish(timeout=120) == 0, lp2.tail()
        s = procs.summary(run)
        assert s["rejected_messages"] == {"duplicate": 1, "void_lease": 1}, s["rejected_messages"]
        _check_accounting(s)
        assert s["groups"]["outstanding"] == 4 and s["groups"]["dropped"] == {"expired": 3}
    finally:
        ctx.destroy(linger=0)
        for p in (lp, lp2):
            if p is not None:
                p.kill()


@pytest.mark.parametrize("lora", [[], ["learner.lora.rank=4", "learner.lora.alpha=8",
                                         "learner.lr=3e-3"]], ids=["full", "lora"])
def test_learner_killed_and_resumed_actors_reconnect_by_themselves(tmp_path, tiny_model_dir,
                                                                   lora):
    """LoRA: the actors load the new learner run's base again (then its adapters)."""
    run = tmp_path / "run"
    args = ["actors.num_local=0", "learner.max_steps=24", "learner.log_every=1",
            "learner.checkpoint_every=4", "transport.heartbeat_s=0.25", "transport.peer_timeout_s=2",
            "max_staleness=2", *lora]
    lp = procs.learner(run, tiny_model_dir, *args)
    actors, lp2 = [], None
    try:
        lp.wait_for(r"learner listening", timeout=120)
        actors = [procs.actor(run, f"node-{i}") for i in range(2)]
        lp.wait_for(r"step 6/24", timeout=360)
        lp.kill()  # SIGKILL: no goodbye, no final checkpoint; the newest is step_4
        for a in actors:
            a.wait_for(r"learner silent .* joining again", timeout=60)
        lp2 = procs.learner(run, tiny_model_dir, *args, "learner.resume=true")
        lp2.wait_for(r"resumed from .*step_4 at v4", timeout=120)
        assert lp2.finish(timeout=300) == 0, lp2.tail()
        reloaded = 0
        for a in actors:  # the same processes: never restarted
            assert a.finish(timeout=60) == 0, a.tail()
            runs = "".join(a.lines).split("joined learner run")[1:]
            assert len(runs) == 2
            # in each learner run it got weights from: that run's base once, before any version
            loads = [re.findall(r"loaded (the base weights|weights v\d+ \((?:full|adapter))", r)
                     for r in runs]
            for got in loads:
                bases = got.count("the base weights")
                assert bases == (int(bool(got)) if lora else 0) and (not bases or
                                                                     got[0] == "the base weights"), got
            reloaded += all(loads)
        assert reloaded >= 1  # an actor slow to start may have got no weights from the first run
    finally:
        for p in (lp, lp2, *actors):
            if p is not None:
                p.kill()
    s = procs.summary(run)
    assert s["steps"] == 24
    _check_accounting(s)
    assert s["groups"]["consumed"] == 24 * 16  # every step trained on exactly one batch
    assert [r["step"] for r in procs.metrics(run)] == list(range(1, 25))
