"""The learner's ranks: rank 0 runs the learner loop (sockets, buffer, leases, evaluation) and
tells the other ranks, one command at a time, which collective step comes next.

    rank 0: learner/main.py through `Leader`            ranks 1..N-1: `follow()`
      step(groups, v)   ── STEP v + the batch ──────▶   Trainer.step(groups, v) on its share
      publish(v)        ── PUBLISH v ───────────────▶   all-gather each tensor, drop it
      save_checkpoint   ── SAVE + directory ────────▶   write its shards
      export_hf         ── EXPORT + directory ──────▶   all-gather each tensor, drop it
      idle()            ── IDLE (every 5 s waiting) ▶   nothing; keeps the group timeout for hangs
      stop()            ── STOP ────────────────────▶   return

Commands and batches are `torch.distributed.broadcast`s of tensors from rank 0, never pickle:
a command is int64 [op, version, n_ints, n_floats], followed (if non-empty) by an int64 and a
float32 payload: a batch of groups (`pack_groups`) or a directory name. Followers block in
that broadcast; rank 0 is the only rank with sockets.

Signals: the followers ignore SIGINT/SIGTERM. On rank 0, with more than one rank, a signal
only sets a flag that the loop checks between steps (`check_interrupt`), so no rank is ever
left inside a collective; the loop then checkpoints with everyone and sends STOP.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from buffer.replay import TrajGroup
from learner.backend import Backend, SingleProcessBackend
from learner.trainer import Trainer
from transport.weights import PackedWeights, pack

log = logging.getLogger(__name__)


class Op(enum.IntEnum):
    IDLE = 0
    STEP = 1
    PUBLISH = 2
    SAVE = 3
    EXPORT = 4
    STOP = 5


@dataclass(frozen=True)
class Ranks:
    rank: int
    """This process's rank (0 = the one with sockets)."""
    world: int
    """Number of learner processes."""
    device: torch.device
    """This rank's training device (cuda:LOCAL_RANK with NCCL, cpu with gloo)."""


def start(backend: str) -> Ranks:
    """Join the torchrun process group for `fsdp2` or `megatron` (NCCL if CUDA is available,
    else gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if backend == "single":
        if world > 1:
            raise RuntimeError(f"learner.backend=single cannot run on {world} torchrun ranks; "
                               "use learner.backend=fsdp2")
        return Ranks(0, 1, torch.device("cpu"))
    if "RANK" not in os.environ:
        raise RuntimeError(f"learner.backend={backend} runs under torchrun: torchrun "
                           f"--nproc_per_node N -m learner -c CONFIG learner.backend={backend}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    log.info("rank %d of %d on %s (%s)", dist.get_rank(), world, device, dist.get_backend())
    return Ranks(dist.get_rank(), world, device)


def barrier(ranks: Ranks) -> None:
    if ranks.world > 1:
        dist.barrier()


def close(ranks: Ranks) -> None:
    """Leave the process group together: a rank that tears gloo down while a peer still uses
    it can abort (seen once as SIGABRT "terminate called without an active exception")."""
    if ranks.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def make_backend(backend: str, model_dir: Path, lr: float, weight_decay: float, seed: int,
                 ranks: Ranks, tp: int = 1, pp: int = 1) -> Backend:
    """`tp`, `pp`: Megatron's tensor/pipeline-parallel sizes (megatron only)."""
    if backend == "single":
        return SingleProcessBackend(model_dir, lr, weight_decay, seed)
    if backend == "megatron":
        from learner.megatron import MegatronBackend

        return MegatronBackend(model_dir, lr, weight_decay, seed, ranks.device, tp, pp)
    from learner.fsdp import FSDP2Backend

    return FSDP2Backend(model_dir, lr, weight_decay, seed, ranks.device)


class Leader:
    """Rank 0's handle on the learner's ranks: each call tells the others, then does its part.
    With one rank it only does its part."""

    def __init__(self, trainer: Trainer, backend: Backend, ranks: Ranks, bucket_bytes: int) -> None:
        self.trainer = trainer
        self.backend = backend
        self.ranks = ranks
        self.bucket_bytes = bucket_bytes
        self._interrupted = threading.Event()
        if ranks.world > 1:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda signum, frame: self._interrupted.set())

    def check_interrupt(self) -> None:
        """Raise KeyboardInterrupt if a signal arrived (multi-rank: between steps only)."""
        if self._interrupted.is_set():
            raise KeyboardInterrupt("signal")

    def step(self, groups: list[TrajGroup], version: int) -> dict[str, float]:
        self._send(Op.STEP, version, *pack_groups(groups))
        return self.trainer.step(groups, version)

    def publish(self, version: int) -> PackedWeights:
        """Gather the full weights tensor by tensor into buckets (only rank 0 keeps them)."""
        self._send(Op.PUBLISH, version)
        return pack(self.backend.named_full_tensors(), version, self.bucket_bytes)

    def save_checkpoint(self, path: Path, extra: dict) -> None:
        self._send(Op.SAVE, 0, _path_ints(path))
        self.backend.save_checkpoint(path, extra)

    def export_hf(self, path: Path) -> None:
        self._send(Op.EXPORT, 0, _path_ints(path))
        self.backend.export_hf(path)

    def idle(self) -> None:
        self._send(Op.IDLE, 0)

    def stop(self) -> None:
        self._send(Op.STOP, 0)

    def _send(self, op: Op, version: int, ints: np.ndarray | None = None,
              floats: np.ndarray | None = None) -> None:
        if self.ranks.world == 1:
            return
        ints = np.zeros(0, np.int64) if ints is None else ints
        floats = np.zeros(0, np.float32) if floats is None else floats
        dev = self.ranks.device
        dist.broadcast(torch.tensor([int(op), version, ints.size, floats.size], device=dev), src=0)
        for payload in (ints, floats):
            if payload.size:
                dist.broadcast(torch.from_numpy(payload).to(dev), src=0)


