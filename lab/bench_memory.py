"""Learner memory benchmark (issue #41; not a timed test): peak resident memory of the learner.

    flock /work/coord/bigmem.lock .venv/bin/python lab/bench_memory.py [--only SECTION ...]
        [--before-root PATH_TO_A_CHECKOUT_OF_MAIN] [--limit-mib 10240]

Sections (each measurement is a fresh process tree; its peak is the largest VmHWM of any of
its processes: os.wait4's ru_maxrss, which is the learner's, or the largest rank's under
torchrun; each process's VmHWM is also polled every 0.2 s: `processes`, largest first):
  long     the real learner (python -m learner) on the SmolLM2-135M preset with the simulated
           engine, completions of up to 1,024 tokens (uniform lengths), 2 steps, at 8 and at
           64 samples a step (2 x 4 and 16 x 4), single-process and two-rank FSDP2 (gloo),
           with micro-batches (--budget tokens) and activation checkpointing.
  tiny     the same learner with 4 samples of up to 16 tokens (2 prompts x 2): single vs
           two-rank FSDP2 per-rank peak (model states and copies, not activations).
  largest  a random-initialised Qwen2-shaped model (transformers Qwen2Config; vocabulary
           151,936) written once as bf16 safetensors, trained 2 steps on synthetic batches
           (tests/fsdp_worker.py's groups: 4 samples of up to 16 tokens) by the backend +
           Trainer alone, single and two-rank FSDP2, for the sizes in LARGEST; with
           --before-root also by that checkout's code (main before this issue).
A process tree that passes --limit-mib resident is killed (the machine is shared) and the
run counts as not fitting. Writes lab/results/memory.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "runs" / "models" / "smollm2-135m-instruct"
LARGEST = {  # name: (hidden, layers, heads, kv heads, intermediate) -- Qwen2 shapes
    "qwen2-0.5b": (896, 24, 14, 2, 4864),
    "qwen2-1.0b": (1536, 20, 12, 2, 8960),
    "qwen2-0.13b": (512, 8, 8, 2, 2816),
    "qwen2-2.2b": (2048, 24, 16, 2, 11008),
}
"""The sizes tried (picked from AdamW's bytes per parameter: fp32, 16: 0.5 B is 8 GB
single-process, 1.0 B is 8 GB per rank on two ranks; --param-dtype bfloat16, 8: 2.2 B is
17 GB single-process)."""


def tree_peak(cmd: list[str], env: dict, limit_mib: int, log: Path,
              timeout_s: float = 0.0) -> dict:
    """Run `cmd` in its own session; return its exit code, the tree's peak (wait4 maxrss, MiB),
    the polled VmHWM of each process (MiB, by pid and command), whether it was killed (over
    `limit_mib` resident, or still running after `timeout_s` > 0: the peak is then the peak
    so far) and its wall time."""
    start = time.monotonic()
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    hwm: dict[int, tuple[str, float]] = {}
    killed = threading.Event()
    timed_out = threading.Event()
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            total = 0.0
            for pid in _tree(p.pid):
                status = _status(pid)
                if status:
                    hwm[pid] = (status["cmd"], status["VmHWM"])
                    total += status["VmRSS"]
            late = timeout_s > 0 and time.monotonic() - start > timeout_s
            if (total > limit_mib or late) and not killed.is_set():
                (timed_out if late and total <= limit_mib else killed).set()
                for pid in _tree(p.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    _, status, usage = os.wait4(p.pid, 0)
    done.set()
    t.join()
    return {"rc": os.waitstatus_to_exitcode(status), "killed_over_limit": killed.is_set(),
            "timed_out": timed_out.is_set(), "wall_s": round(time.monotonic() - start),
            "peak_mib": round(usage.ru_maxrss / 1024, 1),
            "processes": sorted(({"cmd": c, "vmhwm_mib": round(m, 1)} for c, m in hwm.values()),
                                key=lambda r: -r["vmhwm_mib"])[:4]}


def _tree(root: int) -> list[int]:
    """`root` and its descendants (torchrun starts its workers in sessions of their own)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, pp in parent.items() if pp in frontier]
        out += frontier
    return out


