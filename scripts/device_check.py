"""The GPU path without vLLM, in one short run on one GPU; one JSON report (scripts/device_check.sh).

    python scripts/device_check.py --out report.json [--junit gpu_tests.xml] [--dry-run]

Built for the lent machine: one H100/H200, torch with CUDA, transformers; no vLLM, no SGLang, no
network, no model files. Models are random-initialised from real architectures' configs
(models/sizing.py: Qwen2.5-1.5B, and Qwen2.5-7B's width with 4 of its 28 layers), built on the
meta device to count them and on the GPU to train them. Steps, each timed, each recorded even
when it fails (the report says which):

    placement        two processes on one GPU refused: the config-time check (a stated
                     placement) and, on a GPU, the start-time one (`python -m learner` with a
                     learner and a local actor both wanting the only GPU); one line, exit 2
    fork_probe       an actor's start-up path up to its engine with every CUDA entry trapped
                     and NVML real (tests/cuda_probe.py --real-gpu); then a fork of that
                     process uses CUDA (it may: the parent never initialised it), and the
                     control: a fork after CUDA was initialised cannot
    learner_memory   bf16 learner steps (fp32 weights and AdamW, bf16 autocast, TF32 on) on
                     --rows x --seq tokens: median step time and the CUDA peak against
                     models/sizing.py's prediction; the full 7B's per-rank prediction for the
                     4-GPU FSDP2 preset
    engine           the HF engine on the device in this process, weights published from the
                     learner over the real ZeroMQ bucket path, rollout tokens/s and the logprob
                     gap engine vs learner (both bf16)
    actor_run        a real learner (on the CPU, bf16) with one local HF actor that the
                     placement puts on the GPU: weights published every step, evaluation on
                     the actor, the run's summary
    gpu_tests        outcome of every `pytest -m "gpu and not vllm"` test (JUnit XML)

--dry-run runs every step on the CPU (tiny configs, `cuda` replaced by `cpu` where a step needs
a device); tests/test_device_check.py runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = ("placement", "fork_probe", "learner_memory", "engine", "actor_run")
"""The measurement steps, in the order they run."""
NUM = (int, float)

SCHEMA: dict = {
    "ok": bool,
    "dry_run": bool,
    "device": str,
    "torch": str,
    "steps": dict,
    "gpu_tests": dict,
    "gpu_tests_passed": (bool, type(None)),
    "errors": list,
    "wall_s": float,
}
"""Every top-level key of the report and its type (a nested dict is a nested object)."""
STEP_SCHEMA: dict = {"ok": bool, "seconds": float, "error": (str, type(None)), "result": dict}
"""Every step's entry in `steps`."""


def validate(report: dict, schema: dict = SCHEMA, where: str = "") -> list[str]:
    """One message per missing, extra or mistyped key (empty when the report fits SCHEMA; each
    step's entry must fit STEP_SCHEMA)."""
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
    if schema is SCHEMA and isinstance(report.get("steps"), dict):
        for name, entry in report["steps"].items():
            if name not in STEPS:
                errors.append(f"steps.{name}: not a step")
            elif not isinstance(entry, dict):
                errors.append(f"steps.{name}: expected an object")
            else:
                errors += validate(entry, STEP_SCHEMA, f"steps.{name}.")
    return errors


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="device_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where the JSON report goes")
    p.add_argument("--junit", type=Path, help="JUnit XML of `pytest -m gpu` to include")
    p.add_argument("--dry-run", action="store_true", help="CPU only: no CUDA needed")
    p.add_argument("--only", default=",".join(STEPS), help="comma-separated steps to run")
    p.add_argument("--rows", type=int, default=4, help="learner step: rows")
    p.add_argument("--seq", type=int, default=512, help="learner step: tokens per row")
    p.add_argument("--steps", type=int, default=3, help="learner steps timed (after 1 warm-up)")
    p.add_argument("--requests", type=int, default=64, help="engine: concurrent requests")
    p.add_argument("--max-new", type=int, default=64, help="engine: tokens per request")
    p.add_argument("--actor-steps", type=int, default=6, help="actor_run: learner steps")
    ns = p.parse_args(argv)
    for key in ("rows", "seq", "steps", "requests", "max_new", "actor_steps"):
        if getattr(ns, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(ns, key)}")
    ns.only = [s.strip() for s in ns.only.split(",") if s.strip()]
    unknown = [s for s in ns.only if s not in STEPS]
    if unknown:
        p.error(f"--only names unknown steps {unknown}; the steps are {','.join(STEPS)}")
    return ns


