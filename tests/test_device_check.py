"""scripts/device_check.sh and scripts/device_check.py without CUDA: argument errors, the JSON
schema, the JUnit reading, and a whole dry run (HF engine and learner on CPU, tiny model, the
GPU tests collected and skipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import procs

sys.path.insert(0, str(procs.ROOT / "scripts"))
import device_check as dc  # noqa: E402

SMALL = ["--requests", "8", "--max-new", "4", "--batch", "2", "--seq", "8", "--steps", "1",
         "--gap-rows", "4"]


def test_arguments_are_checked(capsys):
    with pytest.raises(SystemExit):
        dc.parse_args(["--out", "r.json"])
    assert "--model is required without --dry-run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dc.parse_args(["--dry-run", "--out", "r.json", "--requests", "0"])
    assert "--requests must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dc.parse_args(["--dry-run", "--out", "r.json", "--dtype", "float16"])
    ns = dc.parse_args(["--model", "m", "--out", "r.json"])
    assert ns.dtype == "bfloat16" and not ns.dry_run and ns.kv_cache_gb == 4.0


def test_shell_script_rejects_unknown_arguments():
    r = subprocess.run(["bash", "scripts/device_check.sh", "--gpu"], cwd=procs.ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "unknown argument --gpu" in r.stderr


def test_schema_flags_missing_extra_and_mistyped_keys():
    good = {"ok": True, "dry_run": False, "device": "NVIDIA H200", "model": "m", "dtype": "bfloat16",
            "rollout": {"engine": "vllm", "tokens_per_s": 1.0, "tokens": 1, "requests": 1,
                        "seconds": 1.0},
            "vllm_tokens_per_s": 1.0, "learner_step_s": 0.1,
            "weight_sync": {"bytes": 1, "buckets": 1, "gather_pack_s": 0.1, "transfer_s": 0.1,
                            "load_s": 0.1, "zmq_total_s": 0.3, "cuda_ipc_s": None, "nccl_s": None},
            "logprob_gap": {"engine": "vllm", "dtype": "bfloat16", "mean_abs": 0.01,
                            "max_abs": 0.1, "tokens": 10},
            "gpu_tests": {}, "gpu_tests_passed": None, "errors": [], "wall_s": 1.0}
    assert dc.validate(good) == []
    bad = json.loads(json.dumps(good))
    del bad["learner_step_s"]
    bad["extra"] = 1
    bad["weight_sync"]["bytes"] = "many"
    bad["rollout"]["tokens_per_s"] = True
    assert sorted(dc.validate(bad)) == sorted([
        "learner_step_s: missing", "extra: not in the schema",
        "weight_sync.bytes: expected <class 'int'>, got str 'many'",
        "rollout.tokens_per_s: expected <class 'float'>, got bool True"])


def test_gpu_test_outcomes_from_real_junit(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip(reason='no')\n"
        "def test_skip(): pass\n")
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", str(tmp_path / "test_x.py")], cwd=tmp_path,
                   capture_output=True, timeout=120)
    assert dc.gpu_tests(xml) == {"test_x::test_ok": "passed", "test_x::test_bad": "failed",
                                 "test_x::test_skip": "skipped"}


def test_dry_run_of_the_whole_device_check(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, TETHER_PYTHON=sys.executable)
    r = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run", "--out", str(out),
                        "--", *SMALL], cwd=procs.ROOT, env=env, capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for step in ("1/4 machine", "2/4 model", "3/4 GPU tests", "4/4 measurements"):
        assert step in r.stdout
    report = json.loads(out.read_text())
    assert dc.validate(report) == []
    assert report["ok"] and report["dry_run"] and report["device"] == "cpu (dry run)"
    gpu = {k.rsplit("::", 1)[1] for k in report["gpu_tests"]}
    assert {"test_vllm_cuda_logprobs_match_learner_fp32", "test_inflight_keep_update_on_cuda",
            "test_fsdp2_nccl_one_rank_equals_single_process",
            "test_learner_to_vllm_weight_path_on_cuda"} <= gpu
    assert set(report["gpu_tests"].values()) == {"skipped"}  # no CUDA here
    assert report["rollout"]["engine"] == "hf" and report["vllm_tokens_per_s"] is None
    assert report["rollout"]["tokens"] >= report["rollout"]["requests"]
    assert report["weight_sync"]["bytes"] > 0 and report["weight_sync"]["load_s"] > 0
    # bf16 HF engine vs the learner's bf16 autocast on CPU: the same weights, close logprobs
    assert 0 < report["logprob_gap"]["tokens"] and report["logprob_gap"]["mean_abs"] < 0.05
    print("dry run:", json.dumps({k: report[k] for k in ("learner_step_s", "logprob_gap")}))
