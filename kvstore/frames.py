"""Frames of the in-band Put/Get streams: a small protobuf header followed by the raw payload.

The wire format is documented in ``proto/kvstore/v1/kvstore.proto`` (``PutFrame``/``GetFrame``);
in short, a frame is a valid protobuf message whose ``data`` field (15) comes last and whose
first field (1, fixed32) gives the byte length of everything before ``data``::

    0x0d <meta_bytes u32 LE> <fields 2..14> 0x7a <varint n> <n payload bytes>

Why: a protobuf ``bytes`` field costs one extra copy of the payload on each side (build the
message, then serialize it; parse it, then read the field). Here the writer copies the payload
once into the frame it hands to grpc, and the reader takes the payload as a ``memoryview`` of
the received message. Both the client and the server use these functions.

* :func:`encode` / :func:`data_frame` build a frame (``bytes``, ready for grpc with no
  serializer). :func:`data_frame` fills ``xxh3`` with the payload's xxh3_64 (≈ 20 GB/s).
* :func:`decoder(cls)` returns a grpc deserializer producing :class:`Frame`. It never raises:
  a malformed frame comes back with ``error`` set, so the consumer can answer INVALID_ARGUMENT
  (an exception inside a grpc deserializer would become an opaque INTERNAL error).
* :func:`intact(frame)` checks a frame's checksum.

Frames in any other valid protobuf layout (a generic client) are parsed as plain messages.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash
from google.protobuf.message import DecodeError, Message

_META_TAG = 0x0D  # field 1, wire type 5 (fixed32)
_DATA_TAG = 0x7A  # field 15, wire type 2 (length-delimited)
_PREFIX = struct.Struct("<BI")
_EMPTY = memoryview(b"")


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


def encode(meta: Message, data: Any = None) -> bytes:
    """The frame of ``meta`` (without its ``data`` field) followed by the payload ``data``."""
    body = meta.SerializeToString()
    prefix = _PREFIX.pack(_META_TAG, _PREFIX.size + len(body))
    if data is None or not len(data):
        return prefix + body
    n = memoryview(data).nbytes
    return b"".join((prefix, body, bytes((_DATA_TAG,)), _varint(n), data))


def data_frame(cls: type[Message], block: int, offset: int, data: Any) -> bytes:
    """A checksummed frame carrying ``data`` at ``offset`` of block ``block``."""
    return encode(cls(block=block, offset=offset, xxh3=checksum(data)), data)


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


def intact(frame: Frame) -> bool:
    """Whether the payload matches the frame's xxh3 (a frame without payload is intact)."""
    return not len(frame.data) or checksum(frame.data) == frame.meta.xxh3
