"""Frames of the in-band Put/Get streams: a small protobuf header followed by the raw payload.

The wire format is documented in ``proto/kvstore/v1/kvstore.proto`` (``PutFrame``/``GetFrame``);
in short, a frame is a valid protobuf message whose ``data`` field (15) comes last and whose
first field (1, fixed32) gives the byte length of everything before ``data``::

    0x0d <meta_bytes u32 LE> <fields 2..14> 0x7a <varint n> <n payload bytes>

Why: a protobuf ``bytes`` field costs one extra copy of the payload on each side (build the
message, then serialize it; parse it, then read the field). Here the writer copies the payload
once into the frame it hands to grpc, and the reader takes the payload as a ``memoryview`` of
the received message. Both the client and the server use these functions.

A stream's payload is its blocks' bytes, concatenated in order. A frame's ``(block, offset)``
says where its data starts; the data may run on past the end of that block into the following
ones. Why: grpc python pays a fixed cost per message, so blocks much smaller than a frame
(256 KiB blocks of small models against 2 MiB frames) move several to a frame
(``bench/service_bench.py --sizes 0.25 --repeats 7``, two runs each, one frame per block ->
packed, GB/s: put 1.33, 1.41 -> 2.17, 1.84; get 1.68, 1.66 -> 2.09, 2.17; a bare grpcio stream
of one message per block: 1.8–2.0 put, 2.0–2.2 get). The
one-block-per-frame layout (what older writers send) is the special case of frames that stop
at block boundaries; readers accept both.

* :func:`encode` / :func:`data_frame` build a frame (``bytes``, ready for grpc with no
  serializer). :func:`data_frame` fills ``xxh3`` with the payload's xxh3_64; its payload may be
  given in pieces (the parts of consecutive blocks). It hashes and copies the payload in one
  pass, ``_PASS`` bytes at a time, into a ``bytes`` object it allocates uninitialised and
  writes before anyone else sees it (``PyBytes_FromStringAndSize(NULL, n)``, the C API's own
  way to build a bytes object in place; the header goes in last, once the digest is known).
  Why: hashing a whole 2 MiB block, then copying it, reads it from memory twice; a piece that
  was just hashed is copied from the cache.
* :func:`block_frames` cuts ``n`` blocks into frames of at most ``chunk`` payload bytes:
  packed across blocks, or (``pack=False``) one block per frame.
* :func:`decoder(cls)` returns a grpc deserializer producing :class:`Frame`. It never raises:
  a malformed frame comes back with ``error`` set, so the consumer can answer INVALID_ARGUMENT
  (an exception inside a grpc deserializer would become an opaque INTERNAL error).
* :func:`intact(frame)` checks a frame's checksum.
* :func:`scatter` writes the payloads of in-order, intact frames straight into each block's
  destination (one copy), checking continuity, checksums, overrun and a short stream;
  :func:`write_into` is the writer both sides give it.

Frames in any other valid protobuf layout (a generic client) are parsed as plain messages.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from google.protobuf.message import DecodeError, Message

from kernels.copy import copy_bytes

_META_TAG = 0x0D  # field 1, wire type 5 (fixed32)
_DATA_TAG = 0x7A  # field 15, wire type 2 (length-delimited)
_PREFIX = struct.Struct("<BI")
_EMPTY = memoryview(b"")
#: bytes hashed then copied at a time by data_frame: small enough to stay in the L2 cache
_PASS = 512 << 10
# a new bytes object whose contents the caller writes, and the address of its contents
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype = ctypes.c_void_p
_bytes_data.argtypes = (ctypes.py_object,)


def checksum(data: Any) -> int:
    """xxh3_64 of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(data)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it); raises IndexError on a truncated varint."""
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def encode(meta: Message, *data: Any) -> bytes:
    """The frame of ``meta`` (without its ``data`` field) followed by the payload: the
    concatenation of the bytes-like ``data`` pieces (none, or all empty: no payload)."""
    n = sum(memoryview(d).nbytes for d in data if d is not None)
    if not n:
        body = meta.SerializeToString()
        return _PREFIX.pack(_META_TAG, _PREFIX.size + len(body)) + body
    return b"".join((_head(meta, n), *data))


class _Memory:
    """``n`` bytes at ``address`` as a numpy array (the ``__array_interface__`` protocol).
    NOTE: not ``(ctypes.c_uint8 * n).from_address``: ctypes keeps every array type it makes,
    one per length, for the life of the process."""

    def __init__(self, address: int, n: int) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (n,), "typestr": "|u1", "version": 3}


def _writable(fresh: bytes) -> np.ndarray:
    """A writable view of a bytes object just made by ``_new_bytes`` and not yet shared."""
    return np.asarray(_Memory(_bytes_data(fresh), len(fresh)))


def data_frame(cls: type[Message], block: int, offset: int, *data: Any) -> bytes:
    """A checksummed frame whose payload, the concatenation of the ``data`` pieces, starts at
    ``offset`` of block ``block`` (and may run on into the following blocks)."""
    pieces = [np.frombuffer(d, dtype=np.uint8) for d in data]
    n = sum(p.size for p in pieces)
    if not n:
        return encode(cls(block=block, offset=offset, xxh3=checksum(b"")))
    # the header's size does not depend on the digest (xxh3 is fixed64), except for a digest
    # of 0, which protobuf leaves out: that case is built again below
    meta = cls(block=block, offset=offset, xxh3=1)
    head = len(_head(meta, n))
    out = _new_bytes(None, head + n)
    frame = _writable(out)
    h = xxhash.xxh3_64()
    pos = head
    for piece in pieces:
        for lo in range(0, piece.size, _PASS):
            part = piece[lo : lo + _PASS]
            h.update(part)  # NOTE: hash first, then copy: the copy reads the part from the cache
            frame[pos : pos + part.size] = part
            pos += part.size
    meta.xxh3 = h.intdigest()
    if not meta.xxh3:
        return encode(meta, *data)
    frame[:head] = np.frombuffer(_head(meta, n), dtype=np.uint8)
    return out


def _head(meta: Message, n: int) -> bytes:
    """Everything of ``meta``'s frame before its ``n`` payload bytes."""
    body = meta.SerializeToString()
    return _PREFIX.pack(_META_TAG, _PREFIX.size + len(body)) + body + bytes((_DATA_TAG,)) + _varint(n)


