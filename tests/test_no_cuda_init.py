"""An actor never initialises CUDA before its engine starts (models/devices.py): its start-up
path, run in a fresh process with every CUDA runtime entry trapped and NVML reporting two GPUs
(tests/cuda_probe.py), reaches the engine's construction without one CUDA call, and
`model.dtype: auto` resolves to bfloat16 there. The probe's own control, in the same process:
the path with the old `torch.cuda.is_available()` device check is caught."""

from __future__ import annotations

import json
import subprocess
import sys

import procs


def test_actor_start_up_reaches_its_engine_without_a_cuda_call(tiny_model_dir):
    r = subprocess.run([sys.executable, "tests/cuda_probe.py", str(tiny_model_dir), "--control",
                        "vllm", "sglang", "hf"], cwd=procs.ROOT, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    patched, *runs = lines
    assert {"torch.cuda.is_available", "torch.cuda._lazy_init",
            "torch._C._cuda_getDeviceCount"} <= set(patched["patched"])
    out = {o["engine"]: o for o in runs}
    for engine in ("vllm", "sglang", "hf"):
        assert out[engine]["result"] == "engine reached", out[engine]
        assert out[engine]["hello_dtype"] == "bfloat16", out[engine]  # auto on a GPU engine
    vllm = out["vllm"]["call"]["kwargs"]
    assert vllm["dtype"] == "bfloat16"
    assert vllm["enforce_eager"] == "False"  # CUDA graphs on by default on a GPU
    assert (vllm["gpu_memory_utilization"], vllm["tensor_parallel_size"], vllm["max_model_len"],
            vllm["enable_prefix_caching"]) == ("0.9", "1", "0", "True")
    assert out["sglang"]["call"]["kwargs"]["dtype"] == "bfloat16"
    assert out["sglang"]["call"]["kwargs"]["cpu"] == "False"
    assert out["hf"]["call"]["args"][1:3] == ["cuda:0", "torch.bfloat16"]
    assert out["control"]["result"] == ("CUDA called before the engine: "
                                        "torch.cuda.is_available"), out["control"]
