"""The learner process: wires every component together and runs the training loop.

    actors (PUSH) ──trajectories──▶ [I/O thread: validate ─▶ ReplayBuffer] ──take()──▶ trainer
    actors (DEALER) ◀─control───▶ [I/O thread: leases, heartbeats, VersionAnnounce]      │
    actors, relays ◀─weights───── [I/O thread: offers, buckets] ◀─announce(v+1)◀─ [packer] ◀─ gather

`start` restores or begins, gathers version v, binds the sockets, queues v's held-out
evaluation on the actors and starts the local actors; `train` loops; `finish` checkpoints,
gathers the export, lets the other ranks go, then (rank 0 alone: nobody waits in a collective)
writes the export, evaluates the final version on the actors, stops them and writes the
summary. Evaluation runs as evaluation leases on the actors (learner/evaluate.py): the learner
keeps no second copy of the policy and the trainer never waits for a generation.
The trainer thread waits in `buffer.take()` for `prompts_per_step` fresh groups (logging what it
waits for every few seconds, so a stall is never silent), trains one step, gathers the new
weights in the engines' dtype (`Leader.gather_weights`, a collective under FSDP2) into the packer
thread's bounded queue (learner/publisher.py: buckets, digests, deltas), which hands each
finished version to the I/O thread to announce (`LearnerServer.announce`, never blocks). The I/O
thread never waits on the trainer; the trainer waits on the packer only when the packer is a
queue's worth behind.

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
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from buffer.accounting import Drops
from buffer.replay import ReplayBuffer
from configs.loader import save_config
from configs.placement import Placement
from configs.schema import TetherConfig, model_scorers
from learner import distributed, run_dir as run_dirs
from learner.backends.registry import make_backend
from learner.obs import tracking
from learner.evaluate import held_out
from learner.leases import LeaseTable
from learner.local_actors import LocalActors, node_placement
from learner.local_scorers import LocalScorers
from learner.obs.metrics import MetricsLog
from learner.model_setup import ensure_model
from learner.reward_health import RewardHealth
from learner.scoring import balanced
from learner.server import LearnerServer
from learner.obs.timeline import Timeline
from learner.algo.trainer import Trainer
from models import devices
from learner.publisher import Publisher
from transport.weightsrc import shards
from transport.weightsrc.registry import for_actors, ranks_serve_shards

log = logging.getLogger(__name__)


def _log_memory(phase: str) -> None:
    """One line with this process's peak and current resident memory after a start-up phase
    (lab/bench_memory.py reads them for its breakdown; Linux /proc only, else silent)."""
    status = Path("/proc/self/status")
    if status.exists():
        f = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        log.info("memory after %s: VmHWM %d MiB, VmRSS %d MiB", phase,
                 int(f["VmHWM"].split()[0]) // 1024, int(f["VmRSS"].split()[0]) // 1024)

WAIT_LOG_S = 5.0
"""While waiting for trajectories, say what is missing this often."""


def run(cfg: TetherConfig) -> dict | None:
    """Run the learner; returns the summary on rank 0 and None on the other ranks."""
    from transformers.utils import logging as hf_logging

    from models.tiny import load_tokenizer

    tracking.require(cfg)
    hf_logging.disable_progress_bar()
    t0 = time.monotonic()
    L = cfg.learner
    on_cuda = devices.resolve_device(L.device, "learner.device").type == "cuda"  # NVML only
    placement = node_placement(cfg, on_cuda)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ranks = distributed.start(L.backend, L.device,
                              gpu=placement.learner[local_rank][0] if placement.learner else None,
                              timeout_s=L.collective_timeout_s)
    devices.limit_cpu_threads(ranks.device)
    devices.enable_tf32(ranks.device)
    cfg.model.dtype = devices.resolve_dtype(cfg.model.dtype, ranks.device)  # saved: actors follow
    _log_memory("imports")
    actor_cpus = _place_cpus(cfg, ranks)
    run_dir = Path(cfg.run_dir)
    run_id = ""
    if ranks.rank == 0:
        run_id = run_dirs.begin(cfg)  # a run_dir holding another run stops here
        save_config(cfg, run_dir / "config.yaml")
        ensure_model(cfg)
    distributed.barrier(ranks)
    model_dir = Path(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    backend = make_backend(L.backend, model_dir, L.lr, L.weight_decay, L.seed, ranks.device,
                           devices.torch_dtype(cfg.model.dtype), lora=L.lora,
                           activation_checkpointing=L.activation_checkpointing)
    _log_memory("model load")
    trainer = Trainer(cfg, backend, pad_id=tokenizer.pad_token_id,
                      models=distributed.make_models(cfg, ranks, backend),
                      eos_id=tokenizer.eos_token_id)
    _log_memory("reference/critic models")
    checkpoint = _latest_checkpoint(run_dir) if L.resume else None
    link = None  # every rank serves its own buckets of each version (a collective)
    if ranks_serve_shards(cfg, backend.lora is not None, ranks.world):
        link = shards.link(ranks.rank, ranks.world, cfg.transport,
                           lambda s: distributed.all_gather_strings(ranks, s))
    if ranks.rank > 0:
        if checkpoint is not None:
            backend.load_checkpoint(checkpoint)
            trainer.models.load(checkpoint)
        server = publisher = None
        if link is not None:
            server = shards.RankServer(link)
            publisher = Publisher(cfg.transport.weight_bucket_bytes,
                                  cfg.transport.weight_full_every, server.deliver,
                                  rank=ranks.rank, world=ranks.world)
        distributed.follow(trainer, backend, ranks, publisher)
        distributed.close(ranks)
        if server is not None:  # rank 0 evaluates the last version on the actors now
            log.info("rank %d: serving its buckets until rank 0's run is over", ranks.rank)
            server.done.wait()
        return None
    team = distributed.Leader(trainer, backend, ranks, cfg.transport.weight_bucket_bytes, link)
    with _sigterm_interrupts(team) as sigterm:  # SIGTERM = Ctrl-C: checkpoint, stop actors, exit
        log.info("placement on this node: %s", placement.describe() or "no GPUs")
        state = start(cfg, team, tokenizer, checkpoint, actor_cpus, run_id, placement)
        reason = "failed"
        try:
            reason = train(cfg, team, state, sigterm)
            return finish(cfg, team, state, reason, time.monotonic() - t0)
        finally:
            _stop_fleet(state, reason)


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
    scorers: LocalScorers
    metrics: MetricsLog
    eval_start: int
    """The version whose evaluation was queued at start."""
    version: int
    """Policy version = optimizer steps done."""
    publisher: Publisher
    """Packs each gathered version in its own thread and announces it."""
    run_id: str = ""
    """The run's id (learner/run_dir.py): in run.json, every checkpoint and summary.json."""
    reward_health: RewardHealth | None = None
    """Stops the run when the reward keeps failing (learner/reward_health.py)."""


