"""Relays as real processes (`python -m transport.weightsrc.relay`): a relay SIGKILLed while
actors pull a version through it. Learner, two relays and two actors over TCP on loopback,
tiny model, small buckets (many per version); the actors run the simulated engine (named fake:
quick to start, paced generation), the weights travel and are checked exactly as with any."""

from __future__ import annotations

import re
import signal
import sys
import zlib

import procs


def _relay(run, relay_id: str) -> procs.Proc:
    return procs.Proc(["-m", "transport.weightsrc.relay", "-c", str(run / "config.yaml"),
                       str(run / "endpoints.json"), "--relay-id", relay_id, "--bind",
                       "127.0.0.1", "--advertise", "127.0.0.1"],
                      run.parent / f"{run.name}-{relay_id}.log")


def _actor_ids(n: int, relays: int) -> list[str]:
    """Actor ids that spread over the relays as RelaySource picks them (crc32 of the id)."""
    ids: list[str] = []
    i = 0
    while len(ids) < n:
        name = f"node-{i}"
        if zlib.crc32(name.encode()) % relays == len(ids) % relays:
            ids.append(name)
        i += 1
    return ids


def test_a_relay_killed_mid_transfer_costs_no_version_and_no_group(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    steps = 14
    lp = procs.learner(run, tiny_model_dir, "actors.num_local=0", f"learner.max_steps={steps}",
                       "learner.log_every=1", "transport.heartbeat_s=0.25",
                       "transport.peer_timeout_s=4", "max_staleness=1",
                       "transport.weights_via=relay", "transport.weight_bucket_bytes=4096")
    relays, actors = [], []
    try:
        lp.wait_for(r"learner listening", timeout=120)
        for rid in ("r0", "r1"):  # r0 joins first: the root (r1 fetches from it)
            relays.append(_relay(run, rid))
            relays[-1].wait_for(r"serving at", timeout=60)
        ids = _actor_ids(2, relays=2)  # one pulls through r0, one through r1
        actors = [procs.actor(run, aid, "actors.engine=simulated",
                              "actors.engine.latency_mean_s=0.5", "--host", "127.0.0.1")
                  for aid in ids]
        k = int(lp.wait_for(r"step (\d+)/\d+ .*actors 2", timeout=300).group(1))
        assert k <= steps - 5, "the run ended before both actors took part"
        relays[0].p.send_signal(signal.SIGSTOP)  # pulls of the next versions hang in it ...
        lp.wait_for(rf"step {k + 2}/", timeout=300)
        relays[0].p.send_signal(signal.SIGKILL)  # ... and it dies with them in flight
        relays[0].p.wait()
        s = procs.finish_clean(lp, run, steps, timeout=300)
        for a in actors:
            assert a.finish(timeout=60) == 0, a.tail()
    finally:
        for p in (*actors, *relays, lp):
            p.kill()
    assert s["groups"]["dropped"].get("expired", 0) == 0  # no actor was lost on the way
    logs = {aid: "".join(a.lines) for aid, a in zip(ids, actors)}
    skipped = [aid for aid, text in logs.items() if "timed out: skipping it" in text]
    assert skipped, "no actor was pulling through the stopped relay"
    for aid, text in logs.items():  # in order, and past the versions of the kill
        versions = [int(v) for v in re.findall(r"loaded weights v(\d+)", text)]
        assert versions == sorted(set(versions)) and versions[-1] > k + 2, (aid, versions)
    sent = s["weights_sent_bytes"]
    assert sent.get("relay", 0) > 0  # the relays carried weights
    print(sent, file=sys.stderr)
