"""The stored format of NVMe and remote values: constants, the header's byte layout, its writers
(:func:`pack_prefix`, :func:`pack_header`) and its readers (:func:`parse_header`,
:func:`check_header`). The codec itself is :mod:`kvstore.codec`.

Value layout (little-endian)::

    fixed header  magic "KVSV", format version, flags, compression, quantization, itemsize,
                  dtype-name length, ndim, chunk_bytes, n_chunks, raw length,
                  fingerprint (16), block key (32), tenant hash (16)
    dtype name, shape (u32 each)
    chunk table   per chunk: stored length u32, chunk flags u8, then
                  nonce (12) when encrypted, or xxh3-128 of the stored chunk (seed = index)
    header digest xxh3-128 of all of the above (unencrypted values only)
    payload       chunks back to back; encrypted chunks are ciphertext + 16-byte GCM tag

:func:`parse_header` parses and sanity-checks a header (every length, flag and the announced total
size) and raises :class:`~kvstore.errors.IntegrityError` for anything malformed or truncated; it
authenticates nothing (the codec does, when it decodes). :func:`check_header` raises
IntegrityError unless a parsed header names the block the caller expects.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kernels.checksum import checksum
from kvstore.errors import IntegrityError, InvalidArgument
from kvstore.keys import KEY_BYTES
from kvstore.quantization import QUANT_NONE, Quantization, worth_it
from kvstore.spec import DTYPES, FINGERPRINT_BYTES, ModelSpec

MAGIC = b"KVSV"
FORMAT_VERSION = 1

FLAG_ENCRYPTED = 0x01
FLAG_CHECKSUM = 0x02
CHUNK_COMPRESSED = 0x01

COMPRESSION_NONE = 0
COMPRESSION_ZSTD_ALL = 1  # zstd over every byte plane of the chunk
COMPRESSION_ZSTD_TOP = 2  # zstd over the top byte plane only; lower planes stored raw

TAG_BYTES = 16
NONCE_BYTES = 12
DIGEST_BYTES = 16
TENANT_HASH_BYTES = 16

FIXED = struct.Struct(f"<4sBBBBBBBxIIQ{FINGERPRINT_BYTES}s{KEY_BYTES}s{TENANT_HASH_BYTES}s")
ENTRY_ENC = struct.Struct(f"<IB{NONCE_BYTES}s")
ENTRY_SUM = struct.Struct(f"<IB{DIGEST_BYTES}s")
CHUNK_INDEX = struct.Struct("<I")


def spec_fingerprint(spec: ModelSpec) -> bytes:
    return spec.fingerprint


@functools.lru_cache(maxsize=4096)
def tenant_hash(tenant: str) -> bytes:
    """The 16-byte tenant namespace hash stored in headers (the name itself is not stored).
    Memoized: every encode and decode needs it, and a process serves few tenants."""
    return hashlib.blake2b(tenant.encode(), digest_size=TENANT_HASH_BYTES, person=b"kvstore-tenant").digest()


@dataclass(frozen=True, slots=True)
class HeaderInfo:
    """A parsed header. Unauthenticated until the value decodes: use for diagnostics only."""

    version: int
    encrypted: bool
    compression: int
    quantization: int
    itemsize: int
    dtype: str
    shape: tuple[int, ...]
    raw_nbytes: int
    """Bytes of the stored plaintext: the block, or the quantized payload."""
    chunk_bytes: int
    fingerprint: bytes
    key: bytes
    tenant_hash: bytes
    chunks: tuple[tuple[int, int, bytes], ...]
    """(stored length, chunk flags, nonce or checksum) per chunk."""
    header_nbytes: int
    """Bytes of the header, chunk table and (unencrypted) header digest."""

    @property
    def quant(self) -> Quantization | None:
        """The value's lossy format, None when it is stored lossless."""
        return Quantization.from_format_id(self.quantization)

    @property
    def total_nbytes(self) -> int:
        tag = TAG_BYTES if self.encrypted else 0
        return self.header_nbytes + sum(n + tag for n, _, _ in self.chunks)


def chunk_ranges(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, nbytes)) for lo in range(0, nbytes, chunk)]


def effective_chunk(chunk_bytes: int, itemsize: int) -> int:
    return max(itemsize, chunk_bytes - chunk_bytes % itemsize)


def pack_prefix(tenant: str, key: bytes, spec: ModelSpec, q: Quantization | None, encrypted: bool,
                comp: int, chunk_bytes: int, n_chunks: int, raw_nbytes: int) -> bytes:
    """The fixed header, dtype name and shape of a value (its chunk table follows)."""
    dtype = DTYPES[spec.dtype][0].encode()
    shape = spec.block_shape
    prefix = FIXED.pack(MAGIC, FORMAT_VERSION, FLAG_ENCRYPTED if encrypted else FLAG_CHECKSUM, comp,
                        q.format_id if q else QUANT_NONE, spec.itemsize, len(dtype), len(shape),
                        chunk_bytes, n_chunks, raw_nbytes,
                        spec_fingerprint(spec), bytes(key), tenant_hash(tenant))
    return prefix + dtype + struct.pack(f"<{len(shape)}I", *shape)


