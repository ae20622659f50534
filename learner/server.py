"""The learner's I/O thread: control ROUTER, trajectory PULL, weights ROUTER.

It owns the sockets, the lease table and the actor registry; the trainer thread talks to it only
through `announce()` / `stop()` (a command queue plus an inproc wake-up socket) and the buffer.

What blocks where:
  * `run()` blocks only in `poller.poll(tick)`; every handler is non-blocking.
  * The trajectory socket is polled only while the buffer has room. While it is full, unread
    trajectories wait in ZeroMQ queues (bounded by high-water marks) and the actors' PUSH
    `send` blocks: that is the backpressure path.
  * A WorkRequest is parked (no reply) until the capacity rule admits new leases; the actor
    keeps heartbeating meanwhile, so a parked actor is never mistaken for a dead one.
  * An actor silent for `peer_timeout_s` is dead: its leases expire and are granted again.
  * With model scorers (task.scorers), a validated group waits in the scoring desk
    (learner/scoring.py) until every sample is scored; groups there hold buffer room, so the
    trajectory socket is read only while buffer + desk have room (the same backpressure).
    Actors stream each finished sample there first (SampleDone, on the control socket, read
    even while the buffer is full): at most one item per sample of an outstanding lease.
  * The weights ROUTER has no send high-water mark: its frames are zero-copy references to
    the immutable buckets of the versions held, so queueing them costs no copies, and a
    ROUTER at its high-water mark would silently drop buckets. Peers pull one bucket per
    request with a few in flight each (transport/weightsrc/zmq_pull.py WINDOW), so what is queued for a
    peer is bounded by its window (transport/weightsrc/).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import zmq

from buffer.record import TrajGroup
from buffer.accounting import DropReason
from buffer.replay import ReplayBuffer
from configs.run_settings import run_settings
from configs.schema import TetherConfig, max_completion_tokens, model_scorers
from learner.algo.advantages import is_uniform
from learner.evaluate import Evaluations
from learner.leases import LeaseRecord, LeaseTable
from learner.rollout_reports import RolloutReports
from learner.scoring import ScoringDesk
from learner.validate import InvalidTrajectory, sample_ids, to_group
from transport import messages as m
from transport import security
from transport import sockets
from transport.sockets import bind, bind_inproc, configure
from transport.weights import PackedWeights
from transport.weightsrc.service import WeightsService
from transport.weightsrc.shards import Client
from transport.weightsrc.store import Published

log = logging.getLogger(__name__)

EVAL_SEED = 12345
"""Evaluation leases are seeded from learner.seed + this (the local evaluation's seeds too)."""
TICK_MS = 100
"""Poll timeout: the longest the loop goes without checking for dead actors."""


@dataclass
class ActorState:
    identity: bytes
    last_seen: float
    incarnation: str = ""
    weight_version: int = -1
    parked_groups: int = 0
    """Groups asked for by a WorkRequest still waiting for capacity (0 = none parked)."""
    corrupt_buckets: int = 0
    """Weight buckets the actor refused for a wrong digest (its last heartbeat's count)."""


class LearnerServer(threading.Thread):
    def __init__(self, cfg: TetherConfig, buffer: ReplayBuffer, leases: LeaseTable,
                 model_dir: Path, vocab_size: int, version: int,
                 base: PackedWeights | None = None, nccl=None,
                 shards: Client | None = None) -> None:
        """`base`: a LoRA run's frozen base weights, sent before the first version to every
        actor that asks for them (`WeightRequest.need_base`); None when full weights train.
        `shards`: the other learner ranks' buckets (transport/weightsrc/shards.py Client)."""
        super().__init__(name="learner-io", daemon=True)
        self.cfg = cfg
        self.tcfg = cfg.transport
        self.buffer = buffer
        self.leases = leases
        self.vocab_size = vocab_size
        self.version = version
        self.run_id = uuid.uuid4().hex[:12]
        self.model_files = _model_files(model_dir)
        self.run_settings = run_settings(cfg)
        """The task, agent, reward and sampling settings every actor runs (sent in the Welcome)."""
        self.actors: dict[str, ActorState] = {}
        self.rejected: Counter[str] = Counter()
        """Messages refused, by reason (malformed, unknown_lease, not_registered, ...)."""
        self.corrupt_buckets = 0
        """Weight buckets actors refused for a wrong digest (from their heartbeats)."""
        self.reports = RolloutReports()
        """What the rollouts of accepted results (kept or dropped as agent_error) reported."""
        self.timeline = None
        """learner/timeline.Timeline, given the actors' time spans when set."""
        self.evaluations = Evaluations()
        """Held-out evaluation rounds served by the actors (learner/evaluate.py)."""
        self.finishing = False
        """Training ended: trajectories are read whatever the buffer's room (evaluation results
        must not wait behind training groups nobody will take)."""
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._enc = m.encoder()
        self._dec = m.Decoders()
        self._ctx = sockets.context(self.tcfg)
        self._bind_sockets()
        self.weights_service = WeightsService(
            self.weights, self.tcfg, is_actor=lambda aid: aid in self.actors,
            reject=self._reject, base=base, nccl=nccl, shards=shards)
        """Offers, buckets, relays (transport/weightsrc/service.py; I/O thread only)."""
        self.desk = (ScoringDesk(cfg, self._send_control, lambda lid: lid in leases.outstanding)
                     if model_scorers(cfg) else None)
        """The scorer fleet's broker (None without model scorers: groups go straight to the
        buffer)."""

    # ------------------------------------------------------------ setup
    def _bind_sockets(self) -> None:
        t = self.tcfg
        self._auth = security.start_authenticator(self._ctx, t)
        self.control = configure(self._ctx.socket(zmq.ROUTER), t, limit_size=True)
        self.trajectory = configure(self._ctx.socket(zmq.PULL), t, limit_size=True)
        self.weights = configure(self._ctx.socket(zmq.ROUTER), t, limit_size=True)
        self.weights.setsockopt(zmq.SNDHWM, 0)
        for sock in (self.control, self.trajectory, self.weights):
            security.make_server(sock, t)
        # ZeroMQ drops a connection that sends a frame over ZMQ_MAXMSGSIZE (or breaks the
        # protocol) without telling the application; the monitors make it visible and counted.
        self._monitors = {sock.get_monitor_socket(zmq.EVENT_DISCONNECTED): name for sock, name in
                          ((self.control, "control"), (self.trajectory, "trajectory"),
                           (self.weights, "weights"))}
        self.disconnects: Counter[str] = Counter()
        """Connections dropped, per socket (peers leaving, oversized or broken frames)."""
        named = (("control", self.control), ("trajectory", self.trajectory),
                 ("weights", self.weights))
        if t.kind == "inproc":
            self.endpoints = {name: bind_inproc(sock, self.run_id, name) for name, sock in named}
        else:
            host = t.advertise_host or t.host
            if host == "0.0.0.0":
                import socket

                host = socket.gethostname()
            self.endpoints = {name: f"tcp://{host}:{bind(sock, t.host, getattr(t, name + '_port'))}"
                              for name, sock in named}
        self._wake_addr = f"inproc://wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.connect(self._wake_addr)

    # ------------------------------------------------------------ called from the trainer thread
    def announce(self, version: int, published: Published) -> None:
        """Make version `version` (`published`: its buckets, and its delta) current: offered
        to actors that ask, and a VersionAnnounce to every joined actor. Does not block (the
        I/O thread sends). Called from the learner's packer thread (learner/publisher.py)."""
        self._command(("announce", version, published))

    def evaluate(self, version: int, prompts: list) -> None:
        """Queue an evaluation of `version` on the held-out `prompts` (one lease each, granted
        to actors before training work). Does not block; `evaluations.wait(version)` does."""
        self.evaluations.open(version, len(prompts))
        self._command(("evaluate", version, prompts))

    def end_training(self) -> None:
        """Grant no more training leases (evaluation leases only). Does not block."""
        self._command(("end_training",))

    def stop(self, reason: str) -> None:
        """Tell every actor to shut down, close the sockets, end the thread."""
        self._command(("stop", reason))
        self.join()
        self._wake_tx.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self.tcfg.kind != "inproc":  # the process-wide context outlives one run
            self._ctx.term()

    def _send_control(self, identity: bytes, msg) -> None:
        self.control.send_multipart([identity, self._enc.encode(msg)], zmq.NOBLOCK)

    def _room(self) -> int:
        """Groups the trajectory socket may deliver now: the buffer's room less the groups
        being scored (which go there once scored)."""
        return self.buffer.room() - (len(self.desk) if self.desk is not None else 0)

    def _command(self, cmd: tuple) -> None:
        # Under the lock the I/O thread cannot take the command (and, for "stop", close the
        # wake socket) before the wake-up is sent.
        with self._lock:
            self._commands.put(cmd)
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def snapshot(self) -> dict:
        """Counters for metrics and the accounting check (a consistent copy)."""
        with self._lock:
            return {
                "actors_connected": len(self.actors),
                "oldest_actor_weights": min((s.weight_version for s in self.actors.values()),
                                            default=-1),
                "leases": self.leases.counts(),
                "rejected": dict(self.rejected),
                "disconnects": dict(self.disconnects),
                "weights_sent_bytes": dict(self.weights_service.store.sent_bytes),
                "weight_buckets_corrupt": self.corrupt_buckets,
                "relays": len(self.weights_service.relays.relays),
                **self.reports.snapshot(),
                "scoring": self.desk.snapshot() if self.desk is not None else {},
            }

    def checkpoint_state(self) -> tuple[dict, dict]:
        """Lease table and buffer (counters, waiting groups as arrays) taken together, so no
        group moves in between."""
        with self._lock:
            buffer_state, arrays = self.buffer.export()
            leases = self.leases.state()
            if self.desk is not None:  # groups being scored: outstanding for a resumed run
                leases["outstanding"] += [[r.lease_id, r.prompt.prompt_id, r.actor_id,
                                           r.incarnation, r.num_samples, r.min_version]
                                          for r in self.desk.records()]
            return {"leases": leases, "buffer": buffer_state}, arrays

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.weights, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        for mon in self._monitors:
            poller.register(mon, zmq.POLLIN)
        ranks = self.weights_service.shards.sockets() if self.weights_service.shards else []
        for sock in ranks:
            poller.register(sock, zmq.POLLIN)
        reading_trajectories = False
        stopping: str | None = None
        next_expiry = 0.0
        while stopping is None:
            want = self._room() > 0 or self.finishing
            if want != reading_trajectories:
                if want:
                    poller.register(self.trajectory, zmq.POLLIN)
                else:
                    poller.unregister(self.trajectory)
                reading_trajectories = want
            events = dict(poller.poll(TICK_MS))
            with self._lock:
                if self.control in events:
                    self._drain(self.control, self._on_control)
                if self.weights in events:
                    self._drain(self.weights, self.weights_service.handle)
                for sock in ranks:
                    if sock in events:
                        self.weights_service.handle_shard(sock)
                if self.trajectory in events:
                    self._read_trajectories()
                if self._wake_rx in events:
                    self._drain(self._wake_rx, lambda frames: None)
                for mon, name in self._monitors.items():
                    if mon in events:
                        self._drain(mon, lambda frames, name=name: self._on_disconnect(name))
                stopping = self._run_commands()
                if self.desk is not None:
                    self.desk.tick()
                    self._take_scored()
                if time.monotonic() >= next_expiry:  # O(actors + leases): once per tick is enough
                    self._expire_dead_actors()
                    next_expiry = time.monotonic() + TICK_MS / 1000
                self._serve_parked()
        self._shutdown(stopping)

    def _drain(self, sock: zmq.Socket, handler, limit: int = 256) -> None:
        for _ in range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            handler(frames)

    def _read_trajectories(self, limit: int = 256) -> None:
        """Read up to `limit` queued results (never more than the buffer has room for) and add
        the valid ones to the buffer together: one lock and one wake-up of the trainer per
        batch. Frames are not copied: msgspec decodes straight from ZeroMQ's buffer."""
        groups = []
        for _ in range(limit if self.finishing else min(limit, self._room())):
            try:
                frames = self.trajectory.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            group = self._on_trajectory(frames)
            if group is not None:
                groups.append(group)
        self._put(groups)

    def _put(self, groups: list[TrajGroup]) -> None:
        """Into the buffer; while finishing (trajectories read whatever the room), those that do
        not fit are dropped as after_end: nobody trains on them any more."""
        room = self.buffer.room()
        if len(groups) > room:
            self.leases.drops.add(DropReason.AFTER_END, len(groups) - room)
            groups = groups[:room]
        self.buffer.put_many(groups)

    def _take_scored(self) -> None:
        """Groups whose every sample is scored: counted, and kept (or dropped as uniform)."""
        groups = [g for w in self.desk.take_finished()
                  if (g := self._keep(w.msg, w.rec, w.group)) is not None]
        self._put(groups)

    def _run_commands(self) -> str | None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return None
            match cmd:
                case ("announce", version, published):
                    self.version = version
                    self.weights_service.add(version, published)
                    news = self._enc.encode(m.VersionAnnounce(version=version))
                    for st in self.actors.values():
                        self.control.send_multipart([st.identity, news], zmq.NOBLOCK)
                case ("evaluate", version, prompts):
                    self.leases.add_eval(version, prompts)
                case ("end_training",):
                    self.leases.close_training()
                    self.finishing = True
                case ("stop", reason):
                    return reason

    def _shutdown(self, reason: str) -> None:
        msg = self._enc.encode(m.Shutdown(reason=reason))
        peers = [st.identity for st in self.actors.values()]
        if self.desk is not None:
            peers += [link.identity for link in self.desk.scorers.values()]
        for identity in peers:
            self.control.send_multipart([identity, msg], zmq.NOBLOCK)
        log.info("told %d actor(s) and %d scorer(s) to shut down: %s", len(self.actors),
                 len(peers) - len(self.actors), reason)
        if self.weights_service.shards is not None:  # the other learner ranks may exit now
            self.weights_service.shards.stop()
        for sock in (self.control, self.trajectory, self.weights):
            sock.disable_monitor()
        for sock in (*self._monitors, self.control, self.trajectory, self.weights, self._wake_rx):
            sock.close(linger=200)

    def _on_disconnect(self, socket_name: str) -> None:
        self.disconnects[socket_name] += 1
        n = self.disconnects[socket_name]
        if n <= 5 or n % 100 == 0:
            log.info("a peer connection to the %s socket closed (#%d: a peer left, or ZeroMQ "
                     "dropped it for an oversized or broken frame)", socket_name, n)

    # ------------------------------------------------------------ control channel
    def _reject(self, reason: str, detail: str, identity: bytes | None = None) -> None:
        self.rejected[reason] += 1
        n = self.rejected[reason]
        if n <= 5 or n % 1000 == 0:
            log.warning("rejected message #%d (%s): %s", n, reason, detail)
        if identity is not None:
            self.control.send_multipart([identity, self._enc.encode(m.Reject(reason=detail))],
                                        zmq.NOBLOCK)

    def _on_control(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._reject("malformed", f"control message with {len(frames)} frames",
                         frames[0] if frames else None)
            return
        identity, payload = frames
        try:
            msg = self._dec.from_actor.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._reject("malformed", f"control: {e}", identity)
            return
        match msg:
            case m.Hello():
                self._on_hello(identity, msg)
            case m.ScorerHello() | m.ScorerHeartbeat() | m.ScoreDone():
                self._on_scorer(identity, msg)
            case m.WorkRequest() | m.Heartbeat() | m.Goodbye() | m.SampleDone():
                st = self.actors.get(msg.actor_id)
                if st is None or st.identity != identity:
                    self._reject("not_registered", f"actor {msg.actor_id!r} must send Hello first",
                                 identity)
                    return
                st.last_seen = time.monotonic()
                self._on_registered(st, msg)

    def _on_hello(self, identity: bytes, msg: m.Hello) -> None:
        if msg.protocol_version != m.PROTOCOL_VERSION:
            self._reject("protocol_version",
                         f"protocol version mismatch: actor {msg.actor_id!r} speaks "
                         f"v{msg.protocol_version}, learner speaks v{m.PROTOCOL_VERSION}", identity)
            return
        if msg.dtype and msg.dtype != self.cfg.model.dtype:
            self._reject("dtype", f"actor {msg.actor_id!r} computes in model.dtype={msg.dtype}, "
                         f"the learner in {self.cfg.model.dtype}: logprobs would not match",
                         identity)
            return
        if not (0 < len(msg.actor_id) <= 128 and msg.actor_id.isascii() and msg.actor_id.isprintable()):
            self._reject("bad_actor_id", "actor_id must be 1..128 printable ASCII characters",
                         identity)
            return
        st = self.actors.get(msg.actor_id)
        if st is not None and st.incarnation == msg.incarnation:
            st.identity, st.last_seen = identity, time.monotonic()  # a repeated Hello
        else:
            # Registering: the actor keeps the leases its process says it holds. After a resume,
            # the checkpoint's other leases for it went to the run that died (or were lost); a
            # restarted actor (same id, new incarnation) holds none of its predecessor's.
            self.leases.expire_actor(msg.actor_id, msg.incarnation, held=set(msg.leases_held))
            self.actors[msg.actor_id] = ActorState(identity=identity, last_seen=time.monotonic(),
                                                   incarnation=msg.incarnation)
        log.info("actor %s joined (engine %r); %d connected", msg.actor_id, msg.engine,
                 len(self.actors))
        welcome = m.Welcome(
            protocol_version=m.PROTOCOL_VERSION, actor_id=msg.actor_id,
            trajectory_endpoint=self.endpoints["trajectory"],
            weights_endpoint=self.endpoints["weights"], latest_version=self.version,
            heartbeat_s=self.tcfg.heartbeat_s, peer_timeout_s=self.tcfg.peer_timeout_s,
            model_files=self.model_files, run_id=self.run_id,
            leases_kept=self.leases.held_by(msg.actor_id), run_settings=self.run_settings)
        self.control.send_multipart([identity, self._enc.encode(welcome)], zmq.NOBLOCK)

    def _on_registered(self, st: ActorState, msg) -> None:
        match msg:
            case m.WorkRequest(actor_id=aid, max_groups=k):
                if not 1 <= k <= 1024:
                    self._reject("bad_request", f"max_groups must be in [1, 1024], got {k}",
                                 st.identity)
                    return
                st.parked_groups = k
                self._serve(aid, st)
            case m.Heartbeat(actor_id=aid, weight_version=v, spans=spans):
                bad = _bad_spans(spans)
                if bad:
                    self._reject("malformed", f"heartbeat of {aid!r}: {bad}", st.identity)
                    return
                st.weight_version = v
                self.corrupt_buckets += max(0, msg.corrupt_buckets - st.corrupt_buckets)
                st.corrupt_buckets = msg.corrupt_buckets
                if self.timeline is not None:
                    self.timeline.actor_spans(aid, spans)
                ack = m.HeartbeatAck(latest_version=self.version)
                self.control.send_multipart([st.identity, self._enc.encode(ack)], zmq.NOBLOCK)
            case m.Goodbye(actor_id=aid):
                self.leases.expire_actor(aid)
                del self.actors[aid]
                log.info("actor %s left; %d connected", aid, len(self.actors))
            case m.SampleDone():
                self._on_sample_done(msg)

    def _on_sample_done(self, msg: m.SampleDone) -> None:
        """A streamed sample to score (learner/scoring.py); its lease's group comes later."""
        if self.desk is None:
            self._reject("no_scorers", f"sample_done from {msg.actor_id!r}: this run has no "
                         "model scorers (task.scorers)")
            return
        if msg.lease_id in self.leases.evaluating:
            return  # evaluation rollouts are scored at the run's end (learner/evaluate.py)
        rec = self.leases.outstanding.get(msg.lease_id)
        if rec is None or rec.actor_id != msg.actor_id:
            if self.leases.is_closed(msg.lease_id) or self.leases.is_void(msg.lease_id):
                self.desk.stream_late()  # its group arrived first, or the lease ended (or an
                # evaluation lease's result arrived before this)
            else:
                self._reject("unknown_lease", f"sample_done: lease {msg.lease_id} is not "
                             f"outstanding for {msg.actor_id!r}")
            return
        if not 0 <= msg.sample_index < rec.num_samples:
            self._reject("invalid_sample", f"sample_done: lease {msg.lease_id} has no sample "
                         f"{msg.sample_index}")
            return
        try:
            ids = sample_ids(msg.completion_ids, self.vocab_size, max_completion_tokens(self.cfg))
        except InvalidTrajectory as e:
            self._reject("invalid_sample", f"sample_done: lease {msg.lease_id} sample "
                         f"{msg.sample_index}: {e}")
            return
        self.desk.stream(rec, msg.sample_index, ids)

    def _on_scorer(self, identity: bytes, msg) -> None:
        if self.desk is None:
            self._reject("no_scorers", "this run has no model scorers (task.scorers)", identity)
            return
        if isinstance(msg, m.ScorerHello):
            if msg.protocol_version != m.PROTOCOL_VERSION:
                self._reject("protocol_version",
                             f"protocol version mismatch: scorer {msg.scorer_id!r} speaks "
                             f"v{msg.protocol_version}, learner speaks v{m.PROTOCOL_VERSION}",
                             identity)
                return
            refused = self.desk.hello(identity, msg)
            if refused:
                self._reject("bad_scorer", refused, identity)
                return
            self._send_control(identity, m.ScorerWelcome(
                protocol_version=m.PROTOCOL_VERSION, scorer_id=msg.scorer_id,
                heartbeat_s=self.tcfg.heartbeat_s, peer_timeout_s=self.tcfg.peer_timeout_s,
                model_files=self.model_files, run_id=self.run_id))
            return
        if self.desk.seen(msg.scorer_id, identity) is None:
            self._reject("not_registered", f"scorer {msg.scorer_id!r} must send ScorerHello "
                         "first", identity)
            return
        match msg:
            case m.ScorerHeartbeat(scorer_id=sid, scored=n, busy_us=busy):
                if n < 0 or busy < 0:
                    self._reject("malformed", f"heartbeat of scorer {sid!r}: negative counts",
                                 identity)
                    return
                if self.timeline is not None:
                    self.timeline.scorer_beat(sid, n, busy)
                self._send_control(identity, m.HeartbeatAck(latest_version=self.version))
            case m.ScoreDone():
                problem = self.desk.on_done(msg)
                if problem:
                    self._reject("malformed", problem)

    def _serve_parked(self) -> None:
        for aid, st in list(self.actors.items()):
            if st.parked_groups:
                self._serve(aid, st)

    def _serve(self, aid: str, st: ActorState) -> None:
        recs = self.leases.grant(aid, st.incarnation, st.parked_groups, self.version)
        if not recs:
            return
        st.parked_groups = 0
        grant = m.LeaseGrant(leases=[self._lease_msg(r) for r in recs], latest_version=self.version)
        self.control.send_multipart([st.identity, self._enc.encode(grant)], zmq.NOBLOCK)

    def _lease_msg(self, r: LeaseRecord) -> m.Lease:
        task = self.cfg.task
        seed = self.cfg.learner.seed + (EVAL_SEED if r.eval_version is not None else 0)
        return m.Lease(lease_id=r.lease_id, prompt_id=r.prompt.prompt_id,
                       prompt_ids=m.Array.from_numpy(r.prompt.token_ids), num_samples=r.num_samples,
                       min_version=r.min_version, seed=seed,
                       max_new_tokens=task.max_new_tokens, temperature=task.temperature,
                       meta=r.prompt.meta)

    def _expire_dead_actors(self) -> None:
        now = time.monotonic()
        for aid, st in list(self.actors.items()):
            if now - st.last_seen > self.tcfg.peer_timeout_s:
                log.warning("actor %s silent for %.1fs: declared dead", aid, now - st.last_seen)
                self.leases.expire_actor(aid)
                del self.actors[aid]
        # leases restored from a checkpoint whose actor never came back
        self.leases.expire_unclaimed(set(self.actors), now - self.tcfg.peer_timeout_s)

    # ------------------------------------------------------------ trajectory channel
    def _on_trajectory(self, frames: list[zmq.Frame]) -> TrajGroup | None:
        """The valid group a message carries, or None (rejected or dropped, and counted)."""
        if len(frames) != 1:
            self._reject("malformed", f"trajectory message with {len(frames)} frames")
            return None
        try:
            msg = self._dec.trajectory.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._reject("malformed", f"trajectory: {e}")
            return None
        rec = self.leases.complete(msg.lease_id, msg.actor_id)
        if rec is None:
            if self.leases.is_void(msg.lease_id):
                self._reject("void_lease", f"lease {msg.lease_id} from {msg.actor_id!r} was granted "
                             "after the checkpoint this learner resumed from")
            elif self.leases.is_closed(msg.lease_id):
                self._reject("duplicate", f"lease {msg.lease_id} from {msg.actor_id!r} was already "
                             "completed, dropped or expired")
            else:
                self._reject("unknown_lease", f"lease {msg.lease_id} from {msg.actor_id!r} is not "
                             "outstanding for that actor")
            return None
        if st := self.actors.get(msg.actor_id):
            st.last_seen = time.monotonic()
        if rec.eval_version is not None:
            self._on_eval_result(msg, rec)
            return None
        errors = [s.error for s in msg.samples if s.error]
        if errors:
            log.warning("lease %d: agent error on actor %s: %s", rec.lease_id, rec.actor_id,
                        errors[0])
            self.leases.drop(rec, DropReason.AGENT_ERROR)
            self.reports.count(msg)
            return None
        try:
            group = to_group(msg, rec, self.vocab_size, self.version,
                             max_tokens=max_completion_tokens(self.cfg))
        except InvalidTrajectory as e:
            self.leases.drop(rec, DropReason.INVALID)
            self._reject("invalid_trajectory", f"lease {rec.lease_id}: {e}")
            return None
        if self.desk is not None:  # to the buffer once every sample is scored (_take_scored)
            problem = self.desk.add(msg, rec, group)
            if problem:
                self.leases.drop(rec, DropReason.INVALID)
                self._reject("invalid_trajectory", problem)
            return None
        return self._keep(msg, rec, group)

    def _keep(self, msg: m.GroupResult, rec: LeaseRecord, group: TrajGroup) -> TrajGroup | None:
        """Count a scored group's reports; the group, or None when it is dropped as uniform."""
        self.reports.count(msg)
        if self.cfg.learner.drop_uniform_groups and is_uniform(group.rewards):
            self.leases.drop(rec, DropReason.UNIFORM)  # frees capacity: another lease refills it
            return None
        return group

    def _on_eval_result(self, msg: m.GroupResult, rec: LeaseRecord) -> None:
        """Record an evaluation lease's sample (validated like training results; an agent error
        or an invalid result scores 0 and is counted)."""
        error = any(s.error for s in msg.samples)
        versions = np.zeros(0, np.int32)
        reward, item = 0.0, None
        if not error:
            try:
                group = to_group(msg, rec, self.vocab_size, self.version,
                                 max_tokens=max_completion_tokens(self.cfg))
                reward = float(group.rewards[0])
                versions = np.concatenate(group.versions)
                item = (rec.prompt, np.array(group.completions[0]))
            except InvalidTrajectory as e:
                self._reject("invalid_trajectory", f"evaluation lease {rec.lease_id}: {e}")
                error = True
        failed = any(smp.scores.get(k) for smp in msg.samples
                     for k in ("reward_error", "reward_timeout"))
        self.evaluations.record(rec.eval_version, rec.lease_id, reward, versions, error, item,
                                failed)

def _model_files(model_dir: Path, limit: int = 16 * 1024 * 1024) -> dict[str, bytes]:
    """The small non-weight files of an HF model directory (config, tokenizer)."""
    out = {}
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and p.suffix in (".json", ".txt", ".model", ".jinja") and p.stat().st_size < limit:
            out[p.name] = p.read_bytes()
    return out


def _bad_spans(spans: list[m.Span]) -> str:
    """What is wrong with a heartbeat's spans ("" = nothing)."""
    if len(spans) > m.MAX_SPANS:
        return f"{len(spans)} spans (at most {m.MAX_SPANS})"
    for s in spans:
        if s.state not in m.SPAN_STATES or s.dur_us < 0 or s.start_us < 0:
            return f"span {s!r} (state one of {m.SPAN_STATES}, times >= 0)"
    return ""
