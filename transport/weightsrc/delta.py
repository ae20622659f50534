"""Lossless deltas between successive weight versions: XOR of the bit patterns, then zstd.

Version v+1 is packed with exactly the layout of v (same tensors, order, dtypes, buckets), so
bucket i of v+1 XOR bucket i of v is zero wherever an element did not change; zstd squeezes
those zeros. Decoding XORs the decompressed bytes into the held bucket of v in place, which
then is v+1, bit for bit (its SHA-256 is checked against the learner's `raw_digests`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np
import zstandard

from transport.messages import WeightManifest
from transport.weightsrc.integrity import digest

if TYPE_CHECKING:  # transport.weights imports torch: actors decode deltas without it
    from transport.weights import PackedWeights

LEVEL = 1
"""zstd level: 1 is several hundred MB/s per core and already removes the zero runs."""


def same_layout(a: WeightManifest, b: WeightManifest) -> bool:
    """Can `b` be sent as a delta against `a` (same tensors, bucket for bucket)?"""
    return a.raw_sizes == b.raw_sizes and a.tensors == b.tensors


def _words(buf) -> np.ndarray:
    """A bucket as uint64 words (pack makes every bucket a multiple of 16 bytes)."""
    return np.frombuffer(buf, dtype=np.uint64)


def encode(new, old) -> bytes:
    """zstd(new XOR old) for two buckets of equal size."""
    x = np.bitwise_xor(_words(new), _words(old))
    return zstandard.ZstdCompressor(level=LEVEL).compress(x)


def apply(held: bytearray, delta) -> None:
    """Turn `held` (a bucket of the base version) into the new version's bucket, in place."""
    x = zstandard.ZstdDecompressor().decompress(delta, max_output_size=len(held))
    if len(x) != len(held):
        raise ValueError(f"delta decodes to {len(x)} bytes, the bucket has {len(held)}")
    h = _words(held)
    np.bitwise_xor(h, _words(x), out=h)


def make(new: PackedWeights, old: PackedWeights) -> PackedWeights | None:
    """Version `new` as a delta against `old` (its version - 1), or None if the layouts differ.
    A bucket another learner rank holds (None) stays None here: that rank encodes it."""
    nm, om = new.manifest, old.manifest
    if nm.kind != "full" or om.kind != "full" or not same_layout(om, nm):
        return None
    buckets = tuple(None if n is None else encode(n, o) for n, o in zip(new.buckets, old.buckets))
    manifest = msgspec.structs.replace(
        nm, key=f"d{nm.version}", codec="xor-zstd", base_version=om.version,
        digests=[b"" if b is None else digest(b) for b in buckets],
        total_bytes=sum(len(b) for b in buckets if b is not None))
    return type(new)(manifest=manifest, buckets=buckets)


def changed_fraction(new: PackedWeights, old: PackedWeights, itemsize: int = 2) -> float:
    """Fraction of `itemsize`-byte elements whose bits differ between two versions (bf16: 2)."""
    dt = {2: np.uint16, 4: np.uint32}[itemsize]
    changed = total = 0
    for n, o in zip(new.buckets, old.buckets):
        a, b = np.frombuffer(n, dtype=dt), np.frombuffer(o, dtype=dt)
        changed += int(np.count_nonzero(a != b))
        total += a.size
    return changed / max(total, 1)
