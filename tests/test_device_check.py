"""scripts/device_check.sh and scripts/device_check.py without CUDA: argument errors, the JSON
schema, the JUnit reading, and a whole dry run (every step on the CPU: placement refusal, the
fork probe, bf16 learner steps, the HF engine fed over ZeroMQ, a real learner with a local
actor; the GPU tests collected and skipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import procs

sys.path.insert(0, str(procs.ROOT / "scripts"))
import device_check as dc  # noqa: E402


def test_arguments_are_checked(capsys):
    with pytest.raises(SystemExit):
        dc.parse_args([])
    assert "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dc.parse_args(["--dry-run", "--out", "r.json", "--rows", "0"])
    assert "--rows must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dc.parse_args(["--out", "r.json", "--only", "placement,nope"])
    assert "--only names unknown steps ['nope']" in capsys.readouterr().err
    ns = dc.parse_args(["--out", "r.json"])
    assert ns.only == list(dc.STEPS) and not ns.dry_run and (ns.rows, ns.seq) == (4, 512)


def test_shell_script_rejects_unknown_arguments():
    r = subprocess.run(["bash", "scripts/device_check.sh", "--gpu"], cwd=procs.ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "unknown argument --gpu" in r.stderr


def _good() -> dict:
    step = {"ok": True, "seconds": 1.0, "error": None, "result": {}}
    return {"ok": True, "dry_run": False, "device": "NVIDIA H100", "torch": "2.11.0",
            "steps": {"placement": dict(step), "engine": dict(step)}, "gpu_tests": {},
            "gpu_tests_passed": None, "errors": [], "wall_s": 1.0}


def test_schema_flags_missing_extra_and_mistyped_keys():
    assert dc.validate(_good()) == []
    bad = json.loads(json.dumps(_good()))
    del bad["wall_s"]
    bad["extra"] = 1
    bad["steps"]["engine"]["seconds"] = "long"
    bad["steps"]["warp"] = {}
    assert sorted(dc.validate(bad)) == sorted([
        "wall_s: missing", "extra: not in the schema",
        "steps.engine.seconds: expected <class 'float'>, got str 'long'", "steps.warp: not a step"])


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
    r = subprocess.run(["bash", "scripts/device_check.sh", "--dry-run", "--out", str(out)],
                       cwd=procs.ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    for step in ("1/4 machine", "2/4 environment", "3/4 GPU tests", "4/4 measurements"):
        assert step in r.stdout
    report = json.loads(out.read_text())
    assert dc.validate(report) == []
    assert report["ok"] and report["dry_run"] and report["device"] == "cpu (dry run)"
    assert list(report["steps"]) == list(dc.STEPS)
    gpu = {k.rsplit("::", 1)[1] for k in report["gpu_tests"]}
    assert {"test_fsdp2_nccl_one_rank_equals_single_process",
            "test_auto_dtype_is_bf16_and_tf32_is_on_for_the_cuda_learner",
            "test_bf16_adamw_on_cuda_is_fp32_adamw_rounded_to_a_neighbour",
            "test_bf16_weights_train_on_cuda", "test_packed_rows_stay_apart_on_cuda_in_bf16"} == gpu
    assert set(report["gpu_tests"].values()) == {"skipped"}  # no CUDA here
    steps = {k: v["result"] for k, v in report["steps"].items()}
    assert "GPU 0 is given to both learner rank 0 and actor 0" in steps["placement"]["stated"]["stderr"]
    assert set(steps["fork_probe"]["start_up"].values()) == {"engine reached"}
    small = steps["learner_memory"]["models"]["dry_run_small"]
    assert small["params"] == small["params_predicted"] and small["weights_dtype"] == "torch.float32"
    # bf16 HF engine vs the learner's bf16 autocast on CPU: the same weights, close logprobs
    assert steps["engine"]["logprob_gap"]["mean_abs"] < 0.05
    assert steps["actor_run"]["steps"] == 2 and steps["actor_run"]["accounting_ok"]
    print("dry run step seconds:", {k: v["seconds"] for k, v in report["steps"].items()})
