"""Measure the GPU path in one short run and write one JSON report (scripts/device_check.sh).

    python scripts/device_check.py --model DIR --out report.json [--junit gpu_tests.xml]
    python scripts/device_check.py --dry-run --out report.json      # CPU: HF engine, tiny model

On CUDA: vLLM (actors/engines/vllm/engine.py) and the learner (learner/backends/base.py) share one GPU:
vLLM starts first with `--kv-cache-gb` of KV cache (vLLM wants 90 % of the memory free when
it starts), the learner takes what it needs after it. Measured:

    rollout        tokens/s of `--requests` concurrent requests through the engine
    learner_step_s forward + backward + AdamW on a `--batch` x `--seq` token batch (median)
    weight_sync    the real ZeroMQ path: gather + pack into buckets, send over a PUSH/PULL
                   pair on 127.0.0.1, load into the engine (cuda_ipc / nccl: not built)
    logprob_gap    engine behavior logprobs vs the learner's recomputed ones, both in --dtype
    gpu_tests      outcome of every @pytest.mark.gpu test, read from pytest's JUnit XML

--dry-run runs every piece that needs no CUDA: the HF engine instead of vLLM, on CPU, with the
tiny model when no --model is given; tests/test_device_check.py runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA: dict = {
    "ok": bool,
    "dry_run": bool,
    "device": str,
    "model": str,
    "dtype": str,
    "rollout": {"engine": str, "tokens_per_s": float, "tokens": int, "requests": int,
                "seconds": float},
    "vllm_tokens_per_s": (float, type(None)),
    "learner_step_s": float,
    "weight_sync": {"bytes": int, "buckets": int, "gather_pack_s": float, "transfer_s": float,
                    "load_s": float, "zmq_total_s": float, "cuda_ipc_s": type(None),
                    "nccl_s": type(None)},
    "logprob_gap": {"engine": str, "dtype": str, "mean_abs": float, "max_abs": float,
                    "tokens": int},
    "gpu_tests": dict,
    "gpu_tests_passed": (bool, type(None)),
    "errors": list,
    "wall_s": float,
}
"""Every key of the report and its type (a nested dict is a nested object)."""


def validate(report: dict, schema: dict = SCHEMA, where: str = "") -> list[str]:
    """One message per missing, extra or mistyped key (empty when the report fits SCHEMA)."""
    errors = [f"{where}{k}: missing" for k in schema if k not in report]
    errors += [f"{where}{k}: not in the schema" for k in report if k not in schema]
    for k, want in schema.items():
        if k not in report:
            continue
        got = report[k]
        if isinstance(want, dict):
            if not isinstance(got, dict):
                errors.append(f"{where}{k}: expected an object, got {type(got).__name__}")
            else:
                errors += validate(got, want, f"{where}{k}.")
        elif not isinstance(got, want) or (want is float and isinstance(got, bool)):
            errors.append(f"{where}{k}: expected {want}, got {type(got).__name__} {got!r}")
    return errors


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="device_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="HF model directory (default with --dry-run: "
                   "the tiny model, built in a temporary directory)")
    p.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    p.add_argument("--junit", type=Path, help="JUnit XML of `pytest -m gpu` to include")
    p.add_argument("--dry-run", action="store_true", help="CPU, HF engine: no CUDA needed")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--kv-cache-gb", type=float, default=4.0, help="vLLM's share of the GPU")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="learner step: rows")
    p.add_argument("--seq", type=int, default=512, help="learner step: tokens per row")
    p.add_argument("--steps", type=int, default=5, help="learner steps timed (after 1 warm-up)")
    p.add_argument("--gap-rows", type=int, default=32, help="completions compared for the gap")
    ns = p.parse_args(argv)
    if not ns.dry_run and ns.model is None:
        p.error("--model is required without --dry-run")
    for key in ("requests", "prompt_len", "max_new", "batch", "seq", "steps", "gap_rows"):
        if getattr(ns, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(ns, key)}")
    if ns.kv_cache_gb <= 0:
        p.error(f"--kv-cache-gb must be > 0, got {ns.kv_cache_gb}")
    return ns


def gpu_tests(junit: Path | None) -> dict[str, str]:
    """test id -> passed | failed | error | skipped, from pytest's --junitxml file."""
    if junit is None:
        return {}
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name')}"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        out[name] = outcome
    return out