def _status(pid: int) -> dict | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if "VmHWM" not in fields:
        return None
    return {"cmd": cmd, "VmHWM": int(fields["VmHWM"].split()[0]) / 1024,
            "VmRSS": int(fields["VmRSS"].split()[0]) / 1024}


def _env(root: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", *args]


def learner_run(out: Path, name: str, backend: str, prompts: int, group: int, max_new: int,
                extra: list[str], limit: int, timeout_s: float = 0.0) -> dict:
    run = out / name
    overrides = [f"run_dir={run}", f"model.path={SMOLLM2}", "actors.engine=simulated",
                 "actors.num_local=1", f"task.max_new_tokens={max_new}",
                 f"learner.prompts_per_step={prompts}",
                 f"learner.group_size={group}", "learner.max_steps=2", "task.eval_prompts=1",
                 "learner.checkpoint_every=0", "learner.tensorboard=false", "learner.overwrite=true",
                 f"learner.backend={backend}", "learner.device=cpu", *extra]
    args = ["-m", "learner", "-c", str(ROOT / "configs" / "smollm2_add.yaml"), *overrides]
    cmd = _torchrun(*args) if backend == "fsdp2" else [sys.executable, *args]
    r = tree_peak(cmd, _env(ROOT), limit, out / f"{name}.log", timeout_s)
    summary = run / "summary.json"
    r["steps"] = json.loads(summary.read_text()).get("steps") if summary.exists() else None
    r["tokens"] = [json.loads(line)["tokens"] for line in (run / "metrics.jsonl").open()] \
        if (run / "metrics.jsonl").exists() else None
    return r


def write_qwen2(path: Path, shape: tuple[int, ...]) -> int:
    """A random Qwen2-shaped model (bf16 safetensors, 1 GB shards + index) and the tiny
    tokenizer (its ids are all < the vocabulary); returns its parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from models.tiny import build_tokenizer

    hidden, layers, heads, kv, inter = shape
    config = Qwen2Config(vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv,
                         intermediate_size=inter, tie_word_embeddings=True,
                         max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    with torch.device("meta"):
        meta = Qwen2ForCausalLM(config)
    count = sum(p.numel() for p in meta.parameters())
    if (path / "config.json").exists():
        return count
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shard, size, index = {}, 0, {}

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        shard, size = {}, 0

    for name, p in meta.named_parameters():
        t = (torch.ones(p.shape) if name.endswith("norm.weight")
             else torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        if size > 1 << 30:
            flush()
    if shard:
        flush()
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": count * 2}, "weight_map": index}))
    config.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return count


TRAIN = '''
import importlib.util, sys, json, torch
sys.path.insert(0, "{tests}")
import fsdp_worker
from learner import distributed
torch.set_num_threads(1)
backend_kind, model_dir = sys.argv[1], sys.argv[2]
cfg = fsdp_worker.load_config(fsdp_worker.PRESET, [f"model.path={{model_dir}}",
      "learner.prompts_per_step=2", "learner.group_size=2", "task.max_new_tokens=16",
      "learner.correction=decoupled", f"learner.backend={{backend_kind}}", *sys.argv[3:]])
L = cfg.learner
if importlib.util.find_spec("learner.backends.registry"):  # the layout after issue #39
    from learner.algo.trainer import Trainer
    from learner.backends.registry import make_backend
    ranks = distributed.start(L.backend)
    kw = ({{"activation_checkpointing": L.activation_checkpointing}}  # after issue #41
          if hasattr(L, "activation_checkpointing") else {{}})
    from models.devices import torch_dtype
    backend = make_backend(L.backend, model_dir, L.lr, 0.0, 0, ranks.device,
                           torch_dtype(cfg.model.dtype), **kw)
else:  # main before issue #41 (--before-root)
    from learner.algo.trainer import Trainer
    ranks = distributed.start(backend_kind)
    backend = distributed.make_backend(backend_kind, model_dir, L.lr, 0.0, 0, ranks)
trainer = Trainer(cfg, backend, pad_id=0)
for step in range(2):
    m = trainer.step(fsdp_worker.synthetic_groups(cfg, step), step)
if ranks.rank == 0:
    print("STEPS_DONE", json.dumps(m))
distributed.close(ranks)
'''


def train_run(out: Path, name: str, root: Path, backend: str, model_dir: Path,
              extra: list[str], limit: int) -> dict:
    script = out / f"train_{name}.py"
    script.write_text(TRAIN.format(tests=root / "tests"))
    args = [str(script), backend, str(model_dir), *extra]
    cmd = _torchrun(*args) if backend == "fsdp2" else [sys.executable, *args]
    r = tree_peak(cmd, _env(root), limit, out / f"{name}.log")
    r["completed"] = r["rc"] == 0 and "STEPS_DONE" in (out / f"{name}.log").read_text()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=["long", "tiny", "largest"])
    ap.add_argument("--before-root", type=Path, default=None)
    ap.add_argument("--limit-mib", type=int, default=10240)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--sizes", nargs="*", default=list(LARGEST))
    ap.add_argument("--samples", nargs="*", type=int, default=[8, 64])
    ap.add_argument("--backends", nargs="*", default=["single", "fsdp2"])
    ap.add_argument("--timeout-s", type=float, default=0.0,
                    help="kill a long run still going after this many seconds (peak so far)")
    ap.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="largest, after: the backend's param_dtype (bfloat16 also sets "
                         "model.dtype); run names get a _bf16 suffix")
    ap.add_argument("--results", type=Path, default=ROOT / "lab" / "results" / "memory.json")
    a = ap.parse_args()
    out = ROOT / "runs" / "bench_memory"
    out.mkdir(parents=True, exist_ok=True)
    results_path = a.results
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    results["commit"] = commit
    scale = [f"learner.max_tokens_per_microbatch={a.budget}",
             "learner.activation_checkpointing=true"]

    def save() -> None:
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=1))

    if "long" in a.only:
        for backend in a.backends:
            for n in a.samples:
                name = f"long_{backend}_{n}"
                results.setdefault("long", {})[name] = learner_run(
                    out, name, backend, n // 4, 4, 1024, scale, a.limit_mib, a.timeout_s) | {
                    "model": "SmolLM2-135M-Instruct", "samples": n, "max_new_tokens": 1024,
                    "budget": a.budget, "activation_checkpointing": True}
                save()
    if "tiny" in a.only:
        for backend in a.backends:
            name = f"tiny_{backend}"
            results.setdefault("tiny", {})[name] = learner_run(
                out, name, backend, 2, 2, 16, [], a.limit_mib) | {
                "model": "SmolLM2-135M-Instruct", "samples": 4, "max_new_tokens": 16}
            save()
    if "largest" in a.only:
        for size in a.sizes:
            model_dir = out / "models" / size
            params = write_qwen2(model_dir, LARGEST[size])
            for backend in a.backends:
                for when, root in (("after", ROOT), ("before", a.before_root)):
                    if root is None:
                        continue
                    name = f"largest_{size}_{backend}_{when}"
                    extra = scale if when == "after" else []
                    if when == "after" and a.param_dtype == "bfloat16":
                        name += "_bf16"
                        extra = [*extra, "model.dtype=bfloat16",
                                 "learner.backend.param_dtype=bfloat16"]
                    results.setdefault("largest", {})[name] = train_run(
                        out, name, root, backend, model_dir, extra, a.limit_mib) | {
                        "parameters": params, "shape": LARGEST[size],
                        "param_dtype": a.param_dtype if when == "after" else "float32"}
                    save()
    save()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
