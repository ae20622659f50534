"""Each actor process's own scratch directory in the system temp dir, removed when the actor
ends, however it ends (SIGKILL included).

vLLM and SGLang leave files in the temp dir that nothing removes once their processes are killed:
vLLM's ZeroMQ ipc sockets (`<uuid4>`, under VLLM_RPC_BASE_PATH, which defaults to the temp dir)
and the `vllm_dist_<hex>` file store of its worker's process group; SGLang's ipc sockets (its
`PortArgs`, named by `tempfile.NamedTemporaryFile`). Every actor that ended left some in /tmp
for good. So an actor makes `tempfile.mkdtemp(prefix="tether-actor-")` before it imports an
engine and points TMPDIR (inherited by the engine's processes) and `tempfile.tempdir` (this
process) into it. The directory sits in the temp dir, not the run directory: a unix socket's path
is at most 107 bytes.

Removal: the actor removes the directory as it exits, and a keeper process (`python -m
actors.scratch PID DIR`, started with the directory, in a session of its own so that signals to
the actor's process group do not reach it) removes it once the actor has exited however it did:
also when the actor was SIGKILLed before it started an engine, and whatever files the engine's
processes wrote as they died. Nothing ever sweeps the temp dir: every directory is removed by
the keeper of its own actor, so no live actor's directory is touched.

torch inductor's default cache dir follows the temp dir: TORCHINDUCTOR_CACHE_DIR is set to its
usual place (where the user has not set it), so the compile cache survives between runs.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "tether-actor-"


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """Make this process's scratch directory, start its keeper and make it the temp dir of this
    process and of the processes it starts from now on; remove it on leaving the block."""
    inductor_cache = inductor_default_cache_dir()  # computed before the temp dir moves
    path = Path(tempfile.mkdtemp(prefix=PREFIX))
    subprocess.Popen([sys.executable, "-m", "actors.scratch", str(os.getpid()), str(path)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     start_new_session=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = str(path)
    try:
        yield path
    finally:
        remove(path)


def inductor_default_cache_dir() -> str:
    """torch inductor's cache dir when TORCHINDUCTOR_CACHE_DIR is unset (torch's
    `_inductor.runtime.cache_dir_utils.default_cache_dir`, without importing torch)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (containers): torch's fallback
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def remove(path: Path) -> None:
    """Remove `path` and all it holds. Entries that vanish meanwhile (removed by the other of the
    actor and its keeper, or by an engine process as it ends) are no error; anything left is."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        raise RuntimeError(f"could not remove the actor's scratch directory {path}: "
                           f"{sorted(p.name for p in path.iterdir())} left")


def keep(actor_pid: int, path: Path) -> None:
    """The keeper: remove `path` once process `actor_pid` (this process's parent) has exited."""
    with contextlib.suppress(ProcessLookupError):  # the actor is gone already
        fd = os.pidfd_open(actor_pid)
        if os.getppid() == actor_pid:  # else the actor is gone and `actor_pid` may be another's
            select.select([fd], [], [])  # readable once the actor has exited
    remove(path)


if __name__ == "__main__":
    keep(int(sys.argv[1]), Path(sys.argv[2]))
