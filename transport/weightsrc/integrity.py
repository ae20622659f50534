"""The digest every weight bucket carries (torch-free: actors import it in their event loop)."""

from __future__ import annotations

import hashlib


def digest(data) -> bytes:
    """BLAKE2b-128 of a bucket (hashlib releases the GIL while it hashes)."""
    return hashlib.blake2b(data, digest_size=16).digest()
