"""The digests the tool records of tensor bytes, by name: one place that says which and how.

A split records each tensor's **xxh3-128** (:data:`TENSOR_DIGEST`, manifest format
``stage-v2``): the check is against damage (a flipped bit on disk, a truncated copy, a file
edited by mistake), not against someone forging bytes, so it needs a digest as fast as the
copy the server makes, not a cryptographic one. Measured on this project's 2-core machine
(benchmarks/bench_digests.py, a 512 MB buffer): sha256 1.4 GB/s, BLAKE3 4.1 GB/s (one
thread), crc32c 16 GB/s, xxh3-128 32 GB/s; a server copies at 10+ GB/s. 128 bits: a random
mismatch passes with probability 2^-128 (crc32c's 32 bits would let one in 4 billion pass).
rsync checks its transfers with the same function (xxh128).

**sha256** stays where a published digest is compared: the Hub's LFS sha256 of a whole
shard (a Hugging Face cache names its blobs by it), the non-weight files, and the tensors of
a stage written before ``stage-v2`` (``stage-v1`` manifests keep loading and verifying
through their sha256).
"""

from __future__ import annotations

import hashlib
import re
from typing import Protocol

import xxhash

SHA256 = "sha256"
XXH128 = "xxh128"
TENSOR_DIGEST = XXH128  # what a split records per tensor now (stage-v2)

# Lowercase hex of each digest's size, as ``hexdigest`` writes it.
_HEX = {SHA256: re.compile(r"[0-9a-f]{64}"), XXH128: re.compile(r"[0-9a-f]{32}")}
HEX_LENGTH = {SHA256: 64, XXH128: 32}


class Hasher(Protocol):
    """What ``hashlib.sha256()`` and ``xxhash.xxh3_128()`` both are (both release the GIL
    while they hash a large buffer, so hashing threads run on as many cores)."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher of ``algorithm`` (:data:`SHA256` or :data:`XXH128`).

    Example:
        >>> h = new_hasher(XXH128)
        >>> h.update(b"abc")
        >>> h.hexdigest()
        '06b05ab6733a618578af5f94892f3950'
    """
    if algorithm == XXH128:
        return xxhash.xxh3_128()
    if algorithm == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown digest {algorithm!r}")


def hexdigest(algorithm: str, data: bytes | memoryview) -> str:
    """The hex digest of ``data`` by ``algorithm``, in one call (no hasher object: the loader
    makes one per tensor, ~50,000 a stage of small tensors).

    Example:
        >>> hexdigest(SHA256, b"")[:12], hexdigest(XXH128, b"")
        ('e3b0c44298fc', '99aa06d3014798d86001c324468d497f')
    """
    if algorithm == XXH128:
        return xxhash.xxh3_128_hexdigest(data)
    return hashlib.sha256(data).hexdigest()


def is_hex_digest(algorithm: str, value: object) -> bool:
    """Whether ``value`` is a hex digest of ``algorithm`` as the tool writes it."""
    return isinstance(value, str) and _HEX[algorithm].fullmatch(value) is not None