def block_frames(cls: type[Message], blocks: Sequence[Any], nbytes: int, chunk: int, *,
                 pack: bool = True) -> Iterator[bytes]:
    """Checksummed frames carrying ``blocks`` (each a bytes-like of ``nbytes``), in order, at
    most ``chunk`` payload bytes each: every frame full but the last when ``pack``, else a
    block's last frame stops at its end (the one-block-per-frame layout)."""
    views = [memoryview(b) for b in blocks]
    if not pack:
        for i, view in enumerate(views):
            for off in range(0, nbytes, chunk):
                yield data_frame(cls, i, off, view[off : off + chunk])
        return
    total = nbytes * len(views)
    for start in range(0, total, chunk):
        block, offset = divmod(start, nbytes)
        yield data_frame(cls, block, offset, *_pieces(views, nbytes, start, min(start + chunk, total)))


def _pieces(views: list[memoryview], nbytes: int, start: int, end: int) -> Iterator[memoryview]:
    """The views of the stream's bytes [start, end), one per block they touch."""
    while start < end:
        block, lo = divmod(start, nbytes)
        hi = min(nbytes, lo + end - start)
        yield views[block][lo:hi]
        start += hi - lo


@dataclass(slots=True)
class Frame:
    """A decoded frame: ``meta`` is the message without its payload, ``data`` a view of the
    payload; ``error`` is set (and the rest empty) when the frame could not be parsed."""

    meta: Any
    data: memoryview
    error: str = ""


def _fast(cls: type[Message], raw: bytes) -> Frame | None:
    """The frame when ``raw`` has kvstore's layout, else None."""
    if len(raw) < _PREFIX.size or raw[0] != _META_TAG:
        return None
    meta_len = _PREFIX.unpack_from(raw)[1]
    if not _PREFIX.size <= meta_len <= len(raw):
        return None
    view = memoryview(raw)
    try:
        meta = cls.FromString(view[:meta_len])
        if meta_len == len(raw):
            return Frame(meta, _EMPTY)
        if raw[meta_len] != _DATA_TAG:
            return None
        n, pos = _read_varint(raw, meta_len + 1)
    except (DecodeError, IndexError):
        return None
    if pos + n != len(raw):
        return None
    return Frame(meta, view[pos:])


