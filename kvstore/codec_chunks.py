"""One chunk's work for :class:`kvstore.codec.Codec`, as plain functions of their arguments:
byte-shuffle + zstd one chunk (:func:`pack_chunk`) and back (:func:`unpack_chunk`), AES-GCM-seal
and open one chunk (:func:`encrypt_chunk`, :func:`decrypt_chunk`), estimate a block's compression ratio from a sample
(:func:`sample_ratio`), and build the zstd compressor they expect (:func:`zstd_compressor`).

Contract: no state of their own -- the caller passes the zstd context (not thread-safe: one per
thread) and any scratch buffer, and owns both. Every failure to restore a chunk (a bad tag, a
corrupt or mis-sized zstd frame) raises :class:`~kvstore.errors.IntegrityError` naming the chunk;
nothing is returned for it. The byte layout they read and write is :mod:`kvstore.codec_format`'s.
"""

from __future__ import annotations

import numpy as np
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kernels.shuffle import shuffle_into, unshuffle_planes_into
from kvstore.codec_config import SAMPLE_BYTES, SAMPLE_SLICES
from kvstore.codec_format import (
    CHUNK_COMPRESSED,
    CHUNK_INDEX,
    COMPRESSION_NONE,
    COMPRESSION_ZSTD_TOP,
)
from kvstore.errors import IntegrityError

#: zstd parameters used for the fast levels (1.._TUNED_MAX_LEVEL); see zstd_compressor.
_TUNED_PARAMS = {"min_match": 7, "hash_log": 10, "window_log": 17}
_TUNED_MAX_LEVEL = 3
#: Bytes of scratch :func:`sample_ratio` needs.
SAMPLE_SCRATCH_BYTES = 2 * SAMPLE_BYTES


def zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    """A new zstd compressor for ``level`` (tuned for byte planes at the fast levels)."""
    if 1 <= level <= _TUNED_MAX_LEVEL:
        # NOTE: byte planes of KV are low-entropy literals with few long matches; with
        # min_match=7 and a small hash table zstd measured 2.5x faster on the bf16 top
        # plane at a slightly better ratio (1.45 vs 1.44) than stock level 1.
        params = zstandard.ZstdCompressionParameters.from_level(level, **_TUNED_PARAMS)
        return zstandard.ZstdCompressor(compression_params=params)
    return zstandard.ZstdCompressor(level=level)


def pack_chunk(chunk: np.ndarray, unit: int, comp: int, buf: np.ndarray,
               cctx: zstandard.ZstdCompressor) -> tuple[int, int]:
    """Shuffle ``chunk`` into ``unit``-byte planes (nothing to shuffle when ``unit`` is 1) and
    zstd-compress the planes ``comp`` names into ``buf`` (at least ``chunk.size`` bytes); returns
    (stored bytes at the start of ``buf``, chunk flags). A chunk that does not shrink is stored
    uncompressed (still shuffled)."""
    size = chunk.size
    view = buf[:size]
    if unit == 1:  # nothing to shuffle: compress straight from the source
        plain = chunk
    else:
        shuffle_into(chunk, unit, view)
        plain = view
    stored, flags = size, 0
    start = size - size // unit if comp == COMPRESSION_ZSTD_TOP else 0
    packed = cctx.compress(plain[start:])
    if len(packed) < size - start:  # else the chunk is stored raw (still shuffled)
        stored, flags = start + len(packed), CHUNK_COMPRESSED
        buf[start:stored] = np.frombuffer(packed, dtype=np.uint8)
    elif unit == 1:
        np.copyto(view, plain)
    return stored, flags


