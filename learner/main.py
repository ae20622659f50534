"""The learner process: wires every component together and runs the training loop.

    actors (PUSH) ──trajectories──▶ [I/O thread: validate ─▶ ReplayBuffer] ──take()──▶ trainer
    actors (DEALER) ◀─control───▶ [I/O thread: leases, heartbeats]                      │
    actors (DEALER) ◀─weights──── [I/O thread: buckets of version v] ◀──publish(v+1)────┘

The trainer thread waits in `buffer.take()` for `prompts_per_step` fresh groups (logging what it
waits for every few seconds, so a stall is never silent), trains one step, and publishes the
next version. The I/O thread (learner/server.py) never waits on the trainer.

With `learner.backend=fsdp2` under torchrun, only rank 0 runs this loop (and owns sockets,
buffer, leases, actors, files); the other ranks follow its commands (learner/distributed.py).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from buffer.replay import ReplayBuffer
from configs.loader import save_config
from configs.schema import TetherConfig
from learner import distributed, tracking
from learner.evaluate import evaluate
from learner.leases import LeaseTable
from learner.metrics import MetricsLog
from learner.model_setup import ensure_model
from learner.server import LearnerServer
from learner.trainer import Trainer
from transport.weights import PackedWeights, unpack, write_file

log = logging.getLogger(__name__)

WAIT_LOG_S = 5.0
"""While waiting for trajectories, say what is missing this often."""


def run(cfg: TetherConfig) -> dict | None:
    """Run the learner; returns the summary on rank 0 and None on the other ranks."""
    from transformers.utils import logging as hf_logging

    from models.tiny import load_tokenizer

    tracking.require(cfg)
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    t0 = time.monotonic()
    ranks = distributed.start(cfg.learner.backend)
    run_dir = Path(cfg.run_dir)
    if ranks.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        ensure_model(cfg)
    distributed.barrier(ranks)
    model_dir = Path(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    L = cfg.learner
    backend = distributed.make_backend(L.backend, model_dir, L.lr, L.weight_decay, L.seed, ranks)
    trainer = Trainer(cfg, backend, pad_id=tokenizer.pad_token_id)
    checkpoint = _latest_checkpoint(run_dir) if L.resume else None
    if ranks.rank > 0:
        if checkpoint is not None:
            backend.load_checkpoint(checkpoint)
        distributed.follow(trainer, backend, ranks)
        distributed.close(ranks)
        return None
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM = Ctrl-C: checkpoint, stop actors, exit
    team = distributed.Leader(trainer, backend, ranks, cfg.transport.weight_bucket_bytes)
    summary = _lead(cfg, team, tokenizer, checkpoint, t0)
    distributed.close(ranks)
    return summary


def _lead(cfg: TetherConfig, team: distributed.Leader, tokenizer, checkpoint: Path | None,
          t0: float) -> dict:
    """Rank 0: the sockets, the buffer and the training loop."""
    from actors.hf_engine import HFEngine
    from tasks import make_task

    run_dir, model_dir = Path(cfg.run_dir), Path(cfg.model.path)
    task = make_task(cfg.task, tokenizer, seed=cfg.learner.seed)
    buffer = ReplayBuffer(cfg.buffer.capacity_groups, cfg.max_staleness, cfg.buffer.max_reuse,
                          cfg.buffer.sampling, seed=cfg.learner.seed)
    leases = LeaseTable(task, cfg.learner.prompts_per_step, cfg.learner.group_size,
                        cfg.max_staleness)
    version = 0
    if checkpoint is not None:
        version = _restore(team.backend, leases, buffer, checkpoint)
    packed = team.publish(version)
    eval_engine = HFEngine(model_dir)
    eval_start = _evaluate(eval_engine, packed, task, cfg, tokenizer)
    log.info("held-out reward at v%d: %.3f", version, eval_start)

    if checkpoint is not None:
        _reuse_ports(cfg, run_dir)
    server = LearnerServer(cfg, buffer, leases, model_dir, team.backend.model.config.vocab_size,
                           version)
    server.publish(version, _for_actors(cfg, packed))
    (run_dir / "endpoints.json").write_text(json.dumps(server.endpoints, indent=1))
    server.start()
    log.info("learner listening: %s", server.endpoints)
    actors = _spawn_local_actors(cfg, server.endpoints["control"], run_dir)
    metrics = MetricsLog(run_dir / "metrics.jsonl", cfg,
                         resume_version=version if checkpoint is not None else None)
    reason = "finished"
    try:
        while version < cfg.learner.max_steps:
            team.check_interrupt()
            groups = buffer.take(cfg.learner.prompts_per_step, version, timeout=WAIT_LOG_S)
            if groups is None:
                _log_waiting(server, buffer, version, actors)
                team.idle()
                continue
            step_t0 = time.monotonic()
            m = team.step(groups, version)
            version += 1
            packed = team.publish(version)
            server.publish(version, _for_actors(cfg, packed))
            metrics.record(version, m, step_t0, server.snapshot(), buffer.counts())
            if cfg.learner.checkpoint_every and version % cfg.learner.checkpoint_every == 0:
                _save_checkpoint(team, server, run_dir, version)
    except KeyboardInterrupt:
        reason = "interrupted"
        log.warning("interrupted at v%d: saving a checkpoint", version)
    finally:
        server.stop(reason)
        buffer.close()
        metrics.close()
        _reap(actors)
    if not (run_dir / "checkpoints" / f"step_{version}").exists():
        _save_checkpoint(team, server, run_dir, version)
    eval_end = _evaluate(eval_engine, packed, task, cfg, tokenizer)
    team.export_hf(run_dir / "final_model")
    team.stop()
    summary = _summary(cfg, eval_start, eval_end, version, time.monotonic() - t0, server, buffer,
                       metrics, reason)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    metrics.finish(summary)
    _log_summary(summary)
    return summary


def _for_actors(cfg: TetherConfig, packed: PackedWeights) -> PackedWeights:
    """Version `packed` as actors will fetch it: the byte buckets themselves, or a file on
    shared storage (kept for max_staleness + 3 versions, so a slow actor still finds the one
    it was told about)."""
    t = cfg.transport
    if t.weights_via != "filesystem":
        return packed
    directory = Path(t.weights_dir or Path(cfg.run_dir) / "weights")
    state = unpack(packed.manifest, list(packed.buckets))
    return write_file(state, packed.manifest.version, directory, keep=cfg.max_staleness + 3)


def _evaluate(engine, packed: PackedWeights, task, cfg: TetherConfig, tokenizer) -> float:
    """Held-out reward of the published weights `packed` (no second gather of the model)."""
    engine.load_weights(unpack(packed.manifest, list(packed.buckets)), packed.manifest.version)
    return evaluate(engine, task, cfg, tokenizer)


def _log_summary(summary: dict) -> None:
    log.info("done: %s", json.dumps({k: summary[k] for k in
                                      ("eval_reward_start", "eval_reward_end", "steps",
                                       "wall_seconds", "accounting_ok")}))
    g = summary["groups"]
    log.info("accounting (groups): granted %d = consumed %d + dropped %s + outstanding %d + "
             "in buffer %d -> %s; rejected messages %s", g["granted"], g["consumed"], g["dropped"],
             g["outstanding"], g["in_buffer"], "ok" if summary["accounting_ok"] else "MISMATCH",
             summary["rejected_messages"])


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _spawn_local_actors(cfg: TetherConfig, endpoint: str, run_dir: Path) -> list[subprocess.Popen]:
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    procs = []
    for i in range(cfg.actors.num_local):
        out = open(logs / f"actor-{i}.log", "ab")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "actors", "-c", str(run_dir / "config.yaml"),
             "--actor-id", f"local-{i}", "--exit-with-parent", endpoint],
            stdout=out, stderr=subprocess.STDOUT))
        out.close()
    if procs:
        log.info("started %d local actor(s); logs in %s", len(procs), logs)
    return procs


def _reap(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """Actors exit on the Shutdown message; anything still alive after `timeout` is killed."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("actor pid %d did not exit; killing it", p.pid)
            p.kill()
            p.wait()


