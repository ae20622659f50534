"""A relay's malloc settings (transport/weightsrc/relay_memory.py): the blocks libzmq receives
buckets into are reused once freed, not faulted in afresh. Each case runs in a child process
(malloc settings are per process): it asks for 32 MiB messages one at a time over TCP on
loopback, keeps the newest two (a cache that frees what the next one needs), and counts its
minor page faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from procs import ROOT

MIB32 = 32 << 20
CHILD = f"""
import json, resource, sys, threading, zmq
from transport.weightsrc.relay_memory import reuse_receive_buffers
done = reuse_receive_buffers() if sys.argv[1] == "on" else {{}}
ctx = zmq.Context()
server = ctx.socket(zmq.REP)
port = server.bind_to_random_port("tcp://127.0.0.1")
client = ctx.socket(zmq.REQ)
client.connect(f"tcp://127.0.0.1:{{port}}")
block = bytes({MIB32})

def serve():
    for _ in range(16):
        server.recv()
        server.send(block, copy=False)

sender = threading.Thread(target=serve)
sender.start()
kept = []
for i in range(16):  # one block asked for at a time (as a relay asks): three alive at most
    if i == 6:  # after a warm-up: the first blocks are new pages in any case
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    client.send(b"next")
    kept = kept[-1:] + [client.recv(copy=False)]
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
sender.join()
print(json.dumps({{"set": done, "faults": faults}}))
"""


def _child(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_relay_receives_into_reused_blocks_instead_of_fresh_pages():
    pages = 10 * MIB32 // os.sysconf("SC_PAGE_SIZE")
    default = _child("off")
    assert default["faults"] > 0.9 * pages  # glibc maps each block afresh: every page faults
    tuned = _child("on")
    assert tuned["set"] == {"MALLOC_MMAP_MAX_": 0, "MALLOC_ARENA_MAX": 1,
                            "MALLOC_TRIM_THRESHOLD_": 2**31 - 1}
    # freed blocks are reused: the heap may still grow by a block now and then (a small
    # allocation left in a freed block's place), but not by one block a message
    assert tuned["faults"] < 0.25 * pages


def test_a_malloc_setting_in_the_environment_wins():
    assert "MALLOC_ARENA_MAX" not in _child("on", MALLOC_ARENA_MAX="4")["set"]