def tiny_model(directory: Path) -> Path:
    """The warm-started tiny model, built as the learner builds it (no network)."""
    from configs.loader import load_config
    from learner.model_setup import ensure_model

    cfg = load_config(ROOT / "configs" / "toy_reverse.yaml", [f"model.path={directory / 'tiny'}"])
    return ensure_model(cfg)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def learner_step_s(backend, vocab: int, batch: int, seq: int, steps: int) -> float:
    """Median seconds of one forward + backward + AdamW step on random tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(backend.device)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = -backend.logprobs(ids, 1.0).mean()
        backend.step(loss, 1.0)
        _sync(backend.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def weight_sync(backend, load, version: int, bucket_bytes: int = 32 << 20) -> dict:
    """The ZeroMQ bucket path as the learner and actors run it, timed piece by piece."""
    import msgspec
    import zmq

    from transport import messages as m
    from transport.weights import pack

    t0 = time.perf_counter()
    packed = pack(backend.named_full_tensors(), version, bucket_bytes)
    t1 = time.perf_counter()
    ctx = zmq.Context()
    with ctx.socket(zmq.PULL) as pull, ctx.socket(zmq.PUSH) as push:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart([msgspec.msgpack.encode(packed.manifest), *packed.buckets],
                            copy=False)
        head, *buckets = pull.recv_multipart(copy=False)
        manifest = msgspec.msgpack.Decoder(m.WeightManifest).decode(head.buffer)
        buckets = [b.buffer for b in buckets]
        t2 = time.perf_counter()
    ctx.term()
    load(manifest, buckets)
    t3 = time.perf_counter()
    return {"bytes": manifest.total_bytes, "buckets": manifest.num_buckets,
            "gather_pack_s": t1 - t0, "transfer_s": t2 - t1, "load_s": t3 - t2,
            "zmq_total_s": t3 - t0, "cuda_ipc_s": None, "nccl_s": None}


def prompts(vocab: int, n: int, length: int) -> list:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=length).astype(np.int32) for _ in range(n)]


class HFRollout:
    """The HF engine (actors/engines/hf.py) behind the same three calls as VLLMRollout."""

    name = "hf"

    def __init__(self, model_dir: Path, device, dtype) -> None:
        from actors.engines.hf import HFEngine

        self.engine = HFEngine(model_dir, device, dtype)

    def load(self, manifest, buckets) -> None:
        self.engine.load_packed(manifest, buckets)

    def generate(self, ps: list, max_new: int) -> list:
        from actors.engines.base import GenerateRequest

        return self.engine.generate([GenerateRequest(p, max_new, 1.0, seed=i)
                                     for i, p in enumerate(ps)])

    def close(self) -> None:
        pass


class VLLMRollout:
    """actors/engines/vllm/engine.py's VLLMEngine, driven from its own event loop."""

    name = "vllm"

    def __init__(self, model_dir: Path, dtype: str, kv_cache_gb: float, max_num_seqs: int) -> None:
        from actors.engines.vllm.engine import VLLMEngine

        self.loop = asyncio.new_event_loop()
        self.engine = self.loop.run_until_complete(asyncio.to_thread(
            VLLMEngine, model_dir, "keep", 0, kv_cache_gb, True, max_num_seqs, dtype))

    def load(self, manifest, buckets) -> None:
        self.loop.run_until_complete(self.engine.load_packed(manifest, buckets))

    def generate(self, ps: list, max_new: int) -> list:
        async def run():
            return await asyncio.gather(*(self.engine.generate(p, max_new, 1.0, seed=i)
                                          for i, p in enumerate(ps)))
        return self.loop.run_until_complete(run())

    def close(self) -> None:
        self.engine.shutdown()
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()


