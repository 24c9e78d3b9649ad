"""What a :class:`kvstore.codec.Codec` is configured with: :class:`CodecConfig` and the fixed
sizes its encoding uses.

Contract: :class:`CodecConfig` is frozen and validated on construction (a bad field raises
:class:`~kvstore.errors.InvalidArgument`). It only says how values are *encoded*; decoding reads
every layout choice from the value's header, so a value encoded under one config decodes under
any other with the same ``encrypt``. :func:`chunk_size` is the chunking a config implies for a
value. Pure data: no I/O, no threads, no bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvstore.codec_format import effective_chunk
from kvstore.errors import InvalidArgument

#: Bytes of a block compressed to estimate the whole block's ratio (CodecConfig.min_compress_ratio),
#: taken as ``SAMPLE_SLICES`` evenly spaced slices so a block whose layers differ is seen whole.
SAMPLE_BYTES = 8 << 10
SAMPLE_SLICES = 4
#: Default CodecConfig.min_compress_ratio (see the NOTE on kvstore.codec_chunks.sample_ratio).
DEFAULT_MIN_COMPRESS_RATIO = 1.5
#: A value stored uncompressed of at most this many bytes is one chunk (up to chunk_bytes) and
#: is encoded and decoded on the calling thread. NOTE: AES-GCM and xxh3 run at 5-10 GB/s, so a
#: 2 MiB block is 200-400 us of work; handing half of it to a pool thread saved little on an idle
#: core and cost up to 40% when the other core was busy (2 MiB decode 7.0 GB/s inline vs
#: 3.9-4.5 GB/s split, on the 2-core development VM under load).
INLINE_RAW_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class CodecConfig:
    """How values are encoded. Decoding reads the layout from each value's header."""

    compression_level: int = 1
    """zstd level (negative = faster levels, up to 22); 0 turns compression off."""
    encrypt: bool = True
    """AES-256-GCM with the tenant's data key; False stores an xxh3-128 checksum instead."""
    chunk_bytes: int = 4 << 20
    """Chunk size (bytes, multiple of 64): the unit of parallelism, nonce and compression."""
    threads: int = 2
    """Chunks processed concurrently per call, the calling thread included (1 = inline). A value
    stored uncompressed of at most ``INLINE_RAW_BYTES`` is always done inline (one chunk)."""
    compress_planes: Literal["top", "all"] = "top"
    """Compress only the top byte plane (sign+exponent; faster, most of the ratio) or all."""
    min_compress_ratio: float = DEFAULT_MIN_COMPRESS_RATIO
    """Early abort: before compressing a block, zstd compresses a sample of it (a few evenly
    spaced slices, ``SAMPLE_BYTES`` in all) and the block is stored as with compression off
    (unshuffled, header compression byte = none) when the ratio estimated for the whole value
    (raw bytes / stored bytes) falls below this. 1.0 = no sample: always compress (a chunk that
    does not shrink is still stored uncompressed). Decoding reads the choice from the header."""

    def __post_init__(self) -> None:
        lvl = self.compression_level
        if not isinstance(lvl, int) or isinstance(lvl, bool) or not -(1 << 17) <= lvl <= 22:
            raise InvalidArgument(f"compression_level must be an int <= 22, got {lvl!r}")
        cb = self.chunk_bytes
        if not isinstance(cb, int) or isinstance(cb, bool) or not 4096 <= cb <= 1 << 30 or cb % 64:
            raise InvalidArgument(f"chunk_bytes must be a multiple of 64 in [4096, 2**30], got {cb!r}")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or not 1 <= self.threads <= 64:
            raise InvalidArgument(f"threads must be an int in [1, 64], got {self.threads!r}")
        if self.compress_planes not in ("top", "all"):
            raise InvalidArgument(f"compress_planes must be 'top' or 'all', got {self.compress_planes!r}")
        if not isinstance(self.encrypt, bool):
            raise InvalidArgument("encrypt must be a bool")
        r = self.min_compress_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 1.0 <= r <= 64.0:
            raise InvalidArgument(f"min_compress_ratio must be a number in [1, 64], got {r!r}")


def chunk_size(config: CodecConfig, nbytes: int, itemsize: int, raw: bool = False) -> int:
    """Chunk size for a value of ``nbytes``: at most ``chunk_bytes``, and small enough that
    every codec thread gets a chunk (not below 256 KiB), except for a value stored ``raw``
    of at most ``INLINE_RAW_BYTES`` (one thread does it all). Stored in the header, so
    decode never depends on this choice."""
    cb = config.chunk_bytes
    if config.threads > 1 and not (raw and nbytes <= INLINE_RAW_BYTES):
        per = -(-nbytes // config.threads)
        cb = min(cb, max(256 << 10, -(-per // 64) * 64))
    return effective_chunk(cb, itemsize)
