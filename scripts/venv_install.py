"""Install packages into a virtual environment with uv, from the package sources pip is set up with.

    VENV/bin/python scripts/venv_install.py install ARGS...     # uv pip install ARGS into VENV
    VENV/bin/python scripts/venv_install.py uninstall ARGS...   # uv pip uninstall ARGS
    VENV/bin/python scripts/venv_install.py compile ARGS...     # uv pip compile ARGS for VENV's python

Run by scripts/env.sh and scripts/env_sglang.sh with the venv's own python (`install`, the lock
as a constraint file), and by scripts/lock.sh (`compile`), which writes the locks. uv resolves to
the same versions as pip (`--index-strategy unsafe-best-match`: every index is searched for the
best version, as pip does) and installs them in parallel: .venv with all of test.sh's extras took
36 s with uv (its cache empty) and ~117 s with pip on this 2-core machine. uv is installed into
the venv with pip first (one small wheel). uv does not read pip's configuration, so the indexes,
find-links and constraint files pip would use (`pip config list`: its config files and PIP_*
variables; on this machine the local CPU torch wheel is found through find-links) are passed to
uv as flags.
`--compile-bytecode`: pip writes .pyc files at install time, and with PYTHONDONTWRITEBYTECODE=1
(set on this machine) an environment without them compiles every module at every import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

UV = "uv==0.13.9"
"""The uv release the scripts were measured with."""

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint"}
"""pip's settings that say where packages come from, and uv's flag for each."""


def pip_sources() -> list[str]:
    """uv flags for the package sources in pip's configuration. A value set in the environment
    (PIP_*) wins over the config files', as in pip; several values are space-separated."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True,
                         capture_output=True, text=True).stdout
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if name in FLAGS and section in (":env:", "global", "install"):
            (env if section == ":env:" else files)[name] = value.strip().strip("'\"")
    return [f"{FLAGS[name]}={v}" for name, value in sorted({**files, **env}.items())
            for v in value.split()]


def main(command: str, *args: str) -> int:
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", UV], check=True)
    base = [str(uv), "pip", command, "--python", sys.executable, "--quiet"]
    if command == "install":
        base += ["--compile-bytecode"]
    if command in ("install", "compile"):
        base += ["--index-strategy", "unsafe-best-match", *pip_sources()]
    return subprocess.run([*base, *args]).returncode


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("install", "uninstall", "compile"):
        raise SystemExit(__doc__)
    sys.exit(main(*sys.argv[1:]))
