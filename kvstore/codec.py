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

The value layout and the header's writer and reader (:func:`parse_header`) live in
:mod:`kvstore.codec_format`; :class:`CodecConfig` and the chunking it implies in
:mod:`kvstore.codec_config`; one chunk's shuffle/zstd/AES-GCM work in :mod:`kvstore.codec_chunks`;
the caller's blocks and output buffers in :mod:`kvstore.codec_buffers`. This module runs them:
validation, the choices per value, and the chunks on the thread pool.

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
    * The values a codec with ``encrypt=True`` accepts are encrypted ones only, and vice versa:
      the other kind raises :class:`~kvstore.errors.EncryptionMismatch` (a FailedPrecondition,
      not IntegrityError: a configuration fault, and the stored bytes are fine, so callers keep
      them).
    * ``decode`` checks ``tenant``, ``key`` and ``spec`` as ``encode`` does (InvalidArgument).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import numpy as np
import zstandard

from kernels.checksum import checksum
from kernels.copy import host_copy
from kvstore.codec_buffers import ScratchPool, block_output, block_source, value_output
from kvstore.codec_chunks import (
    SAMPLE_SCRATCH_BYTES,
    decrypt_chunk,
    encrypt_chunk,
    pack_chunk,
    sample_ratio,
    unpack_chunk,
    zstd_compressor,
)
from kvstore.codec_config import (
    DEFAULT_MIN_COMPRESS_RATIO,
    INLINE_RAW_BYTES,
    SAMPLE_BYTES,
    SAMPLE_SLICES,
    CodecConfig,
    chunk_size,
)
from kvstore.codec_format import (
    COMPRESSION_NONE,
    COMPRESSION_ZSTD_ALL,
    COMPRESSION_ZSTD_TOP,
    DIGEST_BYTES,
    ENTRY_ENC,
    ENTRY_SUM,
    FIXED,
    FORMAT_VERSION,
    NONCE_BYTES,
    TAG_BYTES,
    HeaderInfo,
    check_header,
    chunk_ranges,
    pack_header,
    pack_prefix,
    parse_header,
    tenant_hash,
)
from kvstore.errors import (
    EncryptionMismatch,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
)
from kvstore.keyring import Keyring
from kvstore.keys import KEY_BYTES
from kvstore.quantization import (
    QuantArg,
    Quantization,
    QuantScheme,
    unpack_payload_into,
    worth_it,
)
from kvstore.spec import DTYPES, ModelSpec

RandomBytes = Callable[[int], bytes]


