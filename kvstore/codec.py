"""Value codec of the NVMe and remote tiers: versioned header + byte-shuffle -> zstd -> AES-GCM.

A block of ``spec.block_nbytes`` bytes is cut into chunks of ``chunk_bytes`` (rounded down to a
multiple of the dtype's itemsize). With compression on, each chunk is byte-shuffled into planes
and zstd-compressed (only the top byte plane -- sign and exponent -- by default, or all planes);
with compression off it is stored as is (shuffling only helps compression). Each chunk is
then either encrypted with AES-256-GCM under the tenant's data key (random 96-bit nonce per chunk)
or, when encryption is off, covered by an xxh3-128 checksum. Chunks are processed in parallel on a
small thread pool (zstd, AES-GCM, xxhash and large numpy ops release the GIL); a chunk that does
not shrink is stored uncompressed. Compression has to pay for itself: a block whose sample
compresses worse than ``CodecConfig.min_compress_ratio`` is stored as with compression off, and
its header says so (compression byte = none), so decoding needs no configuration.

The value layout and :func:`parse_header` live in :mod:`kvstore.codec_format`.

Quantization (opt-in, per call): ``encode(..., quant=QuantScheme.INT8)`` (or a
:class:`~kvstore.quantization.Quantization`, which also picks the key-scale granularity) stores
the block's :mod:`kvstore.quantization` *payload* -- float32 scales then 1 byte per element --
instead of its bytes: the header's quantization byte names the format, the raw length is the
payload's, and the payload (scales included, so they are both authenticated and confidential) is
chunked, compressed (1-byte data: no shuffle, zstd over the whole chunk) and encrypted or
checksummed like any block. :meth:`Codec.decode` reads the format from the header and
dequantizes into the spec's dtype: the result is within the bounds of :mod:`kernels.quant`, not
bit-exact. A block holding inf/NaN, or one so short that the scales outweigh the saving, is
stored lossless (check ``parse_header(value).quant``). Without ``quant`` values stay bit-exact.

Encrypted chunk ``i`` is authenticated with associated data ``header || u32(i)``: the whole header
(key, tenant, fingerprint, shape, lengths, every nonce) is bound into every tag, so a value
cannot be replayed under another key, tenant or fingerprint, nor its chunks reordered or dropped.

Contracts:
    * :meth:`Codec.decode` checks the header against the expected (tenant, key, spec) first, then
      authenticates. Every failure -- truncation, bad magic or version, a mismatched field, a bad
      tag or checksum, a decompression error, a wrong length -- raises
      :class:`~kvstore.errors.IntegrityError`; a destroyed tenant key raises
      :class:`~kvstore.errors.KeyUnavailable` (a subclass). Wrong bytes are never returned. When
      it raises, the contents of a caller-supplied ``out`` are unspecified.
    * A master key that cannot unwrap the tenant key raises
      :class:`~kvstore.errors.FailedPrecondition` (from the keyring), not IntegrityError: that is
      a configuration fault, and the stored bytes are fine.
    * The values a codec with ``encrypt=True`` accepts are encrypted ones only, and vice versa.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Self

import numpy as np
import torch
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kernels.checksum import checksum
from kernels.copy import host_copy
from kernels.shuffle import shuffle_into, unshuffle_planes_into
from kvstore.codec_format import (
    CHUNK_COMPRESSED,
    CHUNK_INDEX,
    COMPRESSION_NONE,
    COMPRESSION_ZSTD_ALL,
    COMPRESSION_ZSTD_TOP,
    DIGEST_BYTES,
    ENTRY_ENC,
    ENTRY_SUM,
    FIXED,
    FLAG_CHECKSUM,
    FLAG_ENCRYPTED,
    FORMAT_VERSION,
    MAGIC,
    NONCE_BYTES,
    TAG_BYTES,
    HeaderInfo,
    chunk_ranges,
    effective_chunk,
    parse_header,
    spec_fingerprint,
    tenant_hash,
)
from kvstore.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    ShapeMismatch,
)
from kvstore.keyring import Keyring
from kvstore.keys import KEY_BYTES
from kvstore.quantization import (
    QUANT_NONE,
    QuantArg,
    Quantization,
    QuantScheme,
    as_quantization,
    pack_payload,
    quantizable,
    unpack_payload_into,
    worth_it,
)
from kvstore.spec import DTYPES, ModelSpec

RandomBytes = Callable[[int], bytes]

#: zstd parameters used for the fast levels (1.._TUNED_MAX_LEVEL); see Codec._zstd_c.
_TUNED_PARAMS = {"min_match": 7, "hash_log": 10, "window_log": 17}
_TUNED_MAX_LEVEL = 3

#: Bytes of a block compressed to estimate the whole block's ratio (CodecConfig.min_compress_ratio),
#: taken as ``SAMPLE_SLICES`` evenly spaced slices so a block whose layers differ is seen whole.
SAMPLE_BYTES = 8 << 10
SAMPLE_SLICES = 4
#: Default CodecConfig.min_compress_ratio (see the NOTE where the sample is taken).
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



class _ScratchPool:
    """Reusable chunk-sized uint8 buffers (one owner: this lock). Keeps at most ``keep``."""

    def __init__(self, nbytes: int, keep: int) -> None:
        self.nbytes = nbytes
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int = 0) -> np.ndarray:
        """A buffer of at least ``max(nbytes, self.nbytes)`` bytes (one larger than the pool's
        size is allocated for this call and not kept)."""
        if nbytes > self.nbytes:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(self.nbytes, dtype=np.uint8)

    def release(self, buf: np.ndarray) -> None:
        if buf.shape[0] != self.nbytes:
            return
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


def _as_bytes_array(data: Any, what: str) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise InvalidArgument(f"{what} must be C-contiguous")
        return data.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(data)
    except TypeError:
        raise InvalidArgument(
            f"{what} must be a numpy array or a buffer, got {type(data).__name__} "
            "(torch: pass tensor.view(torch.uint8).numpy())"
        ) from None
    if not mv.contiguous:
        raise InvalidArgument(f"{what} must be contiguous")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)


def _host(data: Any) -> Any:
    """A torch tensor's bytes as a host numpy array (a view on CPU, a copy from a device)."""
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if not t.is_contiguous():
            raise InvalidArgument("data must be contiguous")
        t = t.reshape(-1)
        t = t if t.dtype == torch.uint8 else t.view(torch.uint8)
        return (t if t.device.type == "cpu" else t.cpu()).numpy()
    return data


