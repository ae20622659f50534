"""scripts/venv_install.py hands uv the package sources pip is configured with (real pip)."""

from __future__ import annotations

import json
import subprocess
import sys

import procs


def _sources(tmp_path, config: str, env: dict[str, str]) -> list[str]:
    """The script's uv flags under pip config file `config` and the PIP_* variables `env` only."""
    path = tmp_path / "pip.conf"
    path.write_text(config)
    code = ("import json, sys; sys.path.insert(0, 'scripts'); import venv_install; "
            "print(json.dumps(venv_install.pip_sources()))")
    env = {"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": str(path), **env}
    out = subprocess.run([sys.executable, "-c", code], cwd=procs.ROOT, check=True, text=True,
                         capture_output=True, env=env).stdout
    return json.loads(out)


CONFIG = """[global]
index-url = https://mirror.example/simple
extra-index-url = file:///a/simple file:///b/simple
find-links = /wheels
constraint = /c.txt
cert = /etc/ssl/certs/ca-certificates.crt
"""
"""Sets every source pip has: the machine's own pip config files, which pip reads too, lose to
this one (PIP_CONFIG_FILE is read last)."""


def test_every_source_of_pip_config_becomes_a_uv_flag(tmp_path):
    assert _sources(tmp_path, CONFIG, {}) == [
        "--constraint=/c.txt", "--extra-index-url=file:///a/simple",
        "--extra-index-url=file:///b/simple", "--find-links=/wheels",
        "--index-url=https://mirror.example/simple"]


def test_a_pip_variable_wins_over_the_config_file_as_in_pip(tmp_path):
    assert _sources(tmp_path, CONFIG, {"PIP_FIND_LINKS": "/env/a /env/b"}) == [
        "--constraint=/c.txt", "--extra-index-url=file:///a/simple",
        "--extra-index-url=file:///b/simple", "--find-links=/env/a", "--find-links=/env/b",
        "--index-url=https://mirror.example/simple"]