def decoder(cls: type[Message]) -> Callable[[bytes], Frame]:
    """A grpc deserializer of ``cls`` frames (``PutFrame`` or ``GetFrame``); never raises."""

    def decode(raw: bytes) -> Frame:
        frame = _fast(cls, raw)
        if frame is not None:
            return frame
        try:
            msg = cls.FromString(raw)
        except DecodeError as exc:
            return Frame(cls(), _EMPTY, error=f"malformed {cls.__name__}: {exc}")
        data = msg.data
        msg.ClearField("data")
        return Frame(msg, memoryview(data))

    return decode


def payload_nbytes(raw: bytes) -> int:
    """The payload length of a frame :func:`encode` or :func:`data_frame` built (read from its
    prefix and the ``data`` field's length, not parsed: the sender counts what it sent)."""
    meta_len = _PREFIX.unpack_from(raw)[1]
    if meta_len == len(raw):
        return 0
    return _read_varint(raw, meta_len + 1)[0]


def intact(frame: Frame) -> bool:
    """Whether the payload matches the frame's xxh3 (a frame without payload is intact)."""
    return not len(frame.data) or checksum(frame.data) == frame.meta.xxh3


def write_into(dst: Any, lo: int, data: memoryview) -> None:
    """Copy ``data`` into ``dst[lo:]``: a host array, or a device tensor."""
    if isinstance(dst, np.ndarray):
        dst[lo : lo + len(data)] = np.frombuffer(data, dtype=np.uint8)
    else:
        copy_bytes(dst[lo : lo + len(data)], data)


def scatter(frames: Iterable[Frame], n: int, nbytes: int, destination: Callable[[int], Any],
            write: Callable[[Any, int, memoryview], None], error: Callable[[str], Exception]) -> None:
    """Write ``n`` blocks of ``nbytes`` from in-order, checksummed data frames (packed across
    blocks or not): ``write(dst, lo, piece)`` copies each frame's bytes straight into
    ``dst = destination(i)``, a buffer of block i asked for once per block, at byte ``lo``.
    A malformed, out-of-order or corrupt frame, a frame past the last block or a stream that
    ends early raises ``error(message)``; nothing is written from a frame that fails a check."""
    block = filled = 0
    current: Any = None
    for frame in frames:
        fault = _fault(frame, block, filled, n, nbytes)
        if fault:
            raise error(fault)
        data, done = frame.data, 0
        while done < len(data):
            if current is None:
                current = destination(block)
            step = min(nbytes - filled, len(data) - done)
            write(current, filled, data[done : done + step])
            done += step
            filled += step
            if filled == nbytes:
                block, filled, current = block + 1, 0, None
    if block != n or filled:
        raise error(f"the stream ended after {block} of {n} blocks")


def _fault(frame: Frame, block: int, filled: int, n: int, nbytes: int) -> str:
    """What is wrong with ``frame`` as the next one of a stream of ``n`` blocks of ``nbytes``
    when ``filled`` bytes of block ``block`` arrived so far; "" when nothing."""
    if frame.error:
        return frame.error
    m, size = frame.meta, len(frame.data)
    if m.HasField("header"):
        return "only the first frame of a stream may carry a header"
    if m.block != block or m.offset != filled:
        return f"out-of-order frame: got block {m.block} offset {m.offset}, expected block {block} offset {filled}"
    if block >= n:
        return f"more data than the {n} blocks the header names"
    if not size:
        return f"a data frame without data at block {block} offset {filled}"
    if block * nbytes + filled + size > n * nbytes:
        return f"a frame of {size} bytes at block {block} offset {filled} overruns the {n} blocks of {nbytes} bytes"
    if not intact(frame):
        return f"checksum mismatch in the frame at block {block} offset {filled}"
    return ""
