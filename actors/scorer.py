"""A scorer: one process of the scorer fleet, running every model scorer of `task.scorers`.

    python -m actors.scorer -c CONFIG [key=value ...] LEARNER

LEARNER is the learner's control endpoint (tcp://host:port, host:port, its run directory or
endpoints.json), as for an actor; the learner starts `scoring.num_local` of these itself.

    join:   ScorerHello -> ScorerWelcome (the policy's tokenizer files) -> build the scorers
            (frozen models on `scoring.device`; a judge's engine loads its weights once)
    work:   ScoreBatch (samples of any actors, batched by the learner: learner/scoring.py)
            -> every model scorer scores the batch -> ScoreDone (or ScoreDone.error)
    side:   ScorerHeartbeat every heartbeat_s with the samples scored and the busy time
            (learner/timeline.py); HeartbeatAck proves the learner alive

What blocks where: the event loop never blocks; a classifier's forward pass runs in a worker
thread, a judge's engine in its own thread (HF) or processes (vLLM), remote calls are awaited.
Batches are scored one after the other, in arrival order; the learner sends at most
`scoring.in_flight` at once. A learner silent for peer_timeout_s gets a ScorerHello again on the
same socket (a Reject too); the scorer keeps its models. The weights never change: a scorer
pulls no versions.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from configs.schema import TetherConfig, model_scorers
from transport import messages as m
from transport import security, sockets
from transport.sockets import configure

log = logging.getLogger(__name__)


async def judge_engine(cfg, device: str):
    """(LLMClient, tokenizer, close) serving a `kind: judge` scorer's model, its directory's
    weights loaded as version 0 (the `engines` of tasks.scorers.make_model_scorer), on the
    engine `cfg.engine` names (JUDGE_ENGINES)."""
    from models.tiny import load_tokenizer

    path = Path(cfg.path)
    tokenizer = load_tokenizer(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"task.scorers {cfg.name}: no *.safetensors in {path}")
    llm, close = await JUDGE_ENGINES[cfg.engine](cfg, path, files, device)
    return llm, tokenizer, close


async def _vllm_judge(cfg, path: Path, files: list[Path], device: str):
    from actors.engines.vllm.engine import VLLMEngine

    if len(files) != 1:
        raise ValueError(f"task.scorers {cfg.name}: the vllm judge loads one safetensors "
                         f"file, {path} has {len(files)}")
    llm = await asyncio.to_thread(VLLMEngine, path, "wait", seed=cfg.seed,
                                  kv_cache_gb=cfg.vllm_kv_cache_gb, enforce_eager=True,
                                  max_num_seqs=256)
    await llm.load_file(str(files[0]), 0)
    return llm, llm.shutdown


async def _hf_judge(cfg, path: Path, files: list[Path], device: str):
    from safetensors.torch import load_file

    from actors.engines.client import EngineClient
    from actors.engines.hf import HFEngine

    def build() -> HFEngine:
        engine = HFEngine(path, device)
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        engine.load_weights(state, 0)
        return engine

    return EngineClient(await asyncio.to_thread(build)), None


JUDGE_ENGINES = {"hf": _hf_judge, "vllm": _vllm_judge}
"""`task.scorers[i].engine` -> what starts a frozen judge on that engine."""


async def build_scorers(cfg: TetherConfig, judge_engine_kind: str = "") -> list:
    """Every model scorer of `task.scorers`, on `scoring.device` (in this event loop);
    `judge_engine_kind` ("hf") overrides the judges' engine (the learner's evaluation runs them
    on HF in its own process rather than start a second vLLM there)."""
    import msgspec

    from configs.scorers import JudgeScorer
    from models import devices
    from tasks.scorers import make_model_scorer

    device = str(devices.resolve_device(cfg.scoring.device, "scoring.device"))
    sections = [msgspec.structs.replace(s, engine=judge_engine_kind)
                if judge_engine_kind and isinstance(s, JudgeScorer) else s
                for s in model_scorers(cfg)]
    return [await make_model_scorer(s, device, judge_engine) for s in sections]


async def score_items(scorers: list, items: list) -> list[dict[str, float]]:
    """Every scorer on every item: one dict name -> score per item (NaN = unreadable)."""
    per = await asyncio.gather(*(s.score(items) for s in scorers))
    for s, values in zip(scorers, per):
        if len(values) != len(items):
            raise RuntimeError(f"scorer {s.name} returned {len(values)} scores for "
                               f"{len(items)} items")
    return [{s.name: float(values[i]) for s, values in zip(scorers, per)}
            for i in range(len(items))]


class Scorer:
    def __init__(self, cfg: TetherConfig, control_endpoint: str, scorer_id: str,
                 cache_dir: Path, parent_pid: int | None = None) -> None:
        self.cfg = cfg
        self.endpoint = control_endpoint
        self.scorer_id = scorer_id
        self.cache_dir = cache_dir
        self.parent_pid = parent_pid
        """If set, the scorer stops when this process is no longer its parent (no orphans)."""
        self.names = [s.name for s in model_scorers(cfg)]
        self.ctx = sockets.actor_context(cfg.transport)
        self.enc = m.encoder()
        self.dec = m.Decoders()
        self.incarnation = uuid.uuid4().hex
        self.stopped = asyncio.Event()
        self.batches: asyncio.Queue[m.ScoreBatch] = asyncio.Queue()
        self.scorers: list = []
        self.tokenizer = None
        self.scored = 0
        """Samples scored since the last heartbeat."""
        self.busy_s = 0.0
        """Seconds spent scoring since the last heartbeat."""
        self.total = 0
        self.last_heard = time.monotonic()

    async def run(self) -> int:
        """Serve until the learner says Shutdown (or `stopped` is set); the exit code."""
        t = self.cfg.transport
        self.control = configure(self.ctx.socket(zmq.DEALER), t, limit_size=False)
        security.make_client(self.control, t)
        self.control.connect(self.endpoint)
        tasks: list[asyncio.Task] = []
        try:
            welcome = await self._join()
            if welcome is None:
                return 3 if not self._parent_gone() else 0
            tasks = [asyncio.create_task(c) for c in (
                self._receive_loop(), self._heartbeat_loop(welcome), self._work_loop(welcome),
                self.stopped.wait())]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            log.info("scorer %s done: %d samples scored", self.scorer_id, self.total)
            return 0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in self.scorers:
                await s.close()
            sockets.close(self.ctx, t, [self.control])

    def _hello(self) -> bytes:
        return self.enc.encode(m.ScorerHello(protocol_version=m.PROTOCOL_VERSION,
                                             scorer_id=self.scorer_id,
                                             incarnation=self.incarnation, scorers=self.names))

    async def _join(self) -> m.ScorerWelcome | None:
        """ScorerHello until a ScorerWelcome (None after a Reject, or once the parent is gone)."""
        while True:
            await self.control.send(self._hello())
            if await self.control.poll(self.cfg.transport.peer_timeout_s * 1000):
                msg = self.dec.to_scorer.decode(await self.control.recv())
                match msg:
                    case m.ScorerWelcome():
                        log.info("joined learner run %s at %s", msg.run_id, self.endpoint)
                        return msg
                    case m.Reject(reason=reason):
                        log.error("scorer %s cannot join: %s", self.scorer_id, reason)
                        return None
            if self._parent_gone():
                return None

    def _build_tokenizer(self, welcome: m.ScorerWelcome):
        from models.tiny import load_tokenizer

        model_dir = self.cache_dir / welcome.run_id
        model_dir.mkdir(parents=True, exist_ok=True)
        for name, data in welcome.model_files.items():
            if Path(name).name != name or name.startswith("."):
                raise RuntimeError(f"learner sent a model file with an unsafe name: {name!r}")
            tmp = model_dir / f".{name}.{self.scorer_id}.tmp"
            tmp.write_bytes(data)
            tmp.replace(model_dir / name)
        return load_tokenizer(model_dir)

    async def _receive_loop(self) -> None:
        while True:
            try:
                msg = self.dec.to_scorer.decode(await self.control.recv())
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("undecodable message from the learner: %s", e)
                continue
            self.last_heard = time.monotonic()
            match msg:
                case m.ScoreBatch():
                    self.batches.put_nowait(msg)
                case m.Shutdown(reason=reason):
                    log.info("learner says shut down: %s", reason)
                    self.stopped.set()
                    return
                case m.Reject(reason=reason):
                    log.warning("learner refused a message (%s): saying hello again", reason)
                    await self.control.send(self._hello())
                case m.HeartbeatAck() | m.ScorerWelcome():
                    pass

    async def _heartbeat_loop(self, welcome: m.ScorerWelcome) -> None:
        while True:
            beat = m.ScorerHeartbeat(scorer_id=self.scorer_id, scored=self.scored,
                                     busy_us=int(self.busy_s * 1e6))
            self.scored, self.busy_s = 0, 0.0
            await self.control.send(self.enc.encode(beat))
            await asyncio.sleep(welcome.heartbeat_s)  # a timer, not synchronisation
            if self._parent_gone():
                return
            silent = time.monotonic() - self.last_heard
            if silent > welcome.peer_timeout_s:
                log.warning("learner silent for %.1fs; saying hello again", silent)
                await self.control.send(self._hello())
                self.last_heard = time.monotonic()

    async def _work_loop(self, welcome: m.ScorerWelcome) -> None:
        from tasks.scorers import make_item

        self.tokenizer = await asyncio.to_thread(self._build_tokenizer, welcome)
        self.scorers = await build_scorers(self.cfg)
        log.info("scorer %s ready: %s", self.scorer_id,
                 ", ".join(f"{s.name} ({type(s).__name__})" for s in self.scorers))
        while True:
            batch = await self.batches.get()
            t0 = time.monotonic()
            items = [make_item(self.tokenizer, it.meta, it.prompt_ids.to_numpy(),
                               it.completion_ids.to_numpy()) for it in batch.items]
            error, results = "", []
            try:
                scores = await score_items(self.scorers, items)
            except Exception as e:  # a model or endpoint failed: the learner reassigns the batch
                log.warning("batch %d failed: %r", batch.batch_id, e)
                error = f"{type(e).__name__}: {e}"[:500]
            else:
                results = [m.ItemScores(item_id=it.item_id, scores=s)
                           for it, s in zip(batch.items, scores)]
                self.scored += len(items)
                self.total += len(items)
            self.busy_s += time.monotonic() - t0
            await self.control.send(self.enc.encode(m.ScoreDone(
                scorer_id=self.scorer_id, batch_id=batch.batch_id, results=results,
                error=error)))

    def _parent_gone(self) -> bool:
        if self.parent_pid is None or os.getppid() == self.parent_pid:
            return False
        log.warning("parent process %d is gone: stopping", self.parent_pid)
        self.stopped.set()
        return True


def parse_args(argv: list[str]) -> argparse.Namespace:
    from configs.loader import describe

    p = argparse.ArgumentParser(
        prog="tether-scorer", description="Tether scorer (the model scorers of task.scorers).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config fields (override with key=value):\n" + "\n".join(describe()))
    p.add_argument("-c", "--config", help="YAML preset (the learner's run_dir/config.yaml)")
    p.add_argument("--scorer-id", default=f"scorer-{socket.gethostname()}-{os.getpid()}",
                   help="unique name of this scorer (default: scorer-host-pid)")
    p.add_argument("--cache-dir", default=None,
                   help="where the learner's tokenizer files go (default: RUN_DIR/scorer_cache)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="exit when the parent process dies (the learner's local scorers)")
    p.add_argument("args", nargs="*", help="LEARNER address and key=value overrides")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from configs.loader import ConfigError, load_config, resolve_endpoint, setup_process

    ns = parse_args(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in ns.args if "=" in a and not a.startswith("tcp://")]
    targets = [a for a in ns.args if a not in overrides]
    try:
        cfg = load_config(ns.config, overrides)
        if len(targets) != 1:
            raise ConfigError(f"give exactly one learner address, got {targets or 'none'}")
        endpoint = resolve_endpoint(targets[0])
        if not model_scorers(cfg):
            raise ConfigError("task.scorers has no model scorer (classifier, judge, remote): "
                              "there is nothing for a scorer to run")
    except ConfigError as e:
        print(f"tether-scorer: {e}", file=sys.stderr)
        return 2
    setup_process(f"scorer[{ns.scorer_id}]")
    from actors import forked
    from actors.scratch import scratch_dir

    cache = Path(ns.cache_dir) if ns.cache_dir else Path(cfg.run_dir) / "scorer_cache"
    with scratch_dir():  # a vLLM judge's temporary files go there
        forked.enable()
        scorer = Scorer(cfg, endpoint, ns.scorer_id, cache,
                        parent_pid=os.getppid() if ns.exit_with_parent else None)

        async def run() -> int:
            import signal

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, scorer.stopped.set)
            return await scorer.run()

        return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