def follow(trainer: Trainer, backend: Backend, ranks: Ranks) -> None:
    """Ranks 1..N-1: do what rank 0 says until it says STOP."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    steps = 0
    while True:
        op, version, ints, floats = _receive(ranks.device)
        match op:
            case Op.IDLE:
                pass
            case Op.STEP:
                trainer.step(unpack_groups(ints, floats), version)
                steps += 1
            case Op.PUBLISH:
                for _ in backend.named_full_tensors():
                    pass
            case Op.SAVE:
                backend.save_checkpoint(_ints_path(ints), {})
            case Op.EXPORT:
                backend.export_hf(_ints_path(ints))
            case Op.STOP:
                log.info("rank %d: stop after %d steps", ranks.rank, steps)
                return


def _receive(device: torch.device) -> tuple[Op, int, np.ndarray, np.ndarray]:
    head = torch.zeros(4, dtype=torch.int64, device=device)
    dist.broadcast(head, src=0)
    op, version, n_ints, n_floats = (int(x) for x in head.cpu())
    payloads = []
    for n, dtype in ((n_ints, torch.int64), (n_floats, torch.float32)):
        t = torch.zeros(n, dtype=dtype, device=device)
        if n:
            dist.broadcast(t, src=0)
        payloads.append(t.cpu().numpy())
    return Op(op), version, payloads[0], payloads[1]


def _path_ints(path: Path) -> np.ndarray:
    return np.frombuffer(str(path).encode(), np.uint8).astype(np.int64)


def _ints_path(ints: np.ndarray) -> Path:
    return Path(ints.astype(np.uint8).tobytes().decode())


def pack_groups(groups: list[TrajGroup]) -> tuple[np.ndarray, np.ndarray]:
    """Groups -> (int64, float32) flat arrays. ints: [G, S], per group (lease_id, prompt_id,
    uses, prompt length, samples), per sample its length, then prompt tokens, completion tokens
    and token versions; floats: per-sample rewards, then logprobs and loss masks per token."""
    table = np.array([[g.lease_id, g.prompt_id, g.uses, len(g.prompt_ids), len(g.completions)]
                      for g in groups], np.int64).reshape(-1)
    lengths = np.array([len(c) for g in groups for c in g.completions], np.int64)
    ints = np.concatenate([np.array([len(groups), lengths.size], np.int64), table, lengths,
                           *[g.prompt_ids for g in groups],
                           *[c for g in groups for c in g.completions],
                           *[v for g in groups for v in g.versions]]).astype(np.int64)
    floats = np.concatenate([*[g.rewards for g in groups],
                             *[lp for g in groups for lp in g.logprobs],
                             *[m for g in groups for m in g.loss_masks]]).astype(np.float32)
    return ints, floats


def unpack_groups(ints: np.ndarray, floats: np.ndarray) -> list[TrajGroup]:
    """Inverse of `pack_groups` (actor ids are not sent: the followers only train)."""
    num_groups, num_samples = int(ints[0]), int(ints[1])
    table = ints[2:2 + 5 * num_groups].reshape(num_groups, 5)
    at = 2 + 5 * num_groups
    lengths = ints[at:at + num_samples]
    at += num_samples
    prompts = _split(ints, at, table[:, 3])
    at += int(table[:, 3].sum())
    tokens = int(lengths.sum())
    completions = _split(ints, at, lengths)
    versions = _split(ints, at + tokens, lengths)
    rewards = floats[:num_samples]
    logprobs = _split(floats, num_samples, lengths)
    masks = _split(floats, num_samples + tokens, lengths)
    groups, s = [], 0
    for (lease_id, prompt_id, uses, _, n), prompt in zip(table, prompts):
        n = int(n)
        groups.append(TrajGroup(lease_id=int(lease_id), prompt_id=int(prompt_id), actor_id="",
                                prompt_ids=prompt, completions=completions[s:s + n],
                                logprobs=logprobs[s:s + n], versions=versions[s:s + n],
                                loss_masks=masks[s:s + n], rewards=rewards[s:s + n].copy(),
                                uses=int(uses)))
        s += n
    return groups


def _split(flat: np.ndarray, start: int, lengths: np.ndarray) -> list[np.ndarray]:
    ends = start + np.cumsum(lengths)
    return [flat[e - int(n):e].copy() for e, n in zip(ends, lengths)]
