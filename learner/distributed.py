"""The learner's ranks: rank 0 runs the learner loop (sockets, buffer, leases, evaluation) and
tells the other ranks, one command at a time, which collective step comes next.

    rank 0: learner/main.py through `Leader`            ranks 1..N-1: `follow()`
      step(groups, v)   ── STEP v + the batch ──────▶   Trainer.step(groups, v) on its share
      gather_weights(v) ── GATHER v ────────────────▶   all-gather each tensor; keep and pack
                                                        its own buckets, or drop it
                           (LoRA: the adapter's tensors only)
      gather_base()     ── GATHER_BASE ───────────▶   LoRA, once: the frozen base, likewise
      save_checkpoint   ── SAVE + directory ────────▶   write its shards
      export_hf         ── EXPORT + directory ──────▶   all-gather each tensor, drop it
                           (rank 0 writes the files after STOP and `close`: nobody waits)
      idle()            ── IDLE (every 5 s waiting) ▶   nothing; keeps the group timeout for hangs
      stop()            ── STOP ────────────────────▶   return

Commands and batches are `torch.distributed.broadcast`s of tensors from rank 0, never pickle:
a command is int64 [op, version], then the sizes of the op's arrays (`PAYLOADS`), then each
non-empty array: a batch of groups in the record codec's arrays (buffer/record.py
`to_arrays`) or a directory name. Followers block in that broadcast; rank 0 is the only rank
with sockets to actors. With full weights over ZeroMQ, every rank packs and serves its own
buckets of each version through rank 0 (transport/weightsrc/shards.py, `Leader.link`).

Signals: the followers ignore SIGINT/SIGTERM. On rank 0, with more than one rank, a signal
only sets a flag that the loop checks between steps (`check_interrupt`), so no rank is ever
left inside a collective; the loop then checkpoints with everyone and sends STOP.
"""

from __future__ import annotations

import atexit
import datetime
import enum
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from buffer import record
from buffer.record import TrajGroup
from configs.schema import BackendConfig, TetherConfig
from learner.backends.base import Backend
from learner.backends.registry import loads_sharded, make_backend, runs_under_torchrun
from learner.algo.critic import AlgoModels, FrozenBase, ValueModel, needs_critic
from learner.algo.trainer import Trainer
from learner.publisher import Publisher
from models.devices import resolve_device, torch_dtype
from transport.weights import PackedWeights, pack
from transport.weightsrc.shards import Link

log = logging.getLogger(__name__)


class Op(enum.IntEnum):
    IDLE = 0
    STEP = 1
    GATHER = 2
    SAVE = 3
    EXPORT = 4
    STOP = 5
    GATHER_BASE = 6


@dataclass(frozen=True)
class Ranks:
    rank: int
    """This process's rank (0 = the one with sockets)."""
    world: int
    """Number of learner processes."""
    device: torch.device
    """This rank's training device (cuda:LOCAL_RANK with NCCL, cpu with gloo)."""