def sample_ratio(src: np.ndarray, unit: int, comp: int, cctx: zstandard.ZstdCompressor,
                 buf: np.ndarray) -> float:
    """Estimated ratio (raw / stored bytes) of ``src`` encoded with ``comp``, from zstd over
    ``SAMPLE_BYTES`` of it (``SAMPLE_SLICES`` evenly spaced, item-aligned slices; all of it
    when shorter): over the sample's top byte plane only when ``comp`` compresses only that
    plane (no full shuffle needed), else over all its planes, shuffled as the chunks are.
    ``buf``: scratch of at least ``SAMPLE_SCRATCH_BYTES``.

    NOTE: 8 KiB estimated the ratio of 2 MiB KV blocks 1% low (fp16 1.172 vs 1.182, bf16
    1.476 vs 1.490; 32 KiB: 0.1% low) in 13-20 us, about 5% of encoding the block raw with
    AES-GCM. Why the default threshold is 1.5: on the 2-core development VM, compressing
    KV-like blocks made the NVMe paths slower than storing them raw, fp16 (1.18x) and bf16
    (1.49x) alike -- bf16 2 MiB put 0.25 vs 0.52 GB/s, get 1.1 vs 5.7 GB/s; 32 MiB put
    0.63 vs 0.58, get 2.0 vs 8.4 -- zstd 1 runs at 0.3-1.2 GB/s of top plane, AES-GCM at
    ~10 GB/s, the disk at 0.3-0.9 GB/s. Real bf16 KV compresses 1.41-1.44x
    (bench/results/shuffle_ratio.json); data that shrinks 1.5x or more (zero padding, sparse
    or constant regions) is still compressed."""
    size = src.size
    if size <= SAMPLE_BYTES:
        pieces = [(0, size)]
    else:
        piece = SAMPLE_BYTES // SAMPLE_SLICES // unit * unit
        step = size // SAMPLE_SLICES // unit * unit
        pieces = [(j * step, j * step + piece) for j in range(SAMPLE_SLICES)]
    m = sum(hi - lo for lo, hi in pieces)
    k = 0
    if comp == COMPRESSION_ZSTD_TOP and unit > 1:  # the top plane = byte unit-1 of each item
        for lo, hi in pieces:
            n = (hi - lo) // unit
            np.copyto(buf[k : k + n], src[lo + unit - 1 : hi : unit])
            k += n
        plain, start = buf[:k], m - k
    else:
        for lo, hi in pieces:
            np.copyto(buf[SAMPLE_BYTES + k : SAMPLE_BYTES + k + hi - lo], src[lo:hi])
            k += hi - lo
        plain, start = buf[SAMPLE_BYTES : SAMPLE_BYTES + m], 0
        if unit > 1:
            shuffle_into(plain, unit, buf[:m])
            plain = buf[:m]
    packed = min(len(cctx.compress(plain)), plain.size)
    return m / max(1, start + packed)


def encrypt_chunk(data_key: bytes, nonce: bytes, plain: np.ndarray, header: bytes, i: int,
                  target: np.ndarray) -> None:
    """Encrypt chunk ``i`` into ``target`` (ciphertext + tag), bound to ``header || u32(i)``."""
    AESGCM(data_key).encrypt_into(nonce, plain, header + CHUNK_INDEX.pack(i), target)


def decrypt_chunk(data_key: bytes, nonce: bytes, body: np.ndarray, header: bytes, i: int,
                  dst: np.ndarray) -> None:
    """Authenticate and decrypt chunk ``i`` (ciphertext + tag ``body``, associated data
    ``header || u32(i)``) into ``dst``."""
    try:
        AESGCM(data_key).decrypt_into(nonce, body, header + CHUNK_INDEX.pack(i), dst)
    except InvalidTag:
        raise IntegrityError(f"chunk {i}: authentication failed") from None
    except ValueError as exc:  # buffer length mismatch: the header lied about sizes
        raise IntegrityError(f"chunk {i}: {exc}") from None


def unpack_chunk(comp: int, cflags: int, plain: np.ndarray, size: int, itemsize: int,
                 dst: np.ndarray, i: int, dctx: zstandard.ZstdDecompressor) -> None:
    """Decompress (if flagged) and unshuffle chunk ``i``'s stored bytes ``plain`` into ``dst``
    (``size`` bytes)."""
    assert comp != COMPRESSION_NONE  # stored chunks are never shuffled
    plane = size // itemsize
    start = size - plane if comp == COMPRESSION_ZSTD_TOP else 0
    if cflags & CHUNK_COMPRESSED:
        packed = plain[start:]
        want = size - start
        try:
            if zstandard.frame_content_size(packed) != want:
                raise IntegrityError(f"chunk {i}: compressed frame announces a wrong size")
            unpacked = dctx.decompress(packed, max_output_size=want)
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"chunk {i}: decompression failed: {exc}") from None
        if len(unpacked) != want:
            raise IntegrityError(f"chunk {i}: decompressed to {len(unpacked)} bytes, expected {want}")
        tail = np.frombuffer(unpacked, dtype=np.uint8)
        stored_part = plain[:start]
    else:
        tail = plain[start:size]
        stored_part = plain[:start]
    full_planes = [stored_part[j * plane : (j + 1) * plane] for j in range(start // plane)]
    tail_planes = [tail[j * plane : (j + 1) * plane] for j in range(tail.size // plane)]
    unshuffle_planes_into(full_planes + tail_planes, dst)
