"""The learner process: wires every component together and runs the training loop.

    actors (PUSH) ──trajectories──▶ [I/O thread: validate ─▶ ReplayBuffer] ──take()──▶ trainer
    actors (DEALER) ◀─control───▶ [I/O thread: leases, heartbeats, VersionAnnounce]      │
    actors (DEALER) ◀─weights──── [I/O thread: buckets of version v] ◀─announce(v+1)◀─ gather

`start` restores or begins, gathers and evaluates version v, binds the sockets and starts the
local actors; `train` loops; `finish` checkpoints, evaluates, exports and writes the summary.
The trainer thread waits in `buffer.take()` for `prompts_per_step` fresh groups (logging what it
waits for every few seconds, so a stall is never silent), trains one step, gathers the new
weights (`Leader.gather_weights`, a collective under FSDP2) and hands them to the I/O thread to
announce (`LearnerServer.announce`, never blocks). The I/O thread never waits on the trainer.

With `learner.backend=fsdp2` under torchrun, only rank 0 runs this loop (and owns sockets,
buffer, leases, actors, files); the other ranks follow its commands (learner/distributed.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from buffer.accounting import Drops
from buffer.replay import ReplayBuffer
from configs.loader import save_config
from configs.schema import TetherConfig
from learner import distributed
from learner.backends.registry import make_backend
from learner.obs import tracking
from learner.evaluate import evaluate
from learner.leases import LeaseTable
from learner.local_actors import LocalActors
from learner.obs.metrics import MetricsLog
from learner.model_setup import ensure_model
from learner.server import LearnerServer
from learner.obs.timeline import Timeline
from learner.algo.trainer import Trainer
from models import devices
from transport import weight_sources
from transport.weights import PackedWeights

log = logging.getLogger(__name__)

WAIT_LOG_S = 5.0
"""While waiting for trajectories, say what is missing this often."""


def run(cfg: TetherConfig) -> dict | None:
    """Run the learner; returns the summary on rank 0 and None on the other ranks."""
    from transformers.utils import logging as hf_logging

    from models.tiny import load_tokenizer

    tracking.require(cfg)
    hf_logging.disable_progress_bar()
    t0 = time.monotonic()
    ranks = distributed.start(cfg.learner.backend, cfg.learner.device)
    devices.limit_cpu_threads(ranks.device)
    actor_cpus = _place_cpus(cfg, ranks)
    run_dir = Path(cfg.run_dir)
    if ranks.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        ensure_model(cfg)
    distributed.barrier(ranks)
    model_dir = Path(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    L = cfg.learner
    backend = make_backend(L.backend, model_dir, L.lr, L.weight_decay, L.seed, ranks.device,
                           devices.torch_dtype(cfg.model.dtype), lora=L.lora)
    trainer = Trainer(cfg, backend, pad_id=tokenizer.pad_token_id,
                      models=distributed.make_models(cfg, ranks, backend),
                      eos_id=tokenizer.eos_token_id)
    checkpoint = _latest_checkpoint(run_dir) if L.resume else None
    if ranks.rank > 0:
        if checkpoint is not None:
            backend.load_checkpoint(checkpoint)
            trainer.models.load(checkpoint)
        distributed.follow(trainer, backend, ranks)
        distributed.close(ranks)
        return None
    team = distributed.Leader(trainer, backend, ranks, cfg.transport.weight_bucket_bytes)
    with _sigterm_interrupts(team) as sigterm:  # SIGTERM = Ctrl-C: checkpoint, stop actors, exit
        state = start(cfg, team, tokenizer, checkpoint, actor_cpus)
        reason = train(cfg, team, state, sigterm)
        summary = finish(cfg, team, state, reason, time.monotonic() - t0)
    distributed.close(ranks)
    return summary


def _place_cpus(cfg: TetherConfig, ranks: distributed.Ranks) -> list[list[int]] | None:
    """`learner.cpu_placement: split` on CPU: pin this rank to its cores (torch threads = its
    cores) and return the local actor processes' cores; None (shared) otherwise."""
    if cfg.learner.cpu_placement != "split" or ranks.device.type != "cpu":
        return None
    learner_cpus, actor_cpus = devices.split_cpus(sorted(os.sched_getaffinity(0)), ranks.world,
                                                  cfg.actors.num_local)
    devices.pin(learner_cpus[ranks.rank])
    devices.limit_cpu_threads(ranks.device, len(learner_cpus[ranks.rank]))
    log.info("cpu placement split: learner rank %d on cores %s, local actors on %s", ranks.rank,
             learner_cpus[ranks.rank], actor_cpus)
    return actor_cpus


