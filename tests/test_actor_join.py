"""An actor that cannot join says why and stops: real actor processes against a port nothing
listens on, a plain HTTP server, and a CURVE server with another key; SIGTERM ends one that
is still joining."""

from __future__ import annotations

import http.server
import signal
import socket
import threading
import time

import pytest
import zmq
import zmq.auth

import procs


@pytest.fixture
def closed_port():
    """A TCP port bound but never listening: a connection to it is refused, and no other
    process can take it while the test runs."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


def _actor(tmp_path, port: int, *overrides: str) -> procs.Proc:
    return procs.Proc(["-m", "actors", "-c", str(procs.PRESET), "--actor-id", "a1",
                       f"run_dir={tmp_path / 'run'}", *overrides, f"127.0.0.1:{port}"],
                      tmp_path / "actor.log")


def test_sigterm_stops_an_actor_that_is_still_joining(tmp_path, closed_port):
    """It used to ignore SIGINT and SIGTERM until it joined (only kill -9 stopped it)."""
    ap = _actor(tmp_path, closed_port)
    try:
        ap.wait_for(rf"learner at tcp://127\.0\.0\.1:{closed_port}", timeout=120)
        t0 = time.monotonic()
        ap.p.send_signal(signal.SIGTERM)
        rc = ap.finish(timeout=10)
        took = time.monotonic() - t0
    finally:
        ap.kill()
    assert rc == 0 and took < 1.0, (rc, took, ap.tail())
    assert "stopped by signal 15 before joining" in "".join(ap.lines), ap.tail()


def test_nothing_listening_is_said_and_the_join_deadline_ends_the_actor(tmp_path, closed_port):
    ap = _actor(tmp_path, closed_port, "actors.join_timeout_s=3")
    try:
        rc = ap.finish(timeout=90)
    finally:
        ap.kill()
    text = "".join(ap.lines)
    assert rc == 4, ap.tail()
    said = (f"nothing listens at tcp://127.0.0.1:{closed_port} (connection refused): is the "
            "learner up, and is the address right?")
    assert said in text, ap.tail()  # said while it waits, and why it gave up:
    assert f"actor a1 cannot join: gave up after actors.join_timeout_s=3: {said}" in text, ap.tail()


def test_an_http_server_on_the_port_is_named_and_the_actor_exits_3(tmp_path):
    """docs/operations.md said an actor exits 3 when another service answers; with a plain
    HTTP server on the port it kept saying hello forever."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    ap = _actor(tmp_path, port, "transport.peer_timeout_s=3")
    try:
        rc = ap.finish(timeout=90)
    finally:
        ap.kill()
        server.shutdown()
        server.server_close()
    assert rc == 3, ap.tail()
    assert (f"actor a1 cannot join: tcp://127.0.0.1:{port} is not a Tether learner: it accepted "
            "the connection but did not complete the ZeroMQ handshake within 3s (another kind of "
            "service, e.g. HTTP, listens there)") in "".join(ap.lines), ap.tail()


def test_a_learner_with_another_curve_key_is_named_and_the_actor_exits_5(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    learner_public, learner_secret = zmq.auth.create_certificates(str(keys), "learner")
    other_public, _ = zmq.auth.create_certificates(str(keys), "other")
    _, actor_secret = zmq.auth.create_certificates(str(keys), "actor")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.curve_publickey, router.curve_secretkey = zmq.auth.load_certificate(learner_secret)
    router.curve_server = True
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ap = _actor(tmp_path, port, f"transport.curve_client_secret={actor_secret}",
                f"transport.curve_server_public={other_public}")
    try:
        rc = ap.finish(timeout=90)
    finally:
        ap.kill()
        router.close()
        ctx.term()
    assert rc == 5, ap.tail()
    assert (f"actor a1 cannot join: the learner did not answer the CURVE handshake: check its public key "
            f"(transport.curve_server_public={other_public})") in "".join(ap.lines), ap.tail()
