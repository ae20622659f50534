"""The bubblewrap sandbox of the python tool (`actors.agent.python_sandbox: bwrap`, the default).

    bwrap                                   a fresh mount, network, pid, ipc and uts namespace
      read-only:  /usr (/bin, /lib, /lib64 as its links), the interpreter's own prefix
      private:    /tmp (an empty tmpfs, the working directory), /proc, /dev
      nothing else: no /etc, /home, /root, /work, no run directory, no CURVE keys
      no network: its own loopback, down (the learner's ports are not reachable)
      -> setpriv (as root) / bwrap's user namespace (otherwise): uid 65534, no capabilities,
         no_new_privs -> python -I -c CODE under the tool's rlimits (address space, CPU,
         file size, processes)

`--die-with-parent` and the pid namespace tie every process the code starts to bwrap: killing
bwrap at the wall-clock limit kills all of them, also ones that called setsid().

Why setpriv when the actor runs as root: the kernel never applies RLIMIT_NPROC to root's
processes (also inside a user namespace that maps to uid 0), so as root bwrap runs without a
user namespace and the code runs as uid 65534, where the process limit holds.
"""

from __future__ import annotations

import os
import shutil
import sys

NOBODY = 65534


def find_bwrap() -> str | None:
    """Path of the bwrap binary, or None (Debian/Ubuntu: `apt-get install bubblewrap`)."""
    return shutil.which("bwrap")


def interpreter() -> tuple[str, str]:
    """(real python binary, its installation prefix): the sandbox binds the prefix read-only
    (`-I` keeps the virtual environment's site-packages out, so its path need not be seen)."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def bwrap_argv(bwrap: str, code: str) -> list[str]:
    """The command line that runs `code` under bwrap (see the module docstring)."""
    python, prefix = interpreter()
    argv = [bwrap, "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
            "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"]
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--perms", "1777", "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev",
             "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
             "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--chdir", "/tmp",
             "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",  # not the actor's
             "--setenv", "PATH", "/usr/bin"]
    if os.geteuid() == 0:
        drop = ["/usr/bin/setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    else:
        argv += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
                 "--cap-drop", "ALL"]
        drop = []
    return [*argv, "--", *drop, python, "-I", "-c", code]
