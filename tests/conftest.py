"""Shared fixtures: a tiny model directory built once per session, and subprocess helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    import torch

    sglang_lane = os.environ.get("TETHER_LANE") == "sglang"  # test.sh's second lane
    for item in items:
        if (item.get_closest_marker("sglang") is not None) != sglang_lane:
            item.add_marker(pytest.mark.skip(reason="SGLang tests run in test.sh's SGLang lane"
                                             if not sglang_lane else "not an SGLang test"))

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The warm-started tiny model, built exactly as the learner builds it."""
    from configs.loader import load_config
    from learner.model_setup import ensure_model

    path = tmp_path_factory.mktemp("model") / "tiny"
    cfg = load_config(ROOT / "configs" / "toy_reverse.yaml", [f"model.path={path}"])
    return ensure_model(cfg)


def start(args: list[str], log_path: Path, **kw) -> subprocess.Popen:
    """Start `python -m ...` from the repo root with output to a log file."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = open(log_path, "ab")
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, env=env, **kw)