@dataclass
class LeadState:
    """What rank 0 owns while it trains (`start` makes it, `train` and `finish` use it)."""

    task: object
    tokenizer: object
    drops: Drops
    buffer: ReplayBuffer
    leases: LeaseTable
    server: LearnerServer
    actors: LocalActors
    metrics: MetricsLog
    eval_engine: object
    eval_start: float
    version: int
    """Policy version = optimizer steps done."""
    packed: PackedWeights
    """The gathered weights of `version` (LoRA: its adapter)."""


def start(cfg: TetherConfig, team: distributed.Leader, tokenizer, checkpoint: Path | None,
          actor_cpus: list[list[int]] | None = None) -> LeadState:
    """Restore (or begin), gather version v's weights, evaluate them, bind the sockets,
    announce v, start the local actors (on `actor_cpus`, one list per actor, if given)."""
    from actors.engines.hf import HFEngine
    from tasks import make_task

    run_dir, model_dir = Path(cfg.run_dir), Path(cfg.model.path)
    task = make_task(cfg.task, tokenizer, seed=cfg.learner.seed)
    drops = Drops()
    buffer = ReplayBuffer(cfg.buffer.capacity_groups, cfg.max_staleness, cfg.buffer.max_reuse,
                          cfg.buffer.sampling, seed=cfg.learner.seed, drops=drops)
    leases = LeaseTable(task, cfg.learner.prompts_per_step, cfg.learner.group_size,
                        cfg.max_staleness, drops=drops)
    version = 0
    if checkpoint is not None:
        version = _restore(team.backend, leases, buffer, checkpoint)
        team.trainer.models.load(checkpoint)
    base = team.gather_base()  # LoRA: the frozen base, sent once to each actor (else None)
    packed = team.gather_weights(version)
    eval_engine = HFEngine(model_dir, team.ranks.device, devices.torch_dtype(cfg.model.dtype))
    if base is not None:
        eval_engine.load_packed(base.manifest, list(base.buckets))
    eval_start = _evaluate(eval_engine, packed, task, cfg, tokenizer)
    log.info("held-out reward at v%d: %.3f", version, eval_start)

    if checkpoint is not None and cfg.transport.kind == "zmq":
        _reuse_ports(cfg, run_dir)
    server = LearnerServer(cfg, buffer, leases, model_dir, eval_engine.model.config.vocab_size,
                           version, base=base)
    team.trainer.timeline = Timeline(version, cfg.learner.trace_from_step, cfg.learner.trace_steps)
    server.timeline = team.trainer.timeline
    server.announce(version, weight_sources.for_actors(cfg, packed))
    (run_dir / "endpoints.json").write_text(json.dumps(server.endpoints, indent=1))
    server.start()
    log.info("learner listening: %s", server.endpoints)
    actors = LocalActors.start(cfg, server.endpoints["control"], run_dir, actor_cpus)
    metrics = MetricsLog(run_dir / "metrics.jsonl", cfg,
                         resume_version=version if checkpoint is not None else None)
    return LeadState(task=task, tokenizer=tokenizer, drops=drops, buffer=buffer, leases=leases,
                     server=server, actors=actors, metrics=metrics, eval_engine=eval_engine,
                     eval_start=eval_start, version=version, packed=packed)


