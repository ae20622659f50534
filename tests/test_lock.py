"""The locks (scripts/lock.txt, scripts/lock_sglang.txt; written by scripts/lock.sh) pin every
dependency the project names, and the venv the suite runs in holds exactly the locked versions."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from procs import ROOT

LOCK = ROOT / "scripts" / "lock.txt"
SGLANG_LOCK = ROOT / "scripts" / "lock_sglang.txt"
REFRESH = "run `bash scripts/lock.sh` and commit the lock (docs/getting_started.md)"


def _pins(lock) -> dict[str, str]:
    """{normalized name: version} of a lock's `name==version` lines."""
    pins = {}
    for line in lock.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    return pins


def _unpinned(requirements: list[str], pins: dict[str, str], extras: set[str] = frozenset()) -> list[str]:
    """The requirements (for these extras) that the lock does not pin to a version they allow."""
    bad = []
    for text in requirements:
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
            continue
        version = pins.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(version, prereleases=True):
            bad.append(f"{text} (locked: {version})")
    return bad


def test_the_lock_pins_every_dependency_of_test_shs_extras():
    header = re.search(r"^# extras: (\S+)$", LOCK.read_text(), re.M)
    test_sh = re.search(r"^TETHER_EXTRAS=(\S+) bash scripts/env\.sh", (ROOT / "test.sh").read_text(), re.M)
    assert header and test_sh and header[1] == test_sh[1], \
        f"scripts/lock.txt was resolved for other extras than test.sh installs: {REFRESH}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = header[1].split(",")
    wanted = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    bad = _unpinned(wanted, _pins(LOCK), set(extras))
    assert not bad, f"pyproject.toml asks for what scripts/lock.txt does not pin: {bad}; {REFRESH}"


def test_the_sglang_lock_pins_every_sglang_requirement():
    lines = (ROOT / "scripts" / "sglang_cpu_requirements.txt").read_text().splitlines()
    wanted = [x.split("#")[0].strip() for x in lines if x.split("#")[0].strip()]
    assert len(wanted) > 20
    bad = _unpinned(wanted, _pins(SGLANG_LOCK))
    assert not bad, (f"scripts/sglang_cpu_requirements.txt asks for what scripts/lock_sglang.txt "
                     f"does not pin: {bad}; {REFRESH}")


def test_this_venv_holds_the_locked_versions():
    """Every base dependency is installed at its locked version (the local label of torch's CPU
    build aside: `==2.13.0` admits 2.13.0+cpu), and so is every other locked package installed."""
    pins = _pins(LOCK)
    base = {canonicalize_name(Requirement(r).name)
            for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    installed = {}
    for name in pins:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            assert name not in base, f"{name} is a dependency but not installed"
    assert base <= installed.keys() and len(installed) > len(base)
    wrong = {n: f"{v} installed, {pins[n]} locked" for n, v in installed.items()
             if not Requirement(f"{n}=={pins[n]}").specifier.contains(v, prereleases=True)}
    assert not wrong, f"this venv was not installed from scripts/lock.txt (bash scripts/env.sh): {wrong}"