def _log_waiting(server: LearnerServer, buffer: ReplayBuffer, version: int,
                 actors: list[subprocess.Popen]) -> None:
    snap = server.snapshot()
    dead = [p.pid for p in actors if p.poll() is not None]
    log.info("v%d waiting for trajectories: buffer %d, actors connected %d, leases outstanding %d%s",
             version, len(buffer), snap["actors_connected"], snap["leases"]["outstanding"],
             f", local actor pid(s) {dead} exited" if dead else "")
    if actors and len(dead) == len(actors) and snap["actors_connected"] == 0:
        raise RuntimeError("every local actor process has exited; see run_dir/logs/actor-*.log")


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a `step_N.tmp` left by a crash is not one)."""
    dirs = [p for p in (run_dir / "checkpoints").glob("step_*") if p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def _latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = _checkpoint_dirs(run_dir)
    if not dirs:
        raise FileNotFoundError(f"learner.resume is true but {run_dir}/checkpoints has none")
    return dirs[-1]


def _save_checkpoint(team: distributed.Leader, server: LearnerServer, run_dir: Path,
                     version: int) -> None:
    snap = server.snapshot()
    state, arrays = server.checkpoint_state()
    path = run_dir / "checkpoints" / f"step_{version}"
    tmp = path.with_name(path.name + ".tmp")
    team.save_checkpoint(tmp, {"version": version, **state})
    np.savez(tmp / "buffer.npz", **arrays)
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    log.info("checkpoint v%d saved to %s (%d actors connected)", version, path,
             snap["actors_connected"])


def _restore(backend, leases: LeaseTable, buffer: ReplayBuffer, path: Path) -> int:
    state = backend.load_checkpoint(path)
    leases.load_state(state["leases"])
    with np.load(path / "buffer.npz", allow_pickle=False) as arrays:
        buffer.restore(state["buffer"], arrays)
    log.info("resumed from %s at v%d (prompt cursor %d, %d leases outstanding, %d groups "
             "buffered)", path, state["version"], leases.cursor, len(leases.outstanding), len(buffer))
    return int(state["version"])


def _reuse_ports(cfg: TetherConfig, run_dir: Path) -> None:
    """On resume, bind the ports of the previous run (where the config says "any free port"),
    so running actors reconnect to the new process by themselves."""
    old = run_dir / "endpoints.json"
    if not old.exists():
        return
    eps = json.loads(old.read_text())
    t = cfg.transport
    for name in ("control", "trajectory", "weights"):
        if getattr(t, f"{name}_port") == 0:
            setattr(t, f"{name}_port", int(eps[name].rsplit(":", 1)[1]))


def _summary(cfg, eval_start, eval_end, version, wall, server, buffer, metrics, reason) -> dict:
    snap = server.snapshot()
    lc, bc = snap["leases"], buffer.counts()
    dropped = dict(lc["dropped"])
    for k, v in bc["dropped"].items():
        dropped[k] = dropped.get(k, 0) + v
    accounted = bc["consumed"] + sum(dropped.values()) + lc["outstanding"] + bc["size"]
    return {
        "eval_reward_start": eval_start, "eval_reward_end": eval_end, "steps": version,
        "wall_seconds": round(wall, 2), "end_reason": reason, "max_staleness": cfg.max_staleness,
        "correction": cfg.learner.correction,
        "groups": {"granted": lc["granted"], "consumed": bc["consumed"], "dropped": dropped,
                   "outstanding": lc["outstanding"], "in_buffer": bc["size"]},
        "buffer": bc, "rejected_messages": snap["rejected"], "disconnects": snap["disconnects"],
        "rollout_ends": snap["rollout_ends"], "reward_scores": snap["reward_scores"],
        "accounting_ok": accounted == lc["granted"],
        "metrics_summary": metrics.summary(),
    }