def train(cfg: TetherConfig, team: distributed.Leader, st: LeadState, sigterm: _Sigterm) -> str:
    """Take a batch, step, gather and announce the new version, until learner.max_steps (or
    learner.max_train_minutes, or learner.stop_at_reward); returns why it ended ("finished",
    "time_limit", "reward_reached" or "interrupted"). Stops the server and actors. `sigterm`:
    a SIGTERM raises KeyboardInterrupt only while this runs (see _sigterm_interrupts)."""
    run_dir = Path(cfg.run_dir)
    reason = "finished"
    deadline = (time.monotonic() + 60 * cfg.learner.max_train_minutes
                if cfg.learner.max_train_minutes else float("inf"))
    try:
        sigterm.raising = team.ranks.world == 1  # several ranks: between steps (collectives)
        tl = team.trainer.timeline
        while st.version < cfg.learner.max_steps:
            team.check_interrupt()
            if time.monotonic() >= deadline:
                reason = "time_limit"
                log.info("learner.max_train_minutes=%g reached at v%d",
                         cfg.learner.max_train_minutes, st.version)
                break
            with tl.span("wait_buffer"):
                groups = st.buffer.take(cfg.learner.prompts_per_step, st.version,
                                        timeout=WAIT_LOG_S)
            if groups is None:
                # A signal during the wait (several ranks: only a flag) stops the run before
                # the actors are judged: Ctrl-C, and torchrun passing it on, end them too.
                team.check_interrupt()
                _log_waiting(st)
                team.idle()
                continue
            step_t0 = time.monotonic()
            m = team.step(groups, st.version)
            st.version += 1
            with tl.span("gather"):
                st.packed = team.gather_weights(st.version)
            with tl.span("announce"):
                st.server.announce(st.version, weight_sources.for_actors(cfg, st.packed))
            m.update(tl.end_step(st.version))
            st.metrics.record(st.version, m, step_t0, st.server.snapshot(), st.buffer.counts())
            if cfg.learner.checkpoint_every and st.version % cfg.learner.checkpoint_every == 0:
                with tl.span("checkpoint"):  # counted in the next step's row
                    _save_checkpoint(team, st.server, run_dir, st.version,
                                     cfg.learner.checkpoint_keep)
            if _reward_reached(cfg, st.metrics):
                reason = "reward_reached"
                log.info("learner.stop_at_reward=%g reached at v%d (mean sampled reward of the "
                         "last %d steps)", cfg.learner.stop_at_reward, st.version,
                         cfg.learner.stop_reward_window)
                break
    except KeyboardInterrupt:
        reason = "interrupted"
        log.warning("interrupted at v%d: saving a checkpoint", st.version)
    finally:
        sigterm.raising = False
        st.server.stop(reason)
        st.buffer.close()
        st.metrics.close()
        st.actors.reap()
    return reason


def _reward_reached(cfg: TetherConfig, metrics: MetricsLog) -> bool:
    """learner.stop_at_reward: has the mean sampled reward of the last stop_reward_window
    steps reached it?"""
    target, window = cfg.learner.stop_at_reward, cfg.learner.stop_reward_window
    rows = metrics.rows[-window:]
    return (target is not None and len(rows) == window
            and sum(r["reward_mean"] for r in rows) / window >= target)


def finish(cfg: TetherConfig, team: distributed.Leader, st: LeadState, reason: str,
           wall: float) -> dict:
    """Final checkpoint, held-out evaluation, HF export, summary.json; stops the other ranks."""
    run_dir = Path(cfg.run_dir)
    if not (run_dir / "checkpoints" / f"step_{st.version}").exists():
        _save_checkpoint(team, st.server, run_dir, st.version, cfg.learner.checkpoint_keep)
    if team.trainer.timeline.write_trace(run_dir / "trace.json"):
        log.info("trace of the steps after v%d written to %s", cfg.learner.trace_from_step,
                 run_dir / "trace.json")
    eval_end = _evaluate(st.eval_engine, st.packed, st.task, cfg, st.tokenizer)
    team.export_hf(run_dir / "final_model")
    team.stop()
    summary = _summary(cfg, st, eval_end, wall, reason)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    st.metrics.finish(summary)
    _log_summary(summary)
    return summary


def _evaluate(engine, packed: PackedWeights, task, cfg: TetherConfig, tokenizer) -> float:
    """Held-out reward of the published weights `packed` (no second gather of the model)."""
    engine.load_packed(packed.manifest, list(packed.buckets))
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