def start(backend: BackendConfig, device: str = "auto", gpu: int | None = None,
          timeout_s: float = 1800.0) -> Ranks:
    """Join the torchrun process group for a backend that trains over torchrun ranks (fsdp2,
    megatron; NCCL when `device` resolves to CUDA, else gloo), every collective bounded by
    `timeout_s` (learner.collective_timeout_s). `device` is `learner.device`
    (models/devices.py); on CUDA this rank uses `cuda:<gpu>` (its GPU in the node's placement,
    configs/placement.py), cuda:LOCAL_RANK when `gpu` is None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not runs_under_torchrun(backend):
        if world > 1:
            raise RuntimeError(f"learner.backend={backend.kind} cannot run on {world} torchrun "
                               "ranks; use learner.backend=fsdp2")
        return Ranks(0, 1, resolve_device(device, "learner.device", gpu or 0))
    if "RANK" not in os.environ:
        raise RuntimeError(f"learner.backend={backend.kind} runs under torchrun: torchrun "
                           f"--nproc_per_node N -m learner -c CONFIG "
                           f"learner.backend={backend.kind}")
    index = int(os.environ["LOCAL_RANK"]) if gpu is None else gpu
    dev = resolve_device(device, "learner.device", index)
    timeout = datetime.timedelta(seconds=timeout_s)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    log.info("rank %d of %d on %s (%s, collective timeout %gs)", dist.get_rank(), world, dev,
             dist.get_backend(), timeout_s)
    return Ranks(dist.get_rank(), world, dev)


def barrier(ranks: Ranks) -> None:
    if ranks.world > 1:
        dist.barrier()


def close(ranks: Ranks) -> None:
    """Leave the process group together (a barrier first, so no rank tears gloo down while a
    peer still uses it); the process then ends with `exit_rank`."""
    if ranks.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank's process after `close`: run the atexit handlers (logging,
    multiprocessing, trackers) while the interpreter is whole, flush, and `os._exit(code)`,
    skipping interpreter finalization.

    Why: after an FSDP2 run, destroy_process_group does not stop gloo's worker threads
    (something in FSDP2/DTensor still holds the group; a bare gloo group's threads are joined
    there), and one of them may still be releasing the last collective's work when the main
    thread returns: `barrier` keeps weak references to the works queued before it, and those
    hold tensors with Python objects, whose release takes the GIL. A thread that asks for the
    GIL while Python 3.11 finalizes is ended by pthread_exit inside a noexcept destructor:
    std::terminate, SIGABRT, "terminate called without an active exception" (core dump:
    Py_FinalizeEx in the main thread, the worker in ~AsyncBarrierWork ->
    ~AsyncAllgatherCoalescedWork -> decref_pyobject -> take_gil). Seen in 3 of 103 two-rank
    resumes here (0 of 180 with this exit) and twice in whole-suite runs. The race is in the
    interpreter's exit, so the fix is not to have one."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def make_models(cfg: TetherConfig, ranks: Ranks, policy: Backend | None = None) -> AlgoModels:
    """The frozen reference (kl_coef > 0) and the critic (gae, vtrace) this config needs,
    with learner.backend (learner/algo/critic.py); every rank calls it, in this order."""
    L, M = cfg.learner, cfg.model
    dtype = torch_dtype(M.dtype, ranks.device)  # both compute as the policy does
    out = AlgoModels()
    if L.kl_coef > 0 and policy is not None and policy.lora is not None and not M.ref_path:
        out.reference = FrozenBase(policy)  # the policy with its adapters off: no second copy
    elif L.kl_coef > 0:
        out.reference = make_backend(L.backend, Path(M.ref_path or M.path), 0.0, 0.0, L.seed,
                                     ranks.device, dtype)
        out.reference.model.requires_grad_(False)
        out.reference.model.eval()
    if needs_critic(cfg):
        path = Path(M.critic_path or M.path)
        out.critic = make_backend(L.backend, path, L.critic_lr, L.weight_decay, L.seed,
                                  ranks.device, dtype,
                                  model=ValueModel(path, meta=loads_sharded(L.backend)),
                                  activation_checkpointing=L.activation_checkpointing)
    return out


class Leader:
    """Rank 0's handle on the learner's ranks: each call tells the others, then does its part.
    With one rank it only does its part."""

    def __init__(self, trainer: Trainer, backend: Backend, ranks: Ranks, bucket_bytes: int,
                 link: Link | None = None) -> None:
        """`link`: rank 0's end of the ranks' bucket channel (transport/weightsrc/shards.py),
        None when rank 0 packs whole versions."""
        self.link = link
        self.trainer = trainer
        self.backend = backend
        self.ranks = ranks
        self.bucket_bytes = bucket_bytes
        self._interrupted = threading.Event()
        if ranks.world > 1:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda signum, frame: self._interrupted.set())

    def request_stop(self) -> None:
        """Make the next check_interrupt raise (a signal that must not cut start-up short)."""
        self._interrupted.set()

    def stop_requested(self) -> bool:
        return self._interrupted.is_set()

    def check_interrupt(self) -> None:
        """Raise KeyboardInterrupt if a signal arrived (multi-rank: between steps only)."""
        if self._interrupted.is_set():
            raise KeyboardInterrupt("signal")

    def step(self, groups: list[TrajGroup], version: int) -> dict[str, float]:
        self._send(Op.STEP, version, record.to_arrays(groups))
        return self.trainer.step(groups, version)

    def gather_weights(self, version: int, publisher: Publisher) -> None:
        """Gather the full weights (LoRA: the adapter) tensor by tensor into `publisher`'s
        queue, full weights in the engines' dtype (`publish_dtype`: each rank casts its shard
        before the gather; with `link`, each rank keeps its own buckets' tensors, else only
        rank 0 keeps them).
        Returns once the last tensor is queued; the packer thread announces the version
        (learner/publisher.py). LoRA tensors stay fp32: engines merge them into the base."""
        self._send(Op.GATHER, version)
        if self.backend.lora is not None:
            publisher.publish(version, self.backend.named_adapter_tensors(), kind="adapter",
                              lora=self.backend.lora)
            return
        dtype = publish_dtype(self.trainer, self.ranks)
        publisher.publish(version, self.backend.named_full_tensors(dtype), dtype=dtype)

    def gather_base(self) -> PackedWeights | None:
        """LoRA: the frozen base weights, gathered once (actors get them when they join);
        None when the full weights train."""
        if self.backend.lora is None:
            return None
        self._send(Op.GATHER_BASE, -1)
        return pack(self.backend.named_full_tensors(), -1, self.bucket_bytes, kind="base")

    def save_checkpoint(self, path: Path, extra: dict) -> None:
        self._send(Op.SAVE, 0, _path_array(path))
        self.backend.save_checkpoint(path, extra)
        self.trainer.models.save(path)

    def export_hf(self, path: Path) -> Callable[[], None]:
        """Gather the export with every rank (a collective); returns rank 0's write of it, to
        be called once the other ranks no longer wait on a collective (after `stop`)."""
        self._send(Op.EXPORT, 0, _path_array(path))
        return self.backend.gather_export(path)

    def idle(self) -> None:
        self._send(Op.IDLE, 0)

    def stop(self) -> None:
        self._send(Op.STOP, 0)

    def _send(self, op: Op, version: int, arrays: dict[str, np.ndarray] | None = None) -> None:
        if self.ranks.world == 1:
            return
        dev = self.ranks.device
        dist.broadcast(torch.tensor([int(op), version], device=dev), src=0)
        schema = PAYLOADS[op]
        if not schema:
            return
        assert list(arrays) == list(schema), (list(arrays), list(schema))
        dist.broadcast(torch.tensor([a.size for a in arrays.values()], device=dev), src=0)
        for a in arrays.values():
            if a.size:
                dist.broadcast(torch.from_numpy(np.ascontiguousarray(a)).to(dev), src=0)


def publish_dtype(trainer: Trainer, ranks: Ranks) -> torch.dtype:
    """The dtype versions are published in: the engines' (`model.dtype`), on every rank."""
    return torch_dtype(trainer.cfg.model.dtype, ranks.device)


