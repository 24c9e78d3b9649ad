"""Fast non-cryptographic checksums for tiers whose values are not encrypted.

xxh3 (64- or 128-bit) from the ``xxhash`` package: about 10 GB/s per core and it releases the
GIL, so chunks can be hashed in parallel. Any object supporting the buffer protocol (bytes,
bytearray, memoryview, a contiguous numpy array) is hashed in place, without a copy.

These detect accidental corruption (bit rot, torn or truncated writes); they do not authenticate.
Encrypted tiers rely on AES-GCM tags instead.
"""

from __future__ import annotations

from typing import Literal

import xxhash

from kernels.errors import InvalidArgument

Algorithm = Literal["xxh3_64", "xxh3_128"]

#: digest size in bytes of each algorithm.
DIGEST_BYTES: dict[str, int] = {"xxh3_64": 8, "xxh3_128": 16}


def checksum(buf: object, algorithm: Algorithm = "xxh3_128", seed: int = 0) -> bytes:
    """Digest of ``buf`` (any buffer-protocol object; not copied).

    ``seed`` (0 <= seed < 2**64) lets a caller bind context such as a chunk index into the digest.
    """
    if not 0 <= seed < 1 << 64:
        raise InvalidArgument(f"seed must fit in 64 bits, got {seed}")
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"cannot checksum a {type(buf).__name__}: not a buffer") from None
    if not view.contiguous:
        raise InvalidArgument("checksum needs a contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128_digest(view, seed=seed)
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64_digest(view, seed=seed)
    raise InvalidArgument(f"unknown checksum algorithm {algorithm!r}; use one of {sorted(DIGEST_BYTES)}")


__all__ = ["DIGEST_BYTES", "Algorithm", "checksum"]
