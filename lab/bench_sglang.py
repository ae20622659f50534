"""SGLang rows of Tether's benchmarks (lab/bench.py runs in the main venv; SGLang has its own).

    PYTHONPATH=tests/sglang_cpu_shim .venv-sglang/bin/python lab/bench_sglang.py   # CPU
    .venv-sglang/bin/python lab/bench_sglang.py                                   # GPU

Same 64 requests x `--batches` rounds through SGLang's bare `Engine.async_generate` and through
our actor's SGLangEngine (ratio), and the time to apply one weight version from Tether's buckets
(pause, begin / update_weights_from_tensor per bucket / end, continue). Writes
OUT/bench_sglang.json (default runs/bench) and prints the table rows; `lab/bench.py`
(section sglang) runs it this way from the main venv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def bench_sglang(model_dir: Path, batches: int) -> dict:
    from safetensors.torch import load_file

    from actors.engines.sglang.engine import SGLangEngine
    from transport.weights import pack

    prompt = [1, 4, 7, 8, 9, 6, 5]
    packed = pack(load_file(str(model_dir / "model.safetensors")), 0, 32 << 20)

    async def run() -> dict:
        engine = await asyncio.to_thread(SGLangEngine, model_dir, "keep", 0, 8192, 0.0)
        await engine.load_packed(packed.manifest, list(packed.buckets))

        async def bare_one(i: int) -> int:
            out = await engine.engine.async_generate(
                input_ids=prompt, return_logprob=True,
                sampling_params={"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": i})
            return len(out["output_ids"])

        async def ours_one(i: int) -> int:
            return len((await engine.generate(np.array(prompt), 5, 1.0, i)).token_ids)

        async def timed(fn) -> float:
            t0, n = time.perf_counter(), 0
            for b in range(batches):
                n += sum(await asyncio.gather(*(fn(b * 64 + i) for i in range(64))))
            return n / (time.perf_counter() - t0)

        await timed(bare_one)  # warm-up
        bare, ours = await timed(bare_one), await timed(ours_one)
        t0 = time.perf_counter()
        for v in range(1, 11):
            await engine.load_packed(packed.manifest, list(packed.buckets))
        apply_ms = (time.perf_counter() - t0) / 10 * 1e3
        engine.shutdown()
        return {"sglang_bare_tokens_per_s": bare, "sglang_via_actor_engine_tokens_per_s": ours,
                "ours_vs_bare": ours / bare, "sglang_apply_ms": apply_ms,
                "weights_MB": packed.manifest.total_bytes / 1e6}

    return asyncio.run(run())


def render(s: dict) -> str:
    return "\n".join([
        f"| rollout tokens/s, SGLang | via actor engine {s['sglang_via_actor_engine_tokens_per_s']:.0f} | "
        f"bare Engine {s['sglang_bare_tokens_per_s']:.0f} | {s['ours_vs_bare']:.2f} |",
        f"| apply weights, SGLang engine ({s['weights_MB']:.2f} MB: pause, buckets, continue) | "
        f"{s['sglang_apply_ms']:.1f} ms | | |"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench")
    ns = p.parse_args()
    from configs.loader import load_config
    from learner.model_setup import ensure_model

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / "configs" / "toy_reverse.yaml", [f"model.path={tmp}/tiny"])
        res = bench_sglang(ensure_model(cfg), ns.batches)
    out = ns.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_sglang.json").write_text(json.dumps(res, indent=2))
    print(render(res))


if __name__ == "__main__":
    main()
