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
the actor's process group do not reach it, and forked once more so that it is no descendant of
the actor) removes it once the actor has exited however it did:
also when the actor was SIGKILLed before it started an engine, and whatever files the engine's
processes wrote as they died. Nothing ever sweeps the temp dir: every directory is removed by
the keeper of its own actor, so no live actor's directory is touched.

torch inductor's default cache dir follows the temp dir: TORCHINDUCTOR_CACHE_DIR is set to its
usual place (where the user has not set it), so the compile cache survives between runs.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from configs.loader import ConfigError

PREFIX = "tether-actor-"


SOCKET_PATH_MAX = 107
"""Bytes of a unix socket's path (sun_path, 108 with its NUL)."""
ENGINE_SOCKET_NAME = 36
"""The longest name an engine gives a socket in the temp dir: vLLM's `<uuid4>`."""


def check_socket_room() -> None:
    """For engines that put unix sockets in the temp dir (vLLM, SGLang): raise ConfigError,
    naming TMPDIR, if the scratch dir's path would leave no room for their names."""
    room = SOCKET_PATH_MAX - len(os.path.join(tempfile.gettempdir(), PREFIX + "x" * 8, ""))
    if room < ENGINE_SOCKET_NAME:
        raise ConfigError(f"the temp dir {tempfile.gettempdir()!r} is too long for the engine's "
                          f"unix sockets (at most {SOCKET_PATH_MAX} bytes with the actor's "
                          f"scratch dir and a {ENGINE_SOCKET_NAME}-byte name): set TMPDIR to a "
                          f"path of at most {SOCKET_PATH_MAX - ENGINE_SOCKET_NAME - len(PREFIX) - 10}"
                          " bytes")


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """Make this process's scratch directory, start its keeper and make it the temp dir of this
    process and of the processes it starts from now on; remove it on leaving the block."""
    inductor_cache = inductor_default_cache_dir()  # computed before the temp dir moves
    path = Path(tempfile.mkdtemp(prefix=PREFIX))
    subprocess.run([sys.executable, "-m", "actors.scratch", str(os.getpid()), str(path)],
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=True,
                   start_new_session=True)  # returns once the keeper watches this process
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = str(path)
    try:
        yield path
    finally:
        left = remove(path)
        if left:  # the keeper tries again once this process has exited
            logging.getLogger(__name__).warning("could not remove all of the scratch dir %s: "
                                                "%s left", path, left)


def inductor_default_cache_dir() -> str:
    """torch inductor's cache dir when TORCHINDUCTOR_CACHE_DIR is unset (torch's
    `_inductor.runtime.cache_dir_utils.default_cache_dir`, without importing torch)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (containers): torch's fallback
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def remove(path: Path) -> list[str]:
    """Remove `path` and all it holds; returns the names of what is left in it (none if it is
    gone). Entries that vanish meanwhile (removed by the other of the actor and its keeper, or
    by an engine process as it ends) are no error."""
    shutil.rmtree(path, ignore_errors=True)
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


def keep(actor_pid: int, path: Path) -> None:
    """The keeper: remove `path` once process `actor_pid` (this process's parent) has exited.
    It watches the actor from a grandchild of the actor (this process forks it and exits), so
    it is nobody's descendant: SGLang's shutdown kills every descendant of the actor, and a
    signal to the actor's process tree must not take the keeper with it."""
    with contextlib.suppress(ProcessLookupError):  # the actor is gone already
        fd = os.pidfd_open(actor_pid)
        if os.getppid() == actor_pid:  # else the actor is gone and `actor_pid` may be another's
            if os.fork():
                os._exit(0)  # the actor waits for this: the keeper proper now watches it
            select.select([fd], [], [])  # readable once the actor has exited
    remove(path)


if __name__ == "__main__":
    keep(int(sys.argv[1]), Path(sys.argv[2]))