def pack_header(prefix: bytes, entries: Iterable[tuple[int, int, bytes]], encrypted: bool) -> bytes:
    """The whole header: ``prefix`` (:func:`pack_prefix`), the chunk table from ``entries``
    ((stored length, chunk flags, nonce or checksum) per chunk) and, unencrypted, its digest."""
    if encrypted:
        return prefix + b"".join(ENTRY_ENC.pack(*e) for e in entries)
    header = prefix + b"".join(ENTRY_SUM.pack(*e) for e in entries)
    return header + checksum(header)


def parse_header(value: Any) -> HeaderInfo:
    """Parse and sanity-check a value's header; IntegrityError if it is malformed or truncated."""
    try:
        mv = memoryview(value).cast("B")
    except TypeError:
        raise IntegrityError(f"value is not a buffer ({type(value).__name__})") from None
    if len(mv) < FIXED.size:
        raise IntegrityError(f"value truncated: {len(mv)} bytes is shorter than the fixed header")
    (magic, version, flags, comp, quant, itemsize, dtype_len, ndim, chunk_bytes, n_chunks, raw_len,
     fp, key, th) = FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise IntegrityError("bad magic: not a kvstore value")
    if version != FORMAT_VERSION:
        raise IntegrityError(f"unsupported value format version {version}")
    encrypted = flags == FLAG_ENCRYPTED
    if flags not in (FLAG_ENCRYPTED, FLAG_CHECKSUM):
        raise IntegrityError(f"bad flags {flags:#x}")
    if comp not in (COMPRESSION_NONE, COMPRESSION_ZSTD_ALL, COMPRESSION_ZSTD_TOP):
        raise IntegrityError(f"unknown compression id {comp}")
    if itemsize < 1 or chunk_bytes < itemsize or chunk_bytes % itemsize:
        raise IntegrityError("bad itemsize or chunk size")
    try:
        Quantization.from_format_id(quant)
    except InvalidArgument:
        raise IntegrityError(f"unknown quantization id {quant}") from None
    if n_chunks != -(-raw_len // chunk_bytes) or n_chunks == 0:
        raise IntegrityError("chunk count does not match the raw length")
    entry = ENTRY_ENC if encrypted else ENTRY_SUM
    off = FIXED.size
    end = off + dtype_len + 4 * ndim + n_chunks * entry.size + (0 if encrypted else DIGEST_BYTES)
    if len(mv) < end:
        raise IntegrityError(f"value truncated inside its header ({len(mv)} < {end} bytes)")
    try:
        dtype = bytes(mv[off : off + dtype_len]).decode("ascii")
    except UnicodeDecodeError:
        raise IntegrityError("dtype name is not ASCII") from None
    off += dtype_len
    shape = struct.unpack_from(f"<{ndim}I", mv, off)
    off += 4 * ndim
    table_end = off + n_chunks * entry.size
    chunks = tuple(entry.iter_unpack(mv[off:table_end]))
    off = table_end
    for i, (stored, cflags, _) in enumerate(chunks):
        size = chunk_bytes if i < n_chunks - 1 else raw_len - chunk_bytes * (n_chunks - 1)
        compressed = cflags == CHUNK_COMPRESSED
        if cflags not in (0, CHUNK_COMPRESSED) or (compressed and comp == COMPRESSION_NONE):
            raise IntegrityError(f"chunk {i}: bad chunk flags {cflags:#x}")
        if stored > size or (not compressed and stored != size):
            raise IntegrityError(f"chunk {i}: stored length {stored} impossible for {size} raw bytes")
    if not encrypted:
        if checksum(mv[:off]) != bytes(mv[off : off + DIGEST_BYTES]):
            raise IntegrityError("header checksum mismatch")
        off += DIGEST_BYTES
    info = HeaderInfo(version, encrypted, comp, quant, itemsize, dtype, tuple(shape), raw_len,
                      chunk_bytes, fp, key, th, chunks, off)
    if len(mv) != info.total_nbytes:
        raise IntegrityError(f"value length {len(mv)} != {info.total_nbytes} announced by its header")
    return info


def check_header(info: HeaderInfo, tenant: str, key: bytes, spec: ModelSpec) -> None:
    """IntegrityError unless ``info`` names block ``key`` of ``tenant`` under ``spec`` (dtype,
    shape and a raw length the spec allows, lossless or quantized)."""
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
