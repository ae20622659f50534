"""An actor's scratch directory (actors/scratch.py): its temporary files and its children's go
there, and it is removed when the actor ends, however it ends. Engine-free: a small process
stands in for the actor (test_vllm.py and test_sglang.py run the real engines)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import psutil
import pytest

import procs

FAKE_ACTOR = """
import subprocess, sys, tempfile
from actors.scratch import scratch_dir

with scratch_dir() as path:
    tempfile.NamedTemporaryFile(delete=False)  # this process's temporary file, kept
    subprocess.run([sys.executable, "-c", "import tempfile; tempfile.mkdtemp()"], check=True)
    print(path, flush=True)
    sys.stdin.readline()  # until the test says stop (or kills this process)
"""


def start_fake_actor(tmpdir) -> tuple[subprocess.Popen, str, int]:
    """A process in scratch_dir() with TMPDIR=`tmpdir`; returns it, its scratch directory (once
    this process and a child of it have put a file in their temp dir) and its keeper's pid."""
    p = subprocess.Popen([sys.executable, "-c", FAKE_ACTOR], cwd=procs.ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env={**os.environ, "TMPDIR": str(tmpdir)})
    path = p.stdout.readline().strip()
    (keeper,) = [q for q in psutil.process_iter(["cmdline"])
                 if q.info["cmdline"] and q.info["cmdline"][-2:] == [str(p.pid), path]]
    return p, path, keeper.pid


@pytest.mark.parametrize("sig", [None, signal.SIGKILL], ids=["normal-exit", "sigkill"])
def test_the_scratch_dir_holds_the_temp_files_and_is_gone_when_the_actor_ends(tmp_path, sig):
    p, path, keeper = start_fake_actor(tmp_path)
    try:
        assert os.path.dirname(path) == str(tmp_path)
        assert os.path.basename(path).startswith("tether-actor-")
        assert len(os.listdir(path)) == 2  # the actor's file and its child's directory
        assert os.listdir(tmp_path) == [os.path.basename(path)]
        if sig is None:
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.wait(timeout=30) == 0
            assert not os.path.exists(path)  # removed by the actor itself
        else:
            p.send_signal(sig)
            assert p.wait(timeout=30) == -sig
        assert procs.wait_pid_exit(keeper, timeout=30), "the keeper outlived the actor"
        assert os.listdir(tmp_path) == []
    finally:
        p.kill()


def test_the_keeper_is_out_of_reach_of_signals_to_the_actors_process_group(tmp_path):
    """A Ctrl-C or `kill 0` reaches the whole group: the actor stops, its keeper stays to clean.
    Nor is it a descendant of the actor: SGLang's shutdown kills the actor's whole process tree."""
    p, path, keeper = start_fake_actor(tmp_path)
    try:
        assert os.getsid(keeper) != os.getsid(p.pid)
        assert keeper not in [q.pid for q in psutil.Process(p.pid).children(recursive=True)]
    finally:
        p.kill()
    assert procs.wait_pid_exit(keeper, timeout=30)
    assert not os.path.exists(path)


@pytest.mark.parametrize("user_set", [False, True], ids=["default", "set-by-user"])
def test_torch_inductors_cache_stays_where_it_was(tmp_path, monkeypatch, user_set):
    """TMPDIR moves to the scratch dir; inductor's cache stays in the temp dir it was in before,
    torch's own default (or where the user put it)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    want = str(tmp_path / "mine") if user_set else default_cache_dir()
    env = {"TORCHINDUCTOR_CACHE_DIR": want} if user_set else {}
    code = ("import os; from actors.scratch import scratch_dir\n"
            "with scratch_dir(): print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=procs.ROOT, check=True, text=True,
                         capture_output=True, env={**os.environ, "TMPDIR": str(tmp_path), **env}
                         ).stdout
    assert out.strip() == want


def test_a_temp_dir_too_long_for_the_engines_sockets_is_refused_naming_tmpdir(tmp_path):
    """vLLM names its ipc sockets `<temp dir>/<uuid4>`, at most 107 bytes: a vLLM actor whose
    TMPDIR leaves no room (49 bytes or more, with the scratch dir) stops before it starts
    anything, with one line naming TMPDIR."""
    long = tmp_path / ("d" * max(1, 49 - len(str(tmp_path)) - 1))
    long.mkdir()
    assert len(str(long)) >= 49
    r = subprocess.run([sys.executable, "-m", "actors", "-c", "configs/toy_reverse_vllm.yaml",
                        "tcp://127.0.0.1:1"], cwd=procs.ROOT, text=True, capture_output=True,
                       env={**os.environ, "TMPDIR": str(long)}, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("tether-actor: the temp dir") and "set TMPDIR" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert os.listdir(long) == []
