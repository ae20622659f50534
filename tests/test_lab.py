"""The lab (benchmarks, studies, baselines) stays outside the distribution, and the figures it
guards live in one baseline file that the benchmark reads and docs/performance.md quotes."""

from __future__ import annotations

import json
import re
import sys
import tomllib

from procs import ROOT

sys.path.insert(0, str(ROOT / "lab"))
import bench  # noqa: E402

BASELINES = json.loads((ROOT / "lab" / "baselines" / "bench.json").read_text())


def test_lab_is_not_a_package_the_distribution_ships():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not any(re.fullmatch(p.replace("*", ".*"), "lab") for p in find["include"]), find
    assert not (ROOT / "lab" / "__init__.py").exists()


def test_the_benchmark_reports_a_run_against_its_baselines():
    run = {"transport": [{"tokens_per_sample": 8, "ratio_vs_raw": 0.04},
                         {"tokens_per_sample": 1024, "ratio_vs_raw": 0.4}],
           "pipeline": {"speedup": 1.35}, "weights": {"by_receivers": {"8": {"ratio_vs_raw": 2.94}}}}
    lines = {line.split(":")[0]: line for line in bench.against_baselines(run, BASELINES)}
    assert set(lines) == {"transport.1024.ratio_vs_raw", "pipeline.speedup",
                          "weights.by_receivers.8.ratio_vs_raw"}
    assert lines["transport.1024.ratio_vs_raw"].endswith("aim >= 0.5: not met")
    assert "x1.00" in lines["pipeline.speedup"] and "aim" not in lines["pipeline.speedup"]
    assert "x2.00" in lines["weights.by_receivers.8.ratio_vs_raw"]


def test_every_baseline_is_stamped_and_quoted_with_its_commit_in_performance_md():
    page = (ROOT / "docs" / "performance.md").read_text().splitlines()
    for path, base in BASELINES["figures"].items():
        assert re.fullmatch(r"[0-9a-f]{7}", base["commit"]) and base["machine"] in BASELINES["machines"], path
        rows = [r for r in page if "†" in r and f"{base['value']:g}" in r and f"| {base['commit']} |" in r
                and f"| {base['machine']} |" in r]
        assert rows, (f"docs/performance.md has no † row with {path}'s {base['value']:g}, "
                      f"{base['commit']}, machine {base['machine']}")
    assert sum("†" in r for r in page if r.startswith("|")) == len(BASELINES["figures"])
