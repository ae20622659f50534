"""Versioned weights as buckets of raw bytes.

The learner packs a state dict once per version (`pack`), casting each floating tensor to the
engine's dtype as it copies it into its bucket (one copy per tensor, no intermediate bytes);
the same immutable buckets are sent to every peer that asks, zero-copy. Every bucket has a
SHA-256 digest in the manifest (`digest`), which every actor checks. Tensors start at
16-byte aligned offsets, so `unpack` rebuilds them as views of their bucket without copying.
Only raw bytes + dtype + shape cross the wire, never pickle.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from transport.messages import LoraSpec, TensorMeta, WeightManifest
from transport.weightsrc.integrity import digest

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}
ALIGN = 16
"""Every tensor's offset in its bucket, and every bucket's size, is a multiple of this."""


@dataclass(frozen=True)
class PackedWeights:
    """One published weight version: the manifest plus its buckets (immutable once built)."""

    manifest: WeightManifest
    buckets: tuple


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
         bucket_bytes: int, kind: str = "full", lora: LoraSpec | None = None,
         dtype: torch.dtype | None = None, keep: Callable[[int], bool] | None = None
         ) -> PackedWeights:
    """Serialize `state` into buckets of at most ~bucket_bytes (a larger tensor gets its own).
    `state` may be a generator of (name, tensor): each tensor is needed only until it is copied
    into its bucket, so a sharded learner can gather one full tensor at a time. `dtype`: cast
    floating-point tensors to it while copying (the engine's dtype; None keeps each tensor's).
    `kind`, `lora`: what the manifest says it carries (transport/messages.py WEIGHT_KINDS).

    `keep(i)` false: bucket i is another learner rank's (transport/weightsrc/shards.py). Its
    place in the layout is the same (the layout depends only on the tensors' sizes), its tensors
    may be meta tensors, and it is neither filled nor hashed: its entry in `buckets` is None and
    its digest b"". The manifest's tensors and sizes are whole on every rank."""
    metas: list[TensorMeta] = []
    buckets: list[bytearray | None] = []
    sizes: list[int] = []
    current: bytearray | None = None
    size = 0
    is_open = False

    def close() -> None:
        nonlocal current, is_open
        if current is not None:
            del current[_aligned(size):]  # shrink in place (no view of it is alive)
        buckets.append(current)
        sizes.append(_aligned(size))
        current, is_open = None, False

    for name, t in (state.items() if isinstance(state, Mapping) else state):
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        name_dtype = str(out_dtype).removeprefix("torch.")
        if name_dtype not in _DTYPES:
            raise ValueError(f"cannot send tensor {name} of dtype {out_dtype}")
        nbytes = t.numel() * out_dtype.itemsize
        if is_open and size + nbytes > bucket_bytes:
            close()
        if not is_open:
            is_open, size = True, 0
            if keep is None or keep(len(buckets)):
                current = bytearray(_aligned(min(bucket_bytes, max(nbytes, 1 << 20))))
        if current is not None and size + nbytes > len(current):  # grow by doubling (<= 2 copies)
            current.extend(bytes(_aligned(max(size + nbytes, min(2 * len(current),
                                                                  bucket_bytes))) - len(current)))
        metas.append(TensorMeta(name=name, dtype=name_dtype, shape=tuple(t.shape),
                                bucket=len(buckets), offset=size, nbytes=nbytes))
        if nbytes and current is not None:  # the cast happens in this copy, into the bucket
            dst = torch.frombuffer(current, dtype=out_dtype, count=t.numel(), offset=size)
            dst.copy_(t.detach().reshape(-1))
            del dst
        size = _aligned(size + nbytes)
    if is_open:
        close()
    digests = [b"" if b is None else digest(b) for b in buckets]
    key = {"full": f"f{version}", "base": "b", "adapter": f"a{version}"}[kind]
    manifest = WeightManifest(version=version, tensors=metas, num_buckets=len(buckets),
                              total_bytes=sum(sizes), kind=kind, lora=lora, key=key,
                              digests=digests, raw_digests=digests, raw_sizes=sizes)
    return PackedWeights(manifest=manifest, buckets=tuple(buckets))


class Layout:
    """Which bucket each tensor of a version lands in, from its size alone (the rule `pack`
    follows), and which of `world` learner ranks owns that bucket: the rank with the fewest
    bytes so far when the bucket opens (ties: the highest rank; rank 0 also answers every
    peer). Every rank computes the same owners without exchanging anything."""

    def __init__(self, bucket_bytes: int, world: int = 1) -> None:
        self.bucket_bytes = bucket_bytes
        self.owners: list[int] = []
        """Bucket index -> its rank."""
        self.bytes = [0] * world
        self.size = 0

    def place(self, nbytes: int) -> int:
        """The rank owning the bucket of the next tensor (of `nbytes` bytes)."""
        if not self.owners or self.size + nbytes > self.bucket_bytes:
            self.owners.append(min(reversed(range(len(self.bytes))), key=self.bytes.__getitem__))
            self.size = 0
        self.size = _aligned(self.size + nbytes)
        self.bytes[self.owners[-1]] += _aligned(nbytes)
        return self.owners[-1]


def write_file(state: dict[str, torch.Tensor], version: int, directory: Path,
               keep: int) -> PackedWeights:
    """Save version `version` as `directory/v{version}.safetensors` (atomically: readers never
    see a partial file) and delete all but the newest `keep` versions. Returns the manifest
    that tells actors where to read it."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"v{version:08d}.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(tmp))
    os.replace(tmp, path)
    for old in sorted(directory.glob("v*.safetensors"))[:-keep]:
        old.unlink()
    manifest = WeightManifest(version=version, tensors=[], num_buckets=0,
                              total_bytes=path.stat().st_size, path=str(path.resolve()))
    return PackedWeights(manifest=manifest, buckets=())


def unpack(manifest: WeightManifest, buckets: list[bytes],
           readonly: bool = False) -> dict[str, torch.Tensor]:
    """Rebuild the state dict; raises ValueError if the buckets do not match the manifest.
    `readonly`: the tensors are views of the buckets even where those are read-only (bytes),
    no copy at all: nothing may ever write them (an evaluation's borrowed weights)."""
    if len(buckets) != manifest.num_buckets:
        raise ValueError(f"weights v{manifest.version}: expected {manifest.num_buckets} buckets, "
                         f"got {len(buckets)}")
    # tensors are views of their bucket: one copy of a read-only bucket, none per tensor
    views = [v if readonly or not v.readonly else memoryview(bytearray(v))
             for v in map(memoryview, buckets)]
    state: dict[str, torch.Tensor] = {}
    for m in manifest.tensors:
        if m.dtype not in _DTYPES:
            raise ValueError(f"weights v{manifest.version}: tensor {m.name} has dtype {m.dtype!r}")
        if not 0 <= m.bucket < len(buckets):
            raise ValueError(f"weights v{manifest.version}: tensor {m.name} names bucket {m.bucket}")
        if m.offset < 0 or m.offset + m.nbytes > views[m.bucket].nbytes:
            raise ValueError(f"weights v{manifest.version}: tensor {m.name} overruns its bucket")
        dtype = _DTYPES[m.dtype]
        numel = 1
        for d in m.shape:
            numel *= d
        if numel * dtype.itemsize != m.nbytes:
            raise ValueError(f"weights v{manifest.version}: tensor {m.name} shape {m.shape} "
                             f"does not fit {m.nbytes} bytes")
        if m.nbytes == 0:  # frombuffer refuses an empty buffer
            state[m.name] = torch.empty(m.shape, dtype=dtype)
            continue
        raw = views[m.bucket][m.offset:m.offset + m.nbytes]
        if m.offset % dtype.itemsize:  # not packed here (pack aligns): this one is copied
            raw = bytearray(raw)
        with warnings.catch_warnings():  # readonly: torch warns that the buffer is not writable
            warnings.simplefilter("ignore", UserWarning)
            state[m.name] = torch.frombuffer(raw, dtype=dtype).reshape(m.shape)
    return state


def bucket_manifest(manifest: WeightManifest, index: int) -> WeightManifest:
    """The manifest of bucket `index` alone (its tensors, as bucket 0): what an engine loading
    a version bucket by bucket is sent with each one."""
    import msgspec

    tensors = [msgspec.structs.replace(t, bucket=0) for t in manifest.tensors if t.bucket == index]
    return msgspec.structs.replace(
        manifest, tensors=tensors, num_buckets=1, total_bytes=manifest.raw_sizes[index],
        digests=[manifest.raw_digests[index]], raw_digests=[manifest.raw_digests[index]],
        raw_sizes=[manifest.raw_sizes[index]])