def gpu_tests(junit: Path | None) -> dict[str, str]:
    """test id -> passed | failed | error | skipped, from pytest's --junitxml file."""
    if junit is None or not junit.exists():
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


def say(text: str) -> None:
    print(f"[device_check.py] {text}", flush=True)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def tiny_model(directory: Path) -> Path:
    """The warm-started tiny model, built as the learner builds it (no network)."""
    from configs.loader import load_config
    from learner.model_setup import ensure_model

    cfg = load_config(ROOT / "configs" / "toy_reverse.yaml", [f"model.path={directory / 'tiny'}"])
    return ensure_model(cfg)


# ------------------------------------------------------------------ placement
def placement(ns, work: Path, tiny: Path) -> dict:
    """Two processes on one GPU: refused at config time (stated) and, on a GPU, at start."""
    base = [sys.executable, "-m", "learner", "-c", str(ROOT / "configs" / "toy_reverse.yaml"),
            f"model.path={tiny}", f"run_dir={work / 'placement'}"]
    stated = subprocess.run([*base, "placement.gpus_per_node=1", "placement.learner=0",
                             "placement.actors=[0]", "actors.num_local=1"], capture_output=True,
                            text=True, timeout=120,
                            env=_env(), cwd=ROOT)
    out = {"stated": {"exit": stated.returncode, "stderr": stated.stderr.strip()}}
    ok = stated.returncode == 2 and stated.stderr.count("\n") <= 1 and (
        "GPU 0 is given to both learner rank 0 and actor 0" in stated.stderr)
    if not ns.dry_run:
        started = subprocess.run([*base, "learner.device=cuda", "actors.engine.device=cuda",
                                  "actors.num_local=1"], capture_output=True, text=True,
                                 timeout=120, env=_env(), cwd=ROOT)
        line = started.stderr.strip().splitlines()[-1] if started.stderr.strip() else ""
        out["at_start"] = {"exit": started.returncode, "last_line": line}
        ok = ok and started.returncode == 2 and "placement:" in line
    return {"ok": ok, **out}


# ------------------------------------------------------------------ fork probe
FORK_CHILD = """
import json, os, sys, torch
sys.path.insert(0, sys.argv[1])
from models import devices
dev = devices.resolve_device("auto", "actors.engine.device")   # what an actor asks: NVML only
if sys.argv[2] == "control":
    torch.zeros(1, device=dev)                            # CUDA initialised before the fork
pid = os.fork()
if pid == 0:
    try:
        x = torch.ones(256, 256, device=dev)
        torch.cuda.synchronize() if dev.type == "cuda" else None
        print(json.dumps({"child": "ok", "sum": float((x @ x).sum())}), flush=True)
        os._exit(0)
    except Exception as e:
        print(json.dumps({"child": "failed", "error": str(e)[:200]}), flush=True)
        os._exit(1)
_, status = os.waitpid(pid, 0)
print(json.dumps({"device": str(dev), "child_exit": os.waitstatus_to_exitcode(status)}))
"""


def fork_probe(ns, work: Path, tiny: Path) -> dict:
    flags = [] if ns.dry_run else ["--real-gpu"]
    probe = subprocess.run([sys.executable, str(ROOT / "tests" / "cuda_probe.py"), str(tiny),
                            *flags, "vllm", "sglang", "hf"], capture_output=True, text=True,
                           timeout=180, env=_env(), cwd=ROOT)
    if probe.returncode != 0:
        raise RuntimeError(f"cuda_probe exited {probe.returncode}: {probe.stderr[-1500:]}")
    runs = [json.loads(x) for x in probe.stdout.strip().splitlines()[1:]]
    reached = {r["engine"]: r["result"] for r in runs}
    out = {"start_up": reached, "hello_dtype": {r["engine"]: r.get("hello_dtype") for r in runs}}
    ok = all(v == "engine reached" for v in reached.values())
    for mode in ("clean", "control"):
        r = subprocess.run([sys.executable, "-c", FORK_CHILD, str(ROOT), mode],
                           capture_output=True, text=True, timeout=120, env=_env())
        out[f"fork_{mode}"] = {"exit": r.returncode, "stdout": r.stdout.strip()[-400:],
                               "stderr": r.stderr.strip()[-400:]}
    clean = out["fork_clean"]["stdout"]
    ok = ok and '"child_exit": 0' in clean
    if not ns.dry_run:  # after CUDA is initialised a forked child cannot use it
        ok = ok and '"child_exit": 1' in out["fork_control"]["stdout"]
    return {"ok": ok, **out}


