"""CURVE: only actors whose public key the learner allows can join, push or pull weights."""

from __future__ import annotations

import subprocess
import sys

import zmq

import procs
from transport import messages as m


def _keys(d, name):
    subprocess.run([sys.executable, "-m", "transport.security", str(d), name], check=True,
                   cwd=procs.ROOT, capture_output=True)
    return d / f"{name}.key", d / f"{name}.key_secret"


def test_curve_admits_allowed_keys_only(tmp_path, tiny_model_dir):
    server_pub, server_sec = _keys(tmp_path / "learner", "learner")
    allowed = tmp_path / "allowed"
    good_pub, good_sec = _keys(allowed, "good")
    _, rogue_sec = _keys(tmp_path / "rogue", "rogue")
    run = tmp_path / "run"
    common = ["transport.heartbeat_s=0.25", "transport.peer_timeout_s=2"]
    lp = procs.learner(run, tiny_model_dir, "actors.num_local=0", "learner.max_steps=3",
                       f"transport.curve_server_secret={server_sec}",
                       f"transport.curve_allowed_dir={allowed}", *common)
    rogue = good = None
    try:
        lp.wait_for(r"learner listening", timeout=120)
        rogue = procs.actor(run, "rogue", f"transport.curve_client_secret={rogue_sec}",
                            f"transport.curve_server_public={server_pub}",
                            "transport.curve_server_secret=", "transport.curve_allowed_dir=", *common)
        rogue.wait_for(r"actor rogue cannot join: the learner refused this actor's CURVE key",
                       timeout=60)
        assert rogue.finish(timeout=60) == 5, rogue.tail()
        # the same when its first Hello comes after the failed handshake (as under load)
        late = procs.Proc(["tests/late_hello_actor.py", "-c", str(run / "config.yaml"),
                           "--actor-id", "late", str(run / "endpoints.json"),
                           f"transport.curve_client_secret={rogue_sec}",
                           f"transport.curve_server_public={server_pub}",
                           "transport.curve_server_secret=", "transport.curve_allowed_dir=",
                           *common], tmp_path / "late.log")
        late.wait_for(r"actor late cannot join: the learner refused this actor's CURVE key",
                      timeout=60)
        assert late.finish(timeout=60) == 5, late.tail()
        # a client without CURVE cannot even get its Hello through
        ctx = zmq.Context()
        plain = ctx.socket(zmq.DEALER)
        plain.connect(procs.json.loads((run / "endpoints.json").read_text())["control"])
        plain.send(m.encoder().encode(m.Hello(protocol_version=m.PROTOCOL_VERSION, actor_id="plain",
                                              engine="hf")))
        assert not plain.poll(3000)
        plain.close(linger=0)
        ctx.term()
        good = procs.actor(run, "good", f"transport.curve_client_secret={good_sec}",
                           f"transport.curve_server_public={server_pub}",
                           "transport.curve_server_secret=", "transport.curve_allowed_dir=", *common)
        assert lp.finish(timeout=240) == 0, lp.tail()
        assert good.finish(timeout=60) == 0
    finally:
        for p in (rogue, good, lp):
            if p is not None:
                p.kill()
    assert "joined learner" not in "".join(rogue.lines)
    joined = [ln for ln in lp.lines if "joined (engine" in ln]
    assert len(joined) == 1 and "actor good joined" in joined[0]
    assert procs.summary(run)["steps"] == 3