class Codec:
    """Encodes/decodes block values (see the module docstring). Thread-safe; call :meth:`close`."""

    def __init__(
        self,
        config: CodecConfig,
        keyring: Keyring | None,
        *,
        random_bytes: RandomBytes = os.urandom,
    ) -> None:
        if config.encrypt and keyring is None:
            raise InvalidArgument("CodecConfig.encrypt requires a Keyring")
        self.config = config
        self._keyring = keyring
        self._random = random_bytes
        self._local = threading.local()  # per-thread zstd contexts (not thread-safe objects)
        self._scratch = _ScratchPool(config.chunk_bytes + TAG_BYTES, keep=4 * config.threads + 8)
        self._pool = (
            ThreadPoolExecutor(config.threads - 1, thread_name_prefix="kvstore-codec")
            if config.threads > 1 else None
        )
        self._closed = False

    # -- plumbing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker threads. Further calls raise FailedPrecondition."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parallel(self, fn: Callable[[int], Any], n: int, inline: bool = False) -> list[Any]:
        """Run ``fn(0..n-1)`` on the pool and the calling thread (only the calling thread when
        ``inline``); re-raise the first error."""
        if self._closed:
            raise FailedPrecondition("codec is closed")
        if inline or n == 1 or self._pool is None:
            return [fn(i) for i in range(n)]
        results: list[Any] = [None] * n
        errors: list[BaseException] = []
        counter = itertools.count()  # NOTE: next() on itertools.count is atomic under the GIL

        def drain() -> None:
            for i in iter(counter.__next__, None):
                if i >= n:
                    return
                try:
                    results[i] = fn(i)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                    errors.append(exc)

        helpers = [self._pool.submit(drain) for _ in range(min(self.config.threads - 1, n - 1))]
        drain()
        for h in helpers:
            h.result()
        if errors:
            raise errors[0]
        return results

    def _zstd_c(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "cctx", None)
        if c is None:
            level = self.config.compression_level
            if 1 <= level <= _TUNED_MAX_LEVEL:
                # NOTE: byte planes of KV are low-entropy literals with few long matches; with
                # min_match=7 and a small hash table zstd measured 2.5x faster on the bf16 top
                # plane at a slightly better ratio (1.45 vs 1.44) than stock level 1.
                params = zstandard.ZstdCompressionParameters.from_level(level, **_TUNED_PARAMS)
                c = zstandard.ZstdCompressor(compression_params=params)
            else:
                c = zstandard.ZstdCompressor(level=level)
            self._local.cctx = c
        return c

    def _zstd_d(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "dctx", None)
        if d is None:
            d = self._local.dctx = zstandard.ZstdDecompressor()
        return d

    def _data_key(self, tenant: str, create: bool) -> bytes:
        """The tenant's data key. NOTE: each chunk builds its own AESGCM (under 1 us): one
        object shared by two threads measured 35% slower than one object per thread."""
        assert self._keyring is not None
        return self._keyring.data_key(tenant, create=create)

    def max_encoded_nbytes(self, spec: ModelSpec) -> int:
        """Upper bound of ``len(encode(...))`` for ``spec`` under this config, whatever ``quant``
        (a quantized payload is stored only when it is smaller than the block)."""
        n = self._n_chunks(spec.block_nbytes, spec.itemsize)
        for gran in ("channel", "head"):
            q = Quantization("int8", gran)  # type: ignore[arg-type]  # fp8: same payload size
            if worth_it(spec, q):
                n = max(n, self._n_chunks(q.payload_nbytes(spec), 1))
        entry = ENTRY_ENC.size + TAG_BYTES if self.config.encrypt else ENTRY_SUM.size
        return (FIXED.size + len(DTYPES[spec.dtype][0]) + 4 * len(spec.block_shape) + DIGEST_BYTES
                + n * entry + spec.block_nbytes)

    def _n_chunks(self, nbytes: int, unit: int) -> int:
        return len(chunk_ranges(nbytes, self._chunk_for(nbytes, unit)))

    def _chunk_for(self, nbytes: int, itemsize: int, raw: bool = False) -> int:
        """Chunk size for a value of ``nbytes``: at most ``chunk_bytes``, and small enough that
        every codec thread gets a chunk (not below 256 KiB), except for a value stored ``raw``
        of at most ``INLINE_RAW_BYTES`` (one thread does it all). Stored in the header, so
        decode never depends on this choice."""
        cb = self.config.chunk_bytes
        if self.config.threads > 1 and not (raw and nbytes <= INLINE_RAW_BYTES):
            per = -(-nbytes // self.config.threads)
            cb = min(cb, max(256 << 10, -(-per // 64) * 64))
        return effective_chunk(cb, itemsize)

    # -- encode -----------------------------------------------------------------------------
    def encode(self, tenant: str, key: bytes, spec: ModelSpec, data: Any, *,
               quant: QuantArg = None) -> memoryview:
        """Encode one block (``spec.block_nbytes`` bytes of ``data``) into a new buffer.

        ``data``: a contiguous numpy array, buffer or torch tensor (any device: with ``quant``
        the block is quantized where it lives, so only the payload crosses to the host).
        ``quant``: store the block quantized (see the module docstring); None = lossless.
        Returns a read-write, 1-D, unsigned-byte memoryview that owns its memory (LMDB and
        redis-py accept it as is; ``bytes(value)`` copies it).

        Raises InvalidArgument for a ``quant`` on a spec whose dtype is not fp16/bf16/fp32."""
        return self._encode(tenant, key, spec, data, None, quant)[0]

    def encode_into(self, tenant: str, key: bytes, spec: ModelSpec, data: Any, out: Any, *,
                    quant: QuantArg = None) -> int:
        """Encode into the writable buffer ``out`` (>= :meth:`max_encoded_nbytes`); returns the
        length written. Reusing ``out`` avoids the page faults of a fresh buffer per call."""
        return self._encode(tenant, key, spec, data, out, quant)[1]

    def _encode(self, tenant: str, key: bytes, spec: ModelSpec, data: Any, out: Any,
                quant: QuantArg) -> tuple[Any, int]:
        cfg = self.config
        if not isinstance(tenant, str) or not tenant:
            raise InvalidArgument("tenant must be a non-empty string")
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise InvalidArgument(f"block key must be {KEY_BYTES} bytes")
        if not isinstance(spec, ModelSpec):
            raise InvalidArgument("spec must be a ModelSpec")
        q = as_quantization(quant)
        if q is not None and not quantizable(spec):
            raise InvalidArgument(f"blocks of dtype {spec.dtype!r} cannot be quantized "
                                  "(only float16, bfloat16 and float32)")
        payload = pack_payload(data, spec, q) if q is not None else None
        nbytes, itemsize = spec.block_nbytes, spec.itemsize
        if payload is None:  # lossless: the block's own bytes, shuffled by itemsize
            q, src, unit = None, _as_bytes_array(_host(data), "data"), itemsize
            if src.size != nbytes:
                raise ShapeMismatch(f"data has {src.size} bytes but the spec's block holds {nbytes}")
        else:  # the quantized payload: 1-byte units, nothing to shuffle
            src, unit = payload, 1
        if cfg.compression_level == 0:
            comp = COMPRESSION_NONE
        else:
            comp = COMPRESSION_ZSTD_TOP if cfg.compress_planes == "top" else COMPRESSION_ZSTD_ALL
            if (cfg.min_compress_ratio > 1.0
                    and self._sample_ratio(src, unit, comp) < cfg.min_compress_ratio):
                comp = COMPRESSION_NONE  # early abort: not worth its CPU (see _sample_ratio)
        chunk = self._chunk_for(src.size, unit, raw=comp == COMPRESSION_NONE)
        ranges = chunk_ranges(src.size, chunk)
        n = len(ranges)
        data_key = self._data_key(tenant, create=True) if cfg.encrypt else None
        nonces = self._random(NONCE_BYTES * n) if data_key else b""
        if data_key is not None and len(nonces) != NONCE_BYTES * n:
            raise FailedPrecondition("random source returned too few bytes")
        dtype = DTYPES[spec.dtype][0].encode()
        shape = spec.block_shape
        prefix = FIXED.pack(MAGIC, FORMAT_VERSION, FLAG_ENCRYPTED if data_key else FLAG_CHECKSUM, comp,
                             q.format_id if q else QUANT_NONE, itemsize, len(dtype), len(shape),
                             chunk, n, src.size,
                             spec_fingerprint(spec), bytes(key), tenant_hash(tenant))
        prefix += dtype + struct.pack(f"<{len(shape)}I", *shape)
        tag = TAG_BYTES if data_key else 0
        if comp == COMPRESSION_NONE:
            return self._encode_stored(prefix, src, ranges, data_key, nonces, out)

        # Phase 1: shuffle (+ compress) each chunk into a scratch buffer -> (buf, stored, flags, sum)
        def stage(i: int) -> tuple[np.ndarray, int, int, bytes]:
            lo, hi = ranges[i]
            size = hi - lo
            buf = self._scratch.acquire()
            try:
                view = buf[:size]
                if unit == 1:  # nothing to shuffle: compress straight from the source
                    plain = src[lo:hi]
                else:
                    shuffle_into(src[lo:hi], unit, view)
                    plain = view
                stored, flags = size, 0
                start = size - size // unit if comp == COMPRESSION_ZSTD_TOP else 0
                packed = self._zstd_c().compress(plain[start:])
                if len(packed) < size - start:  # else the chunk is stored raw (still shuffled)
                    stored, flags = start + len(packed), CHUNK_COMPRESSED
                    buf[start:stored] = np.frombuffer(packed, dtype=np.uint8)
                elif unit == 1:
                    np.copyto(view, plain)
                digest = b"" if data_key else checksum(buf[:stored], seed=i)
            except BaseException:
                self._scratch.release(buf)
                raise
            return buf, stored, flags, digest

        staged = self._parallel(stage, n)
        try:
            table = []
            for i, (_, stored, flags, digest) in enumerate(staged):
                if data_key:
                    table.append(ENTRY_ENC.pack(stored, flags, nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES]))
                else:
                    table.append(ENTRY_SUM.pack(stored, flags, digest))
            header = prefix + b"".join(table)
            if not data_key:
                header += checksum(header)
            offsets = [len(header)]
            for _, stored, _, _ in staged:
                offsets.append(offsets[-1] + stored + tag)
            total = offsets[-1]
            result, dst = self._output(out, total)
            dst[: len(header)] = np.frombuffer(header, dtype=np.uint8)

            # Phase 2: encrypt (or copy) each staged chunk to its place in the value.
            def place(i: int) -> None:
                buf, stored, _, _ = staged[i]
                target = dst[offsets[i] : offsets[i + 1]]
                if data_key is not None:
                    nonce = nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES]
                    AESGCM(data_key).encrypt_into(nonce, buf[:stored], header + CHUNK_INDEX.pack(i), target)
                else:
                    target[:] = buf[:stored]

            self._parallel(place, n)
        finally:
            for buf, _, _, _ in staged:
                self._scratch.release(buf)
        return result, total

    def _sample_ratio(self, src: np.ndarray, unit: int, comp: int) -> float:
        """Estimated ratio (raw / stored bytes) of ``src`` encoded with ``comp``, from zstd over
        ``SAMPLE_BYTES`` of it (``SAMPLE_SLICES`` evenly spaced, item-aligned slices; all of it
        when shorter): over the sample's top byte plane only when ``comp`` compresses only that
        plane (no full shuffle needed), else over all its planes, shuffled as the chunks are.

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
        buf = getattr(self._local, "sample", None)
        if buf is None:
            buf = self._local.sample = np.empty(2 * SAMPLE_BYTES, dtype=np.uint8)
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
        packed = min(len(self._zstd_c().compress(plain)), plain.size)
        return m / max(1, start + packed)

    def _encode_stored(self, prefix: bytes, src: np.ndarray, ranges: list[tuple[int, int]],
                       data_key: bytes | None, nonces: bytes, out: Any) -> tuple[Any, int]:
        """Compression off: no shuffle (it only helps compression); one pass per chunk."""
        n = len(ranges)
        entry = ENTRY_ENC if data_key else ENTRY_SUM
        hlen = len(prefix) + n * entry.size + (0 if data_key else DIGEST_BYTES)
        tag = TAG_BYTES if data_key else 0
        offsets = [hlen]
        for lo, hi in ranges:
            offsets.append(offsets[-1] + hi - lo + tag)
        total = offsets[-1]
        result, dst = self._output(out, total)
        header = b""
        if data_key is not None:
            header = prefix + b"".join(
                ENTRY_ENC.pack(hi - lo, 0, nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES])
                for i, (lo, hi) in enumerate(ranges))

        def place(i: int) -> bytes:
            lo, hi = ranges[i]
            target = dst[offsets[i] : offsets[i + 1]]
            if data_key is not None:
                nonce = nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES]
                AESGCM(data_key).encrypt_into(nonce, src[lo:hi], header + CHUNK_INDEX.pack(i), target)
                return b""
            host_copy(target, src[lo:hi])
            return checksum(target, seed=i)

        digests = self._parallel(place, n, inline=ranges[-1][1] <= INLINE_RAW_BYTES)
        if data_key is None:
            header = prefix + b"".join(
                ENTRY_SUM.pack(hi - lo, 0, digests[i]) for i, (lo, hi) in enumerate(ranges))
            header += checksum(header)
        assert len(header) == hlen
        dst[:hlen] = np.frombuffer(header, dtype=np.uint8)
        return result, total

    @staticmethod
    def _output(out: Any, total: int) -> tuple[Any, np.ndarray]:
        """(object to return, uint8 view to write): a new bytearray, or the caller's buffer."""
        if out is None:
            # NOTE: np.empty, not bytearray(total): bytearray zero-fills, and for 32 MiB that
            # measured 7x slower than numpy's allocation (which also asks for huge pages).
            arr = np.empty(total, dtype=np.uint8)
            return memoryview(arr), arr
        dst = _as_bytes_array(out, "out")
        if not dst.flags.writeable:
            raise InvalidArgument("out must be writable")
        if dst.size < total:
            raise InvalidArgument(f"out holds {dst.size} bytes; this value needs {total}")
        return out, dst

    # -- decode -----------------------------------------------------------------------------
    def decode(self, tenant: str, key: bytes, spec: ModelSpec, value: Any,
               out: np.ndarray | None = None) -> np.ndarray:
        """Decode ``value`` for (tenant, key, spec) into ``out`` (or a new array); see module doc.

        A quantized value is dequantized into the spec's dtype (the format is read from the
        header; nothing to pass)."""
        cfg = self.config
        if not isinstance(tenant, str) or not tenant:
            raise InvalidArgument("tenant must be a non-empty string")
        if not isinstance(spec, ModelSpec):
            raise InvalidArgument("spec must be a ModelSpec")
        nbytes, itemsize = spec.block_nbytes, spec.itemsize
        if out is None:
            out = np.empty(nbytes, dtype=np.uint8)
        elif (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 1
              or out.size != nbytes or not out.flags.c_contiguous or not out.flags.writeable):
            raise ShapeMismatch(f"out must be a writable contiguous 1-D uint8 array of {nbytes} bytes")
        info = parse_header(value)
        self._check_expected(info, tenant, key, spec)
        if info.encrypted != cfg.encrypt:
            raise IntegrityError("value is " + ("encrypted" if info.encrypted else "unencrypted")
                                 + " but this codec " + ("encrypts" if cfg.encrypt else "does not encrypt"))
        data_key = self._data_key(tenant, create=False) if info.encrypted else None
        q = info.quant
        # A quantized payload is restored into a scratch array, then dequantized into out.
        dst, unit = (out, itemsize) if q is None else (np.empty(info.raw_nbytes, np.uint8), 1)
        mv = memoryview(value).cast("B")
        src = np.frombuffer(mv, dtype=np.uint8)
        header = bytes(mv[: info.header_nbytes])
        ranges = chunk_ranges(info.raw_nbytes, info.chunk_bytes)
        tag = TAG_BYTES if data_key else 0
        offsets = [info.header_nbytes]
        for stored, _, _ in info.chunks:
            offsets.append(offsets[-1] + stored + tag)

        def restore(i: int) -> None:
            lo, hi = ranges[i]
            size = hi - lo
            stored, cflags, extra = info.chunks[i]
            body = src[offsets[i] : offsets[i + 1]]
            buf = None
            if info.compression == COMPRESSION_NONE:  # stored unshuffled: one pass into out
                if data_key is not None:
                    self._decrypt(data_key, extra, body, header, i, dst[lo:hi])
                elif checksum(body, seed=i) != extra:
                    raise IntegrityError(f"chunk {i}: checksum mismatch")
                else:
                    host_copy(dst[lo:hi], body)
                return
            try:
                if data_key is not None:
                    if unit == 1 and not cflags:  # plaintext is the stored bytes themselves
                        self._decrypt(data_key, extra, body, header, i, dst[lo:hi])
                        return
                    # NOTE: sized by the value's chunks, not this codec's: a value written
                    # under a larger chunk_bytes (another config, another server) must decode.
                    buf = self._scratch.acquire(stored)
                    plain = buf[:stored]
                    self._decrypt(data_key, extra, body, header, i, plain)
                else:
                    if checksum(body, seed=i) != extra:
                        raise IntegrityError(f"chunk {i}: checksum mismatch")
                    plain = body
                self._unpack(info.compression, cflags, plain, size, unit, dst[lo:hi], i)
            finally:
                if buf is not None:
                    self._scratch.release(buf)

        self._parallel(restore, len(ranges),
                       inline=info.compression == COMPRESSION_NONE and info.raw_nbytes <= INLINE_RAW_BYTES)
        if q is not None:
            unpack_payload_into(dst, spec, q, out)
        return out

    @staticmethod
    def _check_expected(info: HeaderInfo, tenant: str, key: bytes, spec: ModelSpec) -> None:
        if info.key != bytes(key):
            raise IntegrityError("value belongs to another block key")
        if info.tenant_hash != tenant_hash(tenant):
            raise IntegrityError("value belongs to another tenant")
        if info.fingerprint != spec_fingerprint(spec):
            raise IntegrityError("value belongs to another model spec (fingerprint mismatch)")
        if info.dtype != DTYPES[spec.dtype][0] or info.itemsize != spec.itemsize:
            raise IntegrityError(f"value dtype {info.dtype!r} does not match the spec's {spec.dtype!r}")
        if info.shape != spec.block_shape:
            raise IntegrityError(f"value shape {info.shape} does not match the spec's {spec.block_shape}")
        q = info.quant
        if q is not None and not worth_it(spec, q):
            raise IntegrityError(f"a {q} value is impossible for a {spec.dtype} block of this shape")
        want = spec.block_nbytes if q is None else q.payload_nbytes(spec)
        if info.raw_nbytes != want:
            raise IntegrityError(f"value holds {info.raw_nbytes} bytes; a "
                                 f"{q or 'lossless'} block of this spec holds {want}")

    @staticmethod
    def _decrypt(data_key: bytes, nonce: bytes, body: np.ndarray, header: bytes, i: int,
                 dst: np.ndarray) -> None:
        try:
            AESGCM(data_key).decrypt_into(nonce, body, header + CHUNK_INDEX.pack(i), dst)
        except InvalidTag:
            raise IntegrityError(f"chunk {i}: authentication failed") from None
        except ValueError as exc:  # buffer length mismatch: the header lied about sizes
            raise IntegrityError(f"chunk {i}: {exc}") from None

    def _unpack(self, comp: int, cflags: int, plain: np.ndarray, size: int, itemsize: int,
                dst: np.ndarray, i: int) -> None:
        """Decompress (if flagged) and unshuffle one chunk's stored bytes into ``dst``."""
        assert comp != COMPRESSION_NONE  # stored chunks are never shuffled
        plane = size // itemsize
        start = size - plane if comp == COMPRESSION_ZSTD_TOP else 0
        if cflags & CHUNK_COMPRESSED:
            packed = plain[start:]
            want = size - start
            try:
                if zstandard.frame_content_size(packed) != want:
                    raise IntegrityError(f"chunk {i}: compressed frame announces a wrong size")
                unpacked = self._zstd_d().decompress(packed, max_output_size=want)
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


__all__ = [
    "FORMAT_VERSION",
    "Codec",
    "CodecConfig",
    "HeaderInfo",
    "QuantScheme",
    "Quantization",
    "parse_header",
    "tenant_hash",
]