def all_gather_strings(ranks: Ranks, s: str, size: int = 512) -> list[str]:
    """Collective: every rank's `s` (at most `size` bytes of UTF-8), in rank order."""
    raw = s.encode()
    if len(raw) > size:
        raise ValueError(f"{s!r} is longer than {size} bytes")
    mine = torch.zeros(size, dtype=torch.uint8)
    mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.zeros(size, dtype=torch.uint8, device=ranks.device) for _ in range(ranks.world)]
    dist.all_gather(out, mine.to(ranks.device))
    return [bytes(t.cpu().numpy()).rstrip(b"\0").decode() for t in out]


def follow(trainer: Trainer, backend: Backend, ranks: Ranks,
           publisher: Publisher | None = None) -> None:
    """Ranks 1..N-1: do what rank 0 says until it says STOP. `publisher`: this rank packs its
    own buckets of each version into it (transport/weightsrc/shards.py), else None."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    steps = 0
    while True:
        op, version, arrays = _receive(ranks.device)
        match op:
            case Op.IDLE:
                pass
            case Op.STEP:
                trainer.step(record.from_arrays(arrays), version)
                steps += 1
            case Op.GATHER if publisher is not None:
                dtype = publish_dtype(trainer, ranks)
                publisher.publish(version, backend.named_full_tensors(dtype), dtype=dtype)
            case Op.GATHER:
                named = (backend.named_full_tensors(publish_dtype(trainer, ranks))
                         if backend.lora is None
                         else backend.named_adapter_tensors())
                for _ in named:
                    pass
            case Op.GATHER_BASE:
                for _ in backend.named_full_tensors():
                    pass
            case Op.SAVE:
                backend.save_checkpoint(_array_path(arrays), {})
                trainer.models.save(_array_path(arrays))
            case Op.EXPORT:
                backend.gather_export(_array_path(arrays))  # rank 0 writes it, alone
            case Op.STOP:
                log.info("rank %d: stop after %d steps", ranks.rank, steps)
                if publisher is not None:  # its last part is with rank 0 (or its error raised)
                    publisher.wait()
                return


PATH = {"path": np.dtype(np.uint8)}
PAYLOADS: dict[Op, dict[str, np.dtype]] = {
    Op.IDLE: {}, Op.STEP: record.SCHEMA, Op.GATHER: {}, Op.SAVE: PATH, Op.EXPORT: PATH,
    Op.STOP: {}, Op.GATHER_BASE: {},
}
"""The arrays each command carries after its [op, version] head, in broadcast order."""


def _receive(device: torch.device) -> tuple[Op, int, dict[str, np.ndarray]]:
    head = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(head, src=0)
    op, version = Op(int(head[0])), int(head[1])
    schema = PAYLOADS[op]
    if not schema:
        return op, version, {}
    sizes = torch.zeros(len(schema), dtype=torch.int64, device=device)
    dist.broadcast(sizes, src=0)
    arrays = {}
    for (name, dtype), n in zip(schema.items(), sizes.tolist()):
        t = torch.zeros(n, dtype=_TORCH[dtype], device=device)
        if n:
            dist.broadcast(t, src=0)
        arrays[name] = t.cpu().numpy()
    return op, version, arrays


_TORCH = {dt: torch.from_numpy(np.empty(0, dt)).dtype
          for schema in PAYLOADS.values() for dt in schema.values()}
"""The torch dtype of every array a command carries, derived from PAYLOADS (so a record dtype
changed in buffer/record.py TOKEN_FIELDS needs no edit here)."""


def _path_array(path: Path) -> dict[str, np.ndarray]:
    return {"path": np.frombuffer(str(path).encode(), np.uint8)}


def _array_path(arrays: dict[str, np.ndarray]) -> Path:
    return Path(arrays["path"].tobytes().decode())