# ------------------------------------------------------------------ learner memory
def _build(config: dict, device, directory: Path):
    """A random-initialised causal LM of `config`, fp32, on `device` (built there directly),
    with its config.json in `directory` (what the backends read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(directory)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    return model


def _meta_params(config: dict) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
    seen, n = set(), 0
    for p in model.parameters():  # a tied head is one parameter
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def learner_memory(ns, work: Path, tiny: Path) -> dict:
    import torch

    from learner.backends.single import SingleProcessBackend
    from models import devices, sizing

    device = torch.device("cpu") if ns.dry_run else torch.device("cuda", 0)
    devices.enable_tf32(device)
    small = {**sizing.QWEN25_1_5B, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 512}
    cases = ({"dry_run_small": small} if ns.dry_run else
             {"qwen2.5-1.5b": sizing.QWEN25_1_5B,
              "qwen2.5-7b-width-4-layers": {**sizing.QWEN25_7B, "num_hidden_layers": 4}})
    rows, seq = (2, 16) if ns.dry_run else (ns.rows, ns.seq)
    out: dict = {"rows": rows, "seq": seq, "dtype": "bfloat16", "models": {}}
    ok = True
    for name, config in cases.items():
        counted = _meta_params(config)
        predicted = sizing.step_peak_bytes(config, rows, seq)
        say(f"learner_memory: {name} ({counted / 1e9:.2f}B parameters) on {device}")
        model = _build(config, device, work / name)
        backend = SingleProcessBackend(work / name, 1e-6, 0.0, 0, device, torch.bfloat16,
                                       model=model)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config["vocab_size"], (rows, seq), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(ns.steps + 1):
            t0 = time.perf_counter()
            backend.step(-backend.logprobs(ids, 1.0).mean(), 1.0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        entry = {"params": counted, "params_predicted": sizing.param_count(config),
                 "step_s_median": statistics.median(times[1:]),
                 "tokens_per_s": rows * seq / statistics.median(times[1:]),
                 "peak_mib": None if peak is None else round(peak / 2**20, 1),
                 "predicted_mib": round(predicted / 2**20, 1),
                 "peak_over_predicted": None if peak is None else round(peak / predicted, 3),
                 "weights_dtype": str(next(backend.model.parameters()).dtype)}
        out["models"][name] = entry
        ok = ok and counted == entry["params_predicted"] and entry["weights_dtype"] == "torch.float32"
        if peak is not None:  # the prediction is an estimate: within 25 % either way
            ok = ok and 0.75 <= peak / predicted <= 1.25
        del backend, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    full = sizing.QWEN25_7B
    out["qwen2.5-7b_fsdp2_4_ranks_predicted_mib_per_rank"] = round(
        sizing.step_peak_bytes(full, rows, seq, ranks=4) / 2**20, 1)
    return {"ok": ok, **out}


# ------------------------------------------------------------------ engine in this process
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
            "zmq_total_s": t3 - t0}


def prompts(vocab: int, n: int, length: int) -> list:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=length).astype(np.int32) for _ in range(n)]


def logprob_gap(backend, ps: list, outs: list) -> dict:
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
    return {"mean_abs": float(g.mean()), "max_abs": float(g.max()), "tokens": int(g.size)}


def engine(ns, work: Path, tiny: Path) -> dict:
    import torch

    from actors.engines.base import GenerateRequest
    from actors.engines.hf import HFEngine
    from learner.backends.single import SingleProcessBackend
    from models import devices

    device = devices.resolve_device("cpu" if ns.dry_run else "cuda", "device_check")
    dtype = torch.bfloat16
    model_dir = tiny if ns.dry_run else None
    if model_dir is None:  # a small real architecture: Qwen2.5-1.5B's shape, 4 layers
        from models import sizing

        model_dir = work / "engine_model"
        _build({**sizing.QWEN25_1_5B, "num_hidden_layers": 4}, "cpu", model_dir).save_pretrained(
            model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    hf = HFEngine(model_dir, device, dtype)
    backend = SingleProcessBackend(model_dir, 1e-6, 0.0, 0, device, dtype)
    sync = weight_sync(backend, hf.load_packed, version=1)
    n, max_new = (8, 4) if ns.dry_run else (ns.requests, ns.max_new)
    ps = prompts(vocab, n, 16 if ns.dry_run else 64)
    t0 = time.perf_counter()
    outs = hf.generate([GenerateRequest(p, max_new, 1.0, seed=i) for i, p in enumerate(ps)])
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for c in outs)
    gap = logprob_gap(backend, ps[:8], outs[:8])
    ok = (tokens >= n and sync["bytes"] > 0 and gap["tokens"] > 0 and gap["mean_abs"] < 0.05
          and all((c.versions == 1).all() for c in outs))
    return {"ok": ok, "device": str(device), "dtype": "bfloat16", "model": model_dir.name,
            "weight_sync": sync, "rollout": {"requests": n, "tokens": tokens, "seconds": wall,
                                             "tokens_per_s": tokens / wall},
            "logprob_gap": gap}


# ------------------------------------------------------------------ a real run
def actor_run(ns, work: Path, tiny: Path) -> dict:
    run = work / "actor_run"
    device = "cpu" if ns.dry_run else "cuda"
    steps = 2 if ns.dry_run else ns.actor_steps
    r = subprocess.run([sys.executable, "-m", "learner", "-c",
                        str(ROOT / "configs" / "toy_reverse.yaml"), f"model.path={tiny}",
                        f"run_dir={run}", "learner.device=cpu", f"actors.engine.device={device}",
                        "actors.num_local=1", "model.dtype=bfloat16", f"learner.max_steps={steps}",
                        "task.eval_prompts=16", "learner.checkpoint_every=0"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"learner exited {r.returncode}: {r.stderr[-2000:]}")
    s = json.loads((run / "summary.json").read_text())
    actor_log = (run / "logs" / "actor-0.log").read_text()
    engine_line = next((ln for ln in actor_log.splitlines() if "engine hf on" in ln), "")
    loaded = actor_log.count("loaded weights v")
    want = f"engine hf on {'cpu' if ns.dry_run else 'cuda:0'} in bfloat16 (CUDA_VISIBLE_DEVICES=" \
           f"'{'' if ns.dry_run else '0'}')"
    ok = (s["steps"] == steps and s["accounting_ok"] and want in engine_line
          and s["evaluations"]["end"]["samples"] == 16 and loaded >= 2)
    return {"ok": ok, "steps": s["steps"], "wall_s": s["wall_seconds"],
            "eval_reward_start": s["eval_reward_start"], "eval_reward_end": s["eval_reward_end"],
            "evaluations": s["evaluations"], "accounting_ok": s["accounting_ok"],
            "engine_line": engine_line.split("] ")[-1], "weight_loads": loaded}


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    t0 = time.monotonic()
    import torch

    from models import devices

    if not ns.dry_run and devices.cuda_count() <= 0:
        print("device_check.py: no CUDA device (NVML counts none); use --dry-run", file=sys.stderr)
        return 2
    report = {"ok": False, "dry_run": ns.dry_run, "torch": torch.__version__, "steps": {},
              "device": "cpu (dry run)" if ns.dry_run else "", "gpu_tests": gpu_tests(ns.junit),
              "gpu_tests_passed": None, "errors": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny = tiny_model(work)
        for name in ns.only:
            say(f"{name} ...")
            t = time.monotonic()
            entry = {"ok": False, "seconds": 0.0, "error": None, "result": {}}
            try:  # a failed step is a finding of the check: recorded, the next step runs
                result = globals()[name](ns, work, tiny)
                entry["ok"], entry["result"] = bool(result.pop("ok")), result
            except Exception:
                entry["error"] = traceback.format_exc(limit=6)[-3000:]
            entry["seconds"] = round(time.monotonic() - t, 2)
            report["steps"][name] = entry
            say(f"{name}: {'ok' if entry['ok'] else 'FAILED'} in {entry['seconds']:.1f}s")
    if not ns.dry_run:
        report["device"] = torch.cuda.get_device_name(0)
    tests = report["gpu_tests"]
    bad = ("failed", "error") if ns.dry_run else ("failed", "error", "skipped")
    report["errors"] = ([f"gpu test {k} {v}" for k, v in tests.items() if v in bad]
                        + [f"step {k} failed" for k, v in report["steps"].items() if not v["ok"]])
    report["gpu_tests_passed"] = not any(v in bad for v in tests.values()) if tests else None
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
