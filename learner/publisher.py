"""The learner's packer thread: gathered tensors become a published version off the trainer's
critical path.

    trainer thread (each rank)                      packer thread
      publish(v, tensors):                            pack(): copy each tensor into its bucket
        per tensor: gather (a collective under          ─▶ SHA-256 digest of every bucket
        FSDP2) ─▶ cast to the engine dtype (the         ─▶ delta against v - 1 (XOR + zstd,
        copy that snapshots it) ─▶ put ───▶ queue ──▶       transport.weight_full_every > 0)
      returns once the last tensor is queued            ─▶ deliver(Published): announce v
      step v + 1 ...

Backpressure: the queue holds at most `budget_bytes` of tensors (two buckets by default). When
the packer falls behind, `publish` blocks in `put` until it has room, so the trainer never runs
more than that ahead of the packer, and host memory for a version in flight stays at about one
version of buckets plus the budget. A version's packing begins only after the previous one was
delivered (one packer thread, one queue). An error in the packer is raised in the trainer
thread by the next `publish` or `wait`. With several learner ranks (`world`), each packs only
its own buckets and rank 0's `deliver` waits for the others' (transport/weightsrc/shards.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from transport.messages import LoraSpec
from transport.weights import Layout, PackedWeights, pack
from transport.weightsrc import delta
from transport.weightsrc.store import Published

log = logging.getLogger(__name__)

_END = object()
_ABORT = object()
"""Queued by a publish that was interrupted (e.g. Ctrl-C): the packer drops that version."""


class _Aborted(Exception):
    pass


class Publisher:
    def __init__(self, bucket_bytes: int, full_every: int,
                 deliver: Callable[[Published], None], budget_bytes: int | None = None,
                 rank: int = 0, world: int = 1) -> None:
        """`deliver`: called in the packer thread with each finished version (announce it).
        `world` > 1: this learner rank packs only its own buckets of each full version
        (transport/weightsrc/shards.py); the other ranks' tensors are queued as meta tensors,
        neither copied nor counted against the budget."""
        self.rank, self.world = rank, world
        self.bucket_bytes = bucket_bytes
        self.full_every = full_every
        self.deliver = deliver
        self.budget = budget_bytes or 2 * bucket_bytes
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._jobs: deque = deque()
        self._latest: Published | None = None
        self._pending = 0
        """Versions handed to publish() and not delivered yet."""
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="learner-packer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ trainer thread
    def publish(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]],
                dtype: torch.dtype | None = None, kind: str = "full",
                lora: LoraSpec | None = None) -> None:
        """Queue version `version`'s tensors (each cast to `dtype` if floating, else copied:
        the queued tensor is a snapshot the next optimizer step cannot change). Blocks while
        the queue is full (backpressure); returns once the last tensor is queued."""
        layout = Layout(self.bucket_bytes, self.world) if self.world > 1 else None
        with self._cond:
            self._raise()
            self._pending += 1
            self._jobs.append((version, kind, lora, layout))
            self._cond.notify_all()
        try:
            for name, t in tensors:
                t = t.detach()
                out = dtype if dtype is not None and t.is_floating_point() else t.dtype
                if layout is not None and layout.place(t.numel() * out.itemsize) != self.rank:
                    self._put((name, torch.empty(t.shape, dtype=out, device="meta")), 0)
                    continue
                snap = t.to(out, copy=True) if out != t.dtype else t.clone()
                self._put((name, snap), snap.numel() * snap.element_size())
        except BaseException:  # a half-queued version must not be announced
            self._put(_ABORT, 0)
            raise
        self._put(_END, 0)

    def wait(self) -> Published:
        """The newest delivered version, after every publish so far was delivered."""
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait()
            self._raise()
            return self._latest

    def _put(self, item, nbytes: int) -> None:
        with self._cond:
            while self._queued_bytes and self._queued_bytes + nbytes > self.budget:
                self._raise()
                self._cond.wait()
            self._raise()
            self._queue.append((item, nbytes))
            self._queued_bytes += nbytes
            self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("the learner's packer thread failed") from self._error

    # ------------------------------------------------------------ packer thread
    def _take(self):
        with self._cond:
            while not self._queue:
                self._cond.wait()
            item, nbytes = self._queue.popleft()
            self._queued_bytes -= nbytes
            self._cond.notify_all()
            return item

    def _stream(self):
        while (item := self._take()) is not _END:
            if item is _ABORT:
                raise _Aborted
            yield item

    def _run(self) -> None:
        prev: PackedWeights | None = None
        try:
            while True:
                with self._cond:
                    while not self._jobs:
                        self._cond.wait()
                    version, kind, lora, layout = self._jobs.popleft()
                t0 = time.monotonic()
                keep = None if layout is None else (lambda i: layout.owners[i] == self.rank)
                try:
                    packed = pack(self._stream(), version, self.bucket_bytes, kind=kind,
                                  lora=lora, keep=keep)
                except _Aborted:
                    log.warning("v%d was not published: its gathering was interrupted", version)
                    with self._cond:
                        self._pending -= 1
                        self._cond.notify_all()
                    continue
                d = None
                if (self.full_every and prev is not None
                        and prev.manifest.version == version - 1):
                    d = delta.make(packed, prev)
                prev = packed if kind == "full" and self.full_every else None
                pub = Published(full=packed, delta=d)
                self.deliver(pub)
                own = ("" if layout is None else f" (rank {self.rank} packed "
                       f"{sum(b is not None for b in packed.buckets)})")
                log.info("published v%d (%s): %d buckets%s, %.3f MB%s, packed in %.2f s",
                         version, kind, packed.manifest.num_buckets, own,
                         packed.manifest.total_bytes / 1e6,
                         f", delta {d.manifest.total_bytes / 1e6:.3f} MB" if d else "",
                         time.monotonic() - t0)
                with self._cond:
                    self._latest = pub
                    self._pending -= 1
                    self._cond.notify_all()
        except BaseException as e:  # handed to the trainer thread, which raises it
            log.exception("packer thread failed")
            with self._cond:
                self._error = e
                self._cond.notify_all()
