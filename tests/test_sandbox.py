"""The python tool's sandbox (actors/agents/sandbox.py): model-written code tries to escape.

Each attempt runs under both modes: under bubblewrap it must fail; under `rlimits` (today's
limits-only tool, `actors.agent.python_sandbox=rlimits`) the same code must succeed, which shows the
attempt is a real one (a check that can fail)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

import psutil
import pytest
import zmq

from actors.agents.sandbox import find_bwrap
from actors.agents.tools import PythonTool, ToolCall, ToolRegistry, make_tools
from transport import security

pytestmark = pytest.mark.skipif(find_bwrap() is None, reason="bubblewrap (bwrap) not installed")

MODES = ["bwrap", "rlimits"]


def run_code(code: str, sandbox: str, timeout_s: float = 10.0) -> str:
    tool = PythonTool(cpu_s=timeout_s, memory_mb=512, sandbox=sandbox, max_procs=16)
    return asyncio.run(ToolRegistry([tool], timeout_s).call(ToolCall("python", code)))


@pytest.mark.parametrize("sandbox", MODES)
def test_code_cannot_read_the_run_directorys_curve_secret_key(tmp_path, sandbox):
    keys = tmp_path / "run" / "keys"
    security.main([str(keys), "learner"])
    secret = (keys / "learner.key_secret").read_text()
    out = run_code(f"print(open({str(keys / 'learner.key_secret')!r}).read())", sandbox)
    if sandbox == "bwrap":
        assert out.startswith("error python failed") and "secret-key" not in out, out
    else:
        assert out.strip() == secret.strip()


@pytest.mark.parametrize("sandbox", MODES)
def test_code_cannot_connect_to_the_learners_trajectory_port(sandbox):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)  # the learner's trajectory socket
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    monitor = pull.get_monitor_socket(zmq.EVENT_ACCEPTED)
    code = ("import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
            "print('connected')")
    out = run_code(code, sandbox)
    accepted = monitor.poll(timeout=2000 if sandbox == "rlimits" else 200)
    pull.disable_monitor()
    monitor.close()
    pull.close(linger=0)
    ctx.term()
    if sandbox == "bwrap":
        assert "connected" not in out and out.startswith("error python failed"), out
        assert not accepted
    else:
        assert out == "connected" and accepted


def test_bwrap_code_has_its_own_tmp_as_temp_dir(tmp_path, monkeypatch):
    """Under bwrap, /tmp is the code's own tmpfs and the actor's TMPDIR (its scratch dir,
    actors/scratch.py) is not there: TMPDIR must point at /tmp, also for programs other than
    Python, which would fail on the missing directory."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    out = run_code("import os, subprocess\nprint(os.environ['TMPDIR'], "
                   "subprocess.run(['mktemp'], capture_output=True, text=True).returncode)",
                   "bwrap")
    assert out == "/tmp 0", out


@pytest.mark.parametrize("sandbox", MODES)
def test_code_cannot_write_outside_its_temp_dir(tmp_path, sandbox):
    target = tmp_path / "run" / "planted.txt"
    target.parent.mkdir()
    target.parent.chmod(0o777)
    out = run_code(f"open({str(target)!r}, 'w').write('x'); print('wrote')", sandbox)
    # its own temp dir is writable, under both modes
    assert run_code("import tempfile\nwith tempfile.TemporaryFile() as f: f.write(b'x')\n"
                    "print('ok')", sandbox) == "ok"
    if sandbox == "bwrap":
        assert not target.exists() and out.startswith("error python failed"), out
    else:
        assert target.read_text() == "x" and out == "wrote"


FORK_BOMB = """
import os, time
n = 0
try:
    for _ in range(64):
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        n += 1
except OSError:
    pass
print(n)
"""


@pytest.mark.parametrize("sandbox", MODES)
def test_code_cannot_fork_more_than_its_limit(sandbox):
    forked = int(run_code(FORK_BOMB, sandbox))
    if sandbox == "bwrap":
        assert forked < 16, forked  # RLIMIT_NPROC=16 for the code's uid (itself included)
    else:
        assert forked == 64


def _processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if marker in " ".join(p.info["cmdline"] or []):
            found.append(p)
    return found


@pytest.mark.parametrize("sandbox", MODES)
def test_code_cannot_run_past_its_time_limit(sandbox):
    """The code starts a detached grandchild (own session) and waits; at the wall-clock limit
    every process it started must be gone."""
    marker = f"tether-escape-{uuid.uuid4().hex}"
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])\n"
            "    os._exit(0)\n"
            "time.sleep(30)\n")
    # 5 s, not 2: under a loaded machine (both test lanes at once) 2 s once ran out before the
    # code had forked its grandchild, and the rlimits run then had no escape to show
    out = run_code(code, sandbox, timeout_s=5.0)
    assert "timed out after 5s" in out, out
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition with a deadline: the kernel reaps asynchronously
    left = _processes_with(marker)
    for p in left:
        p.kill()
    if sandbox == "bwrap":
        assert left == []
    else:
        assert len(left) == 1


def test_python_tool_refuses_to_start_without_bubblewrap(monkeypatch, caplog):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="actors.agent.python_sandbox=rlimits"):
        make_tools("calc,python", 5.0, 512)
    with caplog.at_level(logging.WARNING, logger="actors.agents.tools"):
        make_tools("python", 5.0, 512, sandbox="rlimits")
    assert "without a sandbox" in caplog.text and "unsafe" not in os.environ.get("PATH", "")


def test_sandboxed_code_still_computes():
    assert run_code("import json, math\nprint(json.dumps([math.factorial(5)]))", "bwrap") == "[120]"
    assert socket.gethostname()  # the host is untouched by the sandbox's uts namespace