@dataclass
class _Sigterm:
    """The learner's SIGTERM handler. While a single-rank `train` runs (`raising`), SIGTERM
    raises KeyboardInterrupt like Ctrl-C: train checkpoints, stops the actors, and the run
    finishes. Otherwise it only asks the team to stop, and train stops before its next step:
    during start-up (which completes, so it cannot leave a half-bound server or half-started
    actors behind), with several ranks (which must not leave a collective half-done), and
    during finish (itself the orderly end, where the request changes nothing)."""

    team: distributed.Leader
    raising: bool = False

    def __call__(self, signum, frame) -> None:
        # Once: under torchrun and Slurm a cancel sends SIGTERM twice (slurmd to every process
        # of the step, torchrun to its workers); a second one must not cut the checkpoint short.
        # (Not SIG_IGN: actors started after it, in start-up, would inherit it.)
        if self.team.stop_requested():
            return
        self.team.request_stop()
        if self.raising:
            raise KeyboardInterrupt(f"signal {signum}")
        log.warning("signal %d: stopping before the next step", signum)


@contextlib.contextmanager
def _sigterm_interrupts(team: distributed.Leader):
    """Install _Sigterm for the run (main thread only: an in-process learner started from
    another thread keeps the process's handler; its _Sigterm is never called)."""
    handler = _Sigterm(team)
    if threading.current_thread() is not threading.main_thread():
        yield handler
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def _log_waiting(st: LeadState) -> None:
    snap = st.server.snapshot()
    dead = st.actors.exited()
    log.info("v%d waiting for trajectories: buffer %d, actors connected %d (oldest weights v%d), "
             "leases outstanding %d%s", st.version, len(st.buffer), snap["actors_connected"],
             snap["oldest_actor_weights"], snap["leases"]["outstanding"],
             f", local actor(s) {dead} exited" if dead else "")
    if st.actors and len(dead) == len(st.actors) and snap["actors_connected"] == 0:
        raise RuntimeError("every local actor has exited; see run_dir/logs/actor-*.log")


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
                     version: int, keep: int) -> None:
    snap = server.snapshot()
    state, arrays = server.checkpoint_state()
    path = run_dir / "checkpoints" / f"step_{version}"
    tmp = path.with_name(path.name + ".tmp")
    team.save_checkpoint(tmp, {"version": version, **state})
    np.savez(tmp / "buffer.npz", **arrays)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    log.info("checkpoint v%d saved to %s (%d actors connected)", version, path,
             snap["actors_connected"])
    _prune_checkpoints(run_dir, keep, version)


def _prune_checkpoints(run_dir: Path, keep: int, version: int) -> None:
    """Keep the newest `keep` complete checkpoints up to step `version`, the one just written
    (0 = keep all), and delete the older ones and any `step_N.tmp` a crash left behind. Runs
    only after that checkpoint is complete. Checkpoints of higher steps (an earlier run in the
    same run_dir) are left alone."""
    for tmp in (run_dir / "checkpoints").glob("step_*.tmp"):
        shutil.rmtree(tmp)
    upto = [p for p in _checkpoint_dirs(run_dir) if int(p.name[5:]) <= version]
    old = upto[:-keep] if keep else []
    for path in old:
        shutil.rmtree(path)
    if old:
        log.info("deleted %d older checkpoint(s) (learner.checkpoint_keep=%d)", len(old), keep)


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


def _summary(cfg: TetherConfig, st: LeadState, eval_end: float, wall: float, reason: str) -> dict:
    snap = st.server.snapshot()
    lc, bc = snap["leases"], st.buffer.counts()
    dropped = st.drops.counts()
    accounted = bc["consumed"] + sum(dropped.values()) + lc["outstanding"] + bc["size"]
    return {
        "eval_reward_start": st.eval_start, "eval_reward_end": eval_end, "steps": st.version,
        "wall_seconds": round(wall, 2), "end_reason": reason, "max_staleness": cfg.max_staleness,
        "correction": cfg.learner.correction,
        "groups": {"granted": lc["granted"], "consumed": bc["consumed"], "dropped": dropped,
                   "outstanding": lc["outstanding"], "in_buffer": bc["size"]},
        "buffer": bc, "rejected_messages": snap["rejected"], "disconnects": snap["disconnects"],
        "rollout_ends": snap["rollout_ends"], "reward_scores": snap["reward_scores"],
        "tool_parse_errors": snap["tool_parse_errors"],
        "accounting_ok": accounted == lc["granted"],
        "metrics_summary": st.metrics.summary(),
    }