def _check_key(key: Any) -> None:
    """InvalidArgument unless ``key`` is a block key (encode and decode alike)."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise InvalidArgument(f"block key must be {KEY_BYTES} bytes")


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
        self._scratch = ScratchPool(config.chunk_bytes + TAG_BYTES, keep=4 * config.threads + 8)
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
            c = self._local.cctx = zstd_compressor(self.config.compression_level)
        return c

    def _zstd_d(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "dctx", None)
        if d is None:
            d = self._local.dctx = zstandard.ZstdDecompressor()
        return d

    def _sample_buf(self) -> np.ndarray:
        buf = getattr(self._local, "sample", None)
        if buf is None:
            buf = self._local.sample = np.empty(SAMPLE_SCRATCH_BYTES, dtype=np.uint8)
        return buf

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
        return len(chunk_ranges(nbytes, chunk_size(self.config, nbytes, unit)))

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
        _check_key(key)
        if not isinstance(spec, ModelSpec):
            raise InvalidArgument("spec must be a ModelSpec")
        src, unit, q = block_source(data, spec, quant)
        if cfg.compression_level == 0:
            comp = COMPRESSION_NONE
        else:
            comp = COMPRESSION_ZSTD_TOP if cfg.compress_planes == "top" else COMPRESSION_ZSTD_ALL
            if (cfg.min_compress_ratio > 1.0
                    and sample_ratio(src, unit, comp, self._zstd_c(), self._sample_buf())
                    < cfg.min_compress_ratio):
                comp = COMPRESSION_NONE  # early abort: not worth its CPU (see sample_ratio)
        chunk = chunk_size(cfg, src.size, unit, raw=comp == COMPRESSION_NONE)
        ranges = chunk_ranges(src.size, chunk)
        n = len(ranges)
        data_key = self._data_key(tenant, create=True) if cfg.encrypt else None
        nonces = self._random(NONCE_BYTES * n) if data_key else b""
        if data_key is not None and len(nonces) != NONCE_BYTES * n:
            raise FailedPrecondition("random source returned too few bytes")
        prefix = pack_prefix(tenant, key, spec, q, data_key is not None, comp, chunk, n, src.size)
        tag = TAG_BYTES if data_key else 0
        if comp == COMPRESSION_NONE:
            return self._encode_stored(prefix, src, ranges, data_key, nonces, out)

        # Phase 1: shuffle (+ compress) each chunk into a scratch buffer -> (buf, stored, flags, sum)
        def stage(i: int) -> tuple[np.ndarray, int, int, bytes]:
            lo, hi = ranges[i]
            buf = self._scratch.acquire()
            try:
                stored, flags = pack_chunk(src[lo:hi], unit, comp, buf, self._zstd_c())
                digest = b"" if data_key else checksum(buf[:stored], seed=i)
            except BaseException:
                self._scratch.release(buf)
                raise
            return buf, stored, flags, digest

        staged = self._parallel(stage, n)
        try:
            header = pack_header(prefix, [
                (stored, flags, nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES] if data_key else digest)
                for i, (_, stored, flags, digest) in enumerate(staged)], data_key is not None)
            offsets = [len(header)]
            for _, stored, _, _ in staged:
                offsets.append(offsets[-1] + stored + tag)
            total = offsets[-1]
            result, dst = value_output(out, total)
            dst[: len(header)] = np.frombuffer(header, dtype=np.uint8)

            # Phase 2: encrypt (or copy) each staged chunk to its place in the value.
            def place(i: int) -> None:
                buf, stored, _, _ = staged[i]
                target = dst[offsets[i] : offsets[i + 1]]
                if data_key is not None:
                    nonce = nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES]
                    encrypt_chunk(data_key, nonce, buf[:stored], header, i, target)
                else:
                    target[:] = buf[:stored]

            self._parallel(place, n)
        finally:
            for buf, _, _, _ in staged:
                self._scratch.release(buf)
        return result, total

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
        result, dst = value_output(out, total)
        header = b""
        if data_key is not None:
            header = pack_header(prefix, [(hi - lo, 0, nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES])
                                          for i, (lo, hi) in enumerate(ranges)], True)

        def place(i: int) -> bytes:
            lo, hi = ranges[i]
            target = dst[offsets[i] : offsets[i + 1]]
            if data_key is not None:
                nonce = nonces[i * NONCE_BYTES : (i + 1) * NONCE_BYTES]
                encrypt_chunk(data_key, nonce, src[lo:hi], header, i, target)
                return b""
            host_copy(target, src[lo:hi])
            return checksum(target, seed=i)

        digests = self._parallel(place, n, inline=ranges[-1][1] <= INLINE_RAW_BYTES)
        if data_key is None:
            header = pack_header(prefix, [(hi - lo, 0, digests[i]) for i, (lo, hi) in enumerate(ranges)],
                                 False)
        assert len(header) == hlen
        dst[:hlen] = np.frombuffer(header, dtype=np.uint8)
        return result, total

    # -- decode -----------------------------------------------------------------------------
    def decode(self, tenant: str, key: bytes, spec: ModelSpec, value: Any,
               out: np.ndarray | None = None) -> np.ndarray:
        """Decode ``value`` for (tenant, key, spec) into ``out`` (or a new array); see module doc.

        A quantized value is dequantized into the spec's dtype (the format is read from the
        header; nothing to pass)."""
        cfg = self.config
        if not isinstance(tenant, str) or not tenant:
            raise InvalidArgument("tenant must be a non-empty string")
        _check_key(key)  # NOTE: unchecked, a str/None key escaped as TypeError from check_header
        if not isinstance(spec, ModelSpec):
            raise InvalidArgument("spec must be a ModelSpec")
        out = block_output(out, spec.block_nbytes)
        info = parse_header(value)
        check_header(info, tenant, key, spec)
        if info.encrypted != cfg.encrypt:
            raise EncryptionMismatch(
                "value is " + ("encrypted" if info.encrypted else "unencrypted") + " but this codec "
                + ("encrypts" if cfg.encrypt else "does not encrypt")
                + " (encrypt is set otherwise than where the value was written)")
        data_key = self._data_key(tenant, create=False) if info.encrypted else None
        q = info.quant
        # A quantized payload is restored into a scratch array, then dequantized into out.
        dst, unit = (out, spec.itemsize) if q is None else (np.empty(info.raw_nbytes, np.uint8), 1)
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
                    decrypt_chunk(data_key, extra, body, header, i, dst[lo:hi])
                elif checksum(body, seed=i) != extra:
                    raise IntegrityError(f"chunk {i}: checksum mismatch")
                else:
                    host_copy(dst[lo:hi], body)
                return
            try:
                if data_key is not None:
                    if unit == 1 and not cflags:  # plaintext is the stored bytes themselves
                        decrypt_chunk(data_key, extra, body, header, i, dst[lo:hi])
                        return
                    # NOTE: sized by the value's chunks, not this codec's: a value written
                    # under a larger chunk_bytes (another config, another server) must decode.
                    buf = self._scratch.acquire(stored)
                    plain = buf[:stored]
                    decrypt_chunk(data_key, extra, body, header, i, plain)
                else:
                    if checksum(body, seed=i) != extra:
                        raise IntegrityError(f"chunk {i}: checksum mismatch")
                    plain = body
                unpack_chunk(info.compression, cflags, plain, size, unit, dst[lo:hi], i, self._zstd_d())
            finally:
                if buf is not None:
                    self._scratch.release(buf)

        self._parallel(restore, len(ranges),
                       inline=info.compression == COMPRESSION_NONE and info.raw_nbytes <= INLINE_RAW_BYTES)
        if q is not None:
            unpack_payload_into(dst, spec, q, out)
        return out


__all__ = [
    "DEFAULT_MIN_COMPRESS_RATIO",
    "FORMAT_VERSION",
    "INLINE_RAW_BYTES",
    "SAMPLE_BYTES",
    "SAMPLE_SLICES",
    "Codec",
    "CodecConfig",
    "HeaderInfo",
    "QuantScheme",
    "Quantization",
    "parse_header",
    "tenant_hash",
]
