"""Versioned weights as buckets of raw bytes.

The learner packs a state dict once per version (`pack`); the same immutable byte buckets are
sent to every actor that asks, zero-copy. Actors rebuild tensors with `unpack` without copying
through Python objects. Only raw bytes + dtype + shape cross the wire, never pickle.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from transport.messages import LoraSpec, TensorMeta, WeightManifest

_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}


@dataclass(frozen=True)
class PackedWeights:
    """One published weight version: the manifest plus its buckets (immutable bytes)."""

    manifest: WeightManifest
    buckets: tuple[bytes, ...]


def pack(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
         bucket_bytes: int, kind: str = "full", lora: LoraSpec | None = None) -> PackedWeights:
    """Serialize `state` into buckets of at most ~bucket_bytes (a larger tensor gets its own).
    `state` may be a generator of (name, tensor): each tensor is needed only until it is packed,
    so a sharded learner can gather one full tensor at a time. `kind`, `lora`: what the
    manifest says it carries (transport/messages.py WEIGHT_KINDS)."""
    metas: list[TensorMeta] = []
    buckets: list[bytes] = []
    current: list[bytes] = []
    size = 0
    for name, t in (state.items() if isinstance(state, Mapping) else state):
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"cannot send tensor {name} of dtype {t.dtype}")
        raw = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        if current and size + len(raw) > bucket_bytes:
            buckets.append(b"".join(current))
            current, size = [], 0
        metas.append(TensorMeta(name=name, dtype=dtype, shape=tuple(t.shape),
                                bucket=len(buckets), offset=size, nbytes=len(raw)))
        current.append(raw)
        size += len(raw)
    if current:
        buckets.append(b"".join(current))
    manifest = WeightManifest(version=version, tensors=metas, num_buckets=len(buckets),
                              total_bytes=sum(len(b) for b in buckets), kind=kind, lora=lora)
    return PackedWeights(manifest=manifest, buckets=tuple(buckets))


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
        if m.offset % dtype.itemsize:  # pack does not align: such a tensor gets its own copy
            raw = bytearray(raw)
        with warnings.catch_warnings():  # readonly: torch warns that the buffer is not writable
            warnings.simplefilter("ignore", UserWarning)
            state[m.name] = torch.frombuffer(raw, dtype=dtype).reshape(m.shape)
    return state