def rollout(engine, ps: list, max_new: int) -> tuple[list, dict]:
    t0 = time.perf_counter()
    outs = engine.generate(ps, max_new)
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in outs)
    return outs, {"engine": engine.name, "tokens_per_s": tokens / wall, "tokens": tokens,
                  "requests": len(ps), "seconds": wall}


def logprob_gap(backend, ps: list, outs: list, engine: str, dtype: str) -> dict:
    """|engine behavior logprob - learner logprob| over every generated token."""
    import numpy as np
    import torch

    gaps = []
    with torch.no_grad():
        for p, c in zip(ps, outs):
            ids = torch.from_numpy(np.concatenate([p, c.token_ids]).astype(np.int64))[None]
            lp = backend.logprobs(ids.to(backend.device), 1.0)[0, len(p) - 1:].float().cpu().numpy()
            gaps.append(np.abs(lp - c.logprobs))
    g = np.concatenate(gaps)
    return {"engine": engine, "dtype": dtype, "mean_abs": float(g.mean()),
            "max_abs": float(g.max()), "tokens": int(g.size)}


def measure(ns: argparse.Namespace, model_dir: Path) -> dict:
    import torch

    from learner.backends.single import SingleProcessBackend
    from models import devices

    dtype = devices.torch_dtype(ns.dtype)
    device = devices.resolve_device("cpu" if ns.dry_run else "cuda", "device_check --dry-run")
    devices.limit_cpu_threads(device)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(f"[device_check] engine start ({'hf, cpu' if ns.dry_run else 'vllm, cuda'})", flush=True)
    engine = (HFRollout(model_dir, device, dtype) if ns.dry_run
              else VLLMRollout(model_dir, ns.dtype, ns.kv_cache_gb, ns.requests))
    try:
        print("[device_check] learner on", device, flush=True)
        backend = SingleProcessBackend(model_dir, 1e-6, 0.0, 0, device, dtype)
        print("[device_check] weight sync learner -> engine over ZeroMQ", flush=True)
        sync = weight_sync(backend, engine.load, version=1)
        ps = prompts(vocab, ns.requests, ns.prompt_len)
        print(f"[device_check] rollout: {ns.requests} requests x {ns.max_new} tokens", flush=True)
        outs, roll = rollout(engine, ps, ns.max_new)
        print("[device_check] logprob gap engine vs learner", flush=True)
        gap = logprob_gap(backend, ps[:ns.gap_rows], outs[:ns.gap_rows], engine.name, ns.dtype)
        print(f"[device_check] learner step: {ns.batch} x {ns.seq} tokens", flush=True)
        step = learner_step_s(backend, vocab, ns.batch, ns.seq, ns.steps)
    finally:
        engine.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    return {"device": name, "rollout": roll, "learner_step_s": step, "weight_sync": sync,
            "logprob_gap": gap,
            "vllm_tokens_per_s": roll["tokens_per_s"] if isinstance(engine, VLLMRollout) else None}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    t0 = time.monotonic()
    tests = gpu_tests(ns.junit)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = ns.model if ns.model is not None else tiny_model(Path(tmp))
        report = {"ok": False, "dry_run": ns.dry_run, "model": str(model_dir), "dtype": ns.dtype,
                  **measure(ns, model_dir), "gpu_tests": tests,
                  "gpu_tests_passed": None, "errors": []}
    # On a GPU a skipped GPU test is a failure of the check; in a dry run all of them skip.
    bad = ("failed", "error") if ns.dry_run else ("failed", "error", "skipped")
    report["errors"] = [f"gpu test {k} {v}" for k, v in tests.items() if v in bad]
    report["gpu_tests_passed"] = not report["errors"] if tests else None
    report["wall_s"] = time.monotonic() - t0
    report["ok"] = not report["errors"]
    problems = validate(report)
    if problems:
        raise AssertionError(f"report does not fit SCHEMA: {problems}")
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