def start(cfg: TetherConfig, team: distributed.Leader, tokenizer, checkpoint: Path | None,
          actor_cpus: list[list[int]] | None = None, run_id: str = "",
          placement: Placement | None = None) -> LeadState:
    """Restore (or begin), gather version v's weights, bind the sockets, announce v, queue
    its held-out evaluation on the actors, start the local actors (on `actor_cpus`, one list per
    actor, if given; on the GPUs `placement` gives them) and scorers."""
    from tasks import make_task

    run_dir, model_dir = Path(cfg.run_dir), Path(cfg.model.path)
    task = make_task(cfg.task, tokenizer, seed=cfg.learner.seed)
    drops = Drops()
    buffer = ReplayBuffer(cfg.buffer.capacity_groups, cfg.max_staleness, cfg.buffer.max_reuse,
                          cfg.buffer.sampling, seed=cfg.learner.seed, drops=drops)
    leases = LeaseTable(task, cfg.learner.prompts_per_step, cfg.learner.group_size,
                        cfg.max_staleness, drops=drops, max_steps=cfg.learner.max_steps)
    version = 0
    if checkpoint is not None:
        version = _restore(team.backend, leases, buffer, checkpoint)
        team.trainer.models.load(checkpoint)
    base = team.gather_base()  # LoRA: the frozen base, sent once to each actor (else None)
    health = RewardHealth(cfg)  # checked on the start round once it is in (train)

    if checkpoint is not None and cfg.transport.kind == "zmq":
        _reuse_ports(cfg, run_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    nccl = None
    if cfg.transport.weights_via == "nccl":  # the GPU path: a broadcast into the engines
        from transport.weightsrc.nccl import NcclBroadcaster

        host = cfg.transport.advertise_host or cfg.transport.host
        nccl = NcclBroadcaster(socket.gethostname() if host == "0.0.0.0" else host,
                               cfg.transport.nccl_engines, team.ranks.device,
                               cfg.actors.engine.weight_broadcast(),
                               ranks_per_engine=cfg.actors.engine.gpus())
    link = team.link
    server = LearnerServer(cfg, buffer, leases, model_dir, vocab, version, base=base, nccl=nccl,
                           shards=None if link is None else shards.Client(
                               link, cfg.transport.peer_timeout_s))
    team.trainer.timeline = Timeline(version, cfg.learner.trace_from_step, cfg.learner.trace_steps)
    server.timeline = team.trainer.timeline
    whole = (lambda pub: pub) if link is None else shards.Collector(
        link, cfg.learner.collective_timeout_s).complete
    publisher = Publisher(cfg.transport.weight_bucket_bytes, cfg.transport.weight_full_every,
                          lambda pub: server.announce(pub.full.manifest.version,
                                                      for_actors(cfg, whole(pub))),
                          world=team.ranks.world if link is not None else 1)
    team.gather_weights(version, publisher)
    publisher.wait()  # v is announced before anyone can ask
    _log_memory("published-weights copy")
    (run_dir / "endpoints.json").write_text(json.dumps(server.endpoints, indent=1))
    server.start()
    log.info("learner listening: %s", server.endpoints)
    server.evaluate(version, task.eval_prompts(cfg.task.eval_prompts))  # 0: an empty round
    log.info("held-out evaluation of v%d queued on the actors (%d prompts)", version,
             cfg.task.eval_prompts)
    actors = LocalActors.start(cfg, server.endpoints["control"], run_dir, actor_cpus, placement)
    scorers = LocalScorers.start(cfg, server.endpoints["control"], run_dir, placement)
    metrics = MetricsLog(run_dir / "metrics.jsonl", cfg,
                         resume_version=version if checkpoint is not None else None)
    return LeadState(task=task, tokenizer=tokenizer, drops=drops, buffer=buffer, leases=leases,
                     server=server, actors=actors, scorers=scorers, metrics=metrics,
                     eval_start=version, version=version, publisher=publisher, run_id=run_id,
                     reward_health=health)


def train(cfg: TetherConfig, team: distributed.Leader, st: LeadState, sigterm: _Sigterm) -> str:
    """Take a batch, step, gather and announce the new version, until learner.max_steps (or
    learner.max_train_minutes, or learner.stop_at_reward); returns why it ended ("finished",
    "time_limit", "reward_reached" or "interrupted"). The server and actors keep running (the
    final evaluation needs them); `finish` or `_stop_fleet` stops them. `sigterm`:
    a SIGTERM raises KeyboardInterrupt only while this runs (see _sigterm_interrupts)."""
    run_dir = Path(cfg.run_dir)
    reason = "finished"
    deadline = (time.monotonic() + 60 * cfg.learner.max_train_minutes
                if cfg.learner.max_train_minutes else float("inf"))
    try:
        sigterm.raising = team.ranks.world == 1  # several ranks: between steps (collectives)
        tl = team.trainer.timeline
        # The first step waits for the start round: until then the actors sample with exactly
        # this version (a resumed run could otherwise step on buffered groups at once and have
        # the round sampled by its successor). Later steps never wait for an evaluation.
        while not st.server.evaluations.wait(st.eval_start, WAIT_LOG_S):
            team.check_interrupt()
            r = st.server.evaluations.result(st.eval_start)
            log.info("v%d: evaluation %d/%d in before the first step", st.version, r["samples"],
                     r["prompts"])
            _log_waiting(st)
            team.idle()
        r = st.server.evaluations.result(st.eval_start)
        if st.reward_health is not None:
            st.reward_health.check(r["samples"] - r["errors"], r["reward_failures"],
                                   f"in the held-out evaluation at v{st.eval_start}")
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
            if st.version == 0:
                _log_memory("first step (gradients, optimizer state, activations)")
            st.version += 1
            with tl.span("gather"):  # the packer thread packs and announces it
                team.gather_weights(st.version, st.publisher)
            m.update(tl.end_step(st.version))
            snap = st.server.snapshot()
            st.metrics.record(st.version, m, step_t0, snap, st.buffer.counts())
            if st.reward_health is not None:
                st.reward_health.observe(snap["reward_scores"])
            if cfg.learner.checkpoint_every and st.version % cfg.learner.checkpoint_every == 0:
                with tl.span("checkpoint"):  # counted in the next step's row
                    _save_checkpoint(team, st.server, run_dir, st.version,
                                     cfg.learner.checkpoint_keep, st.run_id)
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
        try:
            st.publisher.wait()  # the last version is announced before the evaluation and the end
        finally:
            st.server.end_training()  # evaluation leases only from now on
            st.buffer.close()
            st.metrics.close()
    return reason


def _stop_fleet(st: LeadState, reason: str) -> None:
    """Tell the actors and scorers to shut down, close the sockets, reap the local ones
    (idempotent)."""
    if st.server.is_alive():
        st.server.stop(reason)
        st.actors.reap()
        st.scorers.reap()


def _reward_reached(cfg: TetherConfig, metrics: MetricsLog) -> bool:
    """learner.stop_at_reward: has the mean sampled reward of the last stop_reward_window
    steps reached it?"""
    target, window = cfg.learner.stop_at_reward, cfg.learner.stop_reward_window
    rows = metrics.rows[-window:]
    return (target is not None and len(rows) == window
            and sum(r["reward_mean"] for r in rows) / window >= target)


def finish(cfg: TetherConfig, team: distributed.Leader, st: LeadState, reason: str,
           wall: float) -> dict:
    """Final checkpoint and the export's gather (collectives of every rank), then the other
    ranks stop and leave the group; rank 0 alone writes the export, evaluates the final version
    on the actors, stops them and writes summary.json."""
    run_dir = Path(cfg.run_dir)
    if not (run_dir / "checkpoints" / f"step_{st.version}").exists():
        _save_checkpoint(team, st.server, run_dir, st.version, cfg.learner.checkpoint_keep,
                         st.run_id)
    if team.trainer.timeline.write_trace(run_dir / "trace.json"):
        log.info("trace of the steps after v%d written to %s", cfg.learner.trace_from_step,
                 run_dir / "trace.json")
    write_export = team.export_hf(run_dir / "final_model")
    team.stop()
    distributed.close(team.ranks)  # the other ranks are gone: nothing below is a collective
    if st.version != st.eval_start:
        st.server.evaluate(st.version, st.task.eval_prompts(cfg.task.eval_prompts))
    write_export()
    evals = {name: _wait_evaluation(cfg, st, v)
             for name, v in (("start", st.eval_start), ("end", st.version))}
    if model_scorers(cfg):  # the scorers' share of each round's rewards, scored here
        for v in {st.eval_start, st.version}:
            st.server.evaluations.rescore(v, cfg, st.tokenizer)
        evals = {name: {**st.server.evaluations.result(r["version"]), "where": r["where"]}
                 for name, r in evals.items()}
    end = evals["end"]
    if end["samples"] + end["errors"] < end["prompts"]:  # no actor left: the local fallback
        evals["end"] = _evaluate_locally(cfg, st, run_dir / "final_model", team.ranks.device)
    _stop_fleet(st, reason)
    summary = _summary(cfg, st, evals, wall, reason)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    st.metrics.finish(summary)
    _log_summary(summary)
    return summary


def _evaluate_locally(cfg: TetherConfig, st: LeadState, model_dir: Path, device) -> dict:
    """The end round where no actor is left to serve it: the exported model in an HF engine in
    this process (rank 0 alone, after training; the only time the learner holds an engine)."""
    from actors.engines.hf import HFEngine

    log.warning("no actor evaluated v%d: evaluating the exported model in this process",
                st.version)
    engine = HFEngine(model_dir, device, devices.torch_dtype(cfg.model.dtype, device))
    engine.version = st.version
    r = held_out(engine, st.task, cfg, st.tokenizer)
    return {"version": st.version, "reward": r.reward, "samples": r.prompts - r.errors,
            "prompts": r.prompts, "errors": r.errors, "reward_failures": r.reward_failures,
            "sampled_versions": [st.version, st.version], "where": "local"}


def _wait_evaluation(cfg: TetherConfig, st: LeadState, version: int) -> dict:
    """Wait for the actors to finish evaluating `version` (rank 0 alone, after training); gives
    up when no actor has been connected for transport.peer_timeout_s (then the round reports
    what arrived)."""
    alone_since = None
    while not st.server.evaluations.wait(version, WAIT_LOG_S):
        if st.server.snapshot()["actors_connected"]:
            alone_since = None
        else:
            alone_since = alone_since or time.monotonic()
            if time.monotonic() - alone_since > cfg.transport.peer_timeout_s:
                log.warning("no actor to finish the evaluation of v%d", version)
                break
        r = st.server.evaluations.result(version)
        log.info("evaluation of v%d: %d of %d samples in", version, r["samples"], r["prompts"])
    r = st.server.evaluations.result(version)
    log.info("held-out reward at v%d: %s (%d samples, tokens of v%s-v%s)", version, r["reward"],
             r["samples"], *r["sampled_versions"])
    return r


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


_checkpoint_dirs = run_dirs.checkpoint_dirs


def _latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = _checkpoint_dirs(run_dir)
    if not dirs:
        raise FileNotFoundError(f"learner.resume is true but {run_dir}/checkpoints has none")
    return dirs[-1]


def _save_checkpoint(team: distributed.Leader, server: LearnerServer, run_dir: Path,
                     version: int, keep: int, run_id: str = "") -> None:
    snap = server.snapshot()
    state, arrays = server.checkpoint_state()
    path = run_dir / "checkpoints" / f"step_{version}"
    tmp = path.with_name(path.name + ".tmp")
    team.save_checkpoint(tmp, {"version": version, "run_id": run_id, **state})
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


def _summary(cfg: TetherConfig, st: LeadState, evals: dict, wall: float, reason: str) -> dict:
    snap = st.server.snapshot()
    lc, bc = snap["leases"], st.buffer.counts()
    dropped = st.drops.counts()
    scoring = snap["scoring"]
    accounted = (bc["consumed"] + sum(dropped.values()) + lc["outstanding"] + bc["size"]
                 + scoring.get("groups", 0))
    return {
        "run_id": st.run_id,
        "eval_reward_start": evals["start"]["reward"], "eval_reward_end": evals["end"]["reward"],
        "eval_errors_start": evals["start"]["errors"], "eval_errors_end": evals["end"]["errors"],
        "evaluations": evals, "steps": st.version,
        "wall_seconds": round(wall, 2), "end_reason": reason, "max_staleness": cfg.max_staleness,
        "correction": cfg.learner.correction,
        "groups": {"granted": lc["granted"], "consumed": bc["consumed"], "dropped": dropped,
                   "outstanding": lc["outstanding"], "in_buffer": bc["size"],
                   "scoring": scoring.get("groups", 0)},
        "buffer": bc, "rejected_messages": snap["rejected"], "disconnects": snap["disconnects"],
        "rollout_ends": snap["rollout_ends"], "reward_scores": snap["reward_scores"],
        "tool_parse_errors": snap["tool_parse_errors"],
        "weights_sent_bytes": snap["weights_sent_bytes"],
        "weight_buckets_corrupt": snap["weight_buckets_corrupt"],
        "scoring": scoring,
        "accounting_ok": accounted == lc["granted"] and (not scoring or balanced(scoring)),
        "metrics_summary": st.metrics.summary(),
    }
