"""The remote tier's envelope: what a stored value says of its block, before its codec value.

A remote value is :data:`ENVELOPE` (64 bytes) then a :mod:`kvstore.codec` value. The envelope
holds magic, version, a flags byte, 2 pad bytes, the block's TTL deadline and its creation time
(float seconds since the epoch; NaN = none), the id of the tenant data key it was encrypted with
(:func:`kvstore.keyring.key_id`; zeros = none) and the key of the block's parent
(:data:`kvstore.keys.ROOT_KEY` for a root; recorded when flag bit 0 is set). Versions 1
(:data:`ENVELOPE_V1`, 24 bytes, no key id) and 2 (:data:`ENVELOPE_V2`, 32 bytes, no parent) are
still read, their parent unknown (``RemoteInfo.parent`` None); a value without the envelope (an
older version) is read with nothing known (``RemoteInfo.known`` False).

NOTE: version 3 records the parent: a block's key alone does not say whether it is a root or a
link of a chain (nor under which parent), so a server that did not hold the chain served chain
links as roots and promoted them so (parent ROOT_KEY, depth 0), then refused a valid put of the
chain itself. A reader that knows the parent a block must have (a roots call, a chain's next
link) treats a copy recording another parent, or none, as a miss. NOTE: the envelope is not authenticated (the codec header is):
whoever can write the Redis can move a deadline, as they can already put back a value deleted
before.

Primitives (pure: no Redis round trip, no tier state):

* ``pack_envelope(buf, deadline, created, kid, parent)`` — writes a version 3 envelope at
  ``buf[0:64]`` (``parent`` None: not recorded).
* ``split_value(value)`` — (codec value, :class:`RemoteInfo`) of one stored value; raises
  :class:`~kvstore.errors.IntegrityError` for an envelope of an unknown version.
* ``live_at(head, now)`` — whether a value, read as its first :data:`ENVELOPE`.size bytes
  (``GETRANGE``), is before its deadline at ``now`` (True for a value without the envelope).
* ``parent_of(head)`` — the parent key such a head records; None when it records none.
* ``update_ttl_command(key, deadline, px)`` — the command that moves a block's deadline in place:
  its envelope's field (at :data:`DEADLINE_AT`) and Redis' expiry together, only when the key
  holds a value with the envelope (it never creates a key).
* ``cap_ttl_command(key, deadline, px)`` — the same, only for a value whose deadline is later
  than ``deadline`` or none (a tenant's TTL lowered), and Redis' expiry only ever shortened.
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

from kvstore.errors import IntegrityError
from kvstore.keyring import KEY_ID_BYTES
from kvstore.keys import KEY_BYTES

#: The tier's envelope before each codec value (see the module docstring). Versions 1
#: (:data:`ENVELOPE_V1`, no key id) and 2 (:data:`ENVELOPE_V2`, no parent) are still read.
ENVELOPE = struct.Struct(f"<4sBB2xdd8s{KEY_BYTES}s")
ENVELOPE_V2 = struct.Struct("<4sB3xdd8s")
ENVELOPE_V1 = struct.Struct("<4sB3xdd")
ENVELOPE_MAGIC = b"KVRE"
ENVELOPE_VERSION = 3
#: flag bit of a version 3 envelope: the parent key is recorded
PARENT_RECORDED = 1
#: where the deadline sits in every version (``update_ttl_command`` rewrites it there)
DEADLINE_AT = 8
#: the key id of a value written without a data key (an unencrypted tier)
NO_KID = bytes(KEY_ID_BYTES)
_DEADLINE = struct.Struct("<d")
_NONE = float("nan")
_NO_PARENT = bytes(KEY_BYTES)

# Moves a block's deadline: its envelope's field and Redis' expiry, together, only when the key
# holds a value with the envelope (never creates a key). ARGV: magic, packed deadline, PX or ''.
_UPDATE_TTL = ("if redis.call('GETRANGE', KEYS[1], 0, 3) ~= ARGV[1] then return 0 end "
               f"redis.call('SETRANGE', KEYS[1], {DEADLINE_AT}, ARGV[2]) "
               "if ARGV[3] == '' then redis.call('PERSIST', KEYS[1]) "
               "else redis.call('PEXPIRE', KEYS[1], ARGV[3]) end return 1")

# Lowers a block's deadline to ARGV[2] (packed in ARGV[3]) when it is later or none (NaN ~= NaN):
# its envelope's field, and Redis' expiry to ARGV[4] ms unless it expires sooner already. ARGV:
# magic, the deadline as a number, packed, PX. Replies 1 when it moved, else 0.
_CAP_TTL = ("local h = redis.call('GETRANGE', KEYS[1], 0, 15) "
            "if string.len(h) < 16 or string.sub(h, 1, 4) ~= ARGV[1] then return 0 end "
            "local d = struct.unpack('<d', string.sub(h, 9, 16)) "
            "if d == d and d <= tonumber(ARGV[2]) then return 0 end "
            f"redis.call('SETRANGE', KEYS[1], {DEADLINE_AT}, ARGV[3]) "
            "local t = redis.call('PTTL', KEYS[1]) local px = tonumber(ARGV[4]) "
            "if t < 0 or t > px then redis.call('PEXPIRE', KEYS[1], px) end return 1")


class RemoteInfo(NamedTuple):
    """What a remote value says of its block: TTL deadline and creation time (None: none).
    ``known`` is False for a value written without the envelope (nothing known then).
    ``kid``: the id of the data key it was written under (None: not recorded). ``parent``: the
    key of the block's parent (``ROOT_KEY`` for a root; None: not recorded)."""

    deadline: float | None
    created: float | None
    known: bool = True
    kid: bytes | None = None
    parent: bytes | None = None


#: what a value without the envelope says
UNKNOWN = RemoteInfo(None, None, False)


def _opt(x: float | None) -> float:
    return _NONE if x is None else float(x)


def _unopt(x: float) -> float | None:
    return None if math.isnan(x) else x


def _enveloped(head: Any) -> bool:
    """Whether a value (or its first bytes) begins with an envelope of any version."""
    return len(head) >= ENVELOPE_V1.size and head[:4] == ENVELOPE_MAGIC


def pack_envelope(buf: Any, deadline: float | None, created: float | None, kid: bytes,
                  parent: bytes | None = None) -> None:
    """Write the envelope of a block (deadline and creation time, None: none; ``kid``: its data
    key's id, :data:`NO_KID` for none; ``parent``: its parent's key, None: not recorded) at the
    start of ``buf`` (:data:`ENVELOPE`.size bytes)."""
    ENVELOPE.pack_into(buf, 0, ENVELOPE_MAGIC, ENVELOPE_VERSION, 0 if parent is None else PARENT_RECORDED,
                       _opt(deadline), _opt(created), kid, _NO_PARENT if parent is None else parent)


def split_value(value: Any) -> tuple[Any, RemoteInfo]:
    """(codec value, what the envelope says) of one stored value."""
    mv = memoryview(value).cast("B")
    if not _enveloped(mv):
        return mv, UNKNOWN
    version = mv[4]
    if version == 1:
        _, _, deadline, created = ENVELOPE_V1.unpack_from(mv)
        return mv[ENVELOPE_V1.size:], RemoteInfo(_unopt(deadline), _unopt(created))
    if version == 2 and len(mv) >= ENVELOPE_V2.size:
        _, _, deadline, created, kid = ENVELOPE_V2.unpack_from(mv)
        return mv[ENVELOPE_V2.size:], RemoteInfo(_unopt(deadline), _unopt(created), True,
                                                 None if kid == NO_KID else kid)
    if version != ENVELOPE_VERSION or len(mv) < ENVELOPE.size:
        raise IntegrityError(f"remote value envelope version {version} is not {ENVELOPE_VERSION}")
    _, _, flags, deadline, created, kid, parent = ENVELOPE.unpack_from(mv)
    return mv[ENVELOPE.size:], RemoteInfo(_unopt(deadline), _unopt(created), True,
                                          None if kid == NO_KID else kid,
                                          parent if flags & PARENT_RECORDED else None)


def live_at(head: bytes, now: float) -> bool:
    """Whether the value that begins with ``head`` (at least its envelope's bytes, or all of it)
    is before its deadline at ``now``; True for a value without the envelope (nothing known)."""
    if not _enveloped(head):
        return True
    deadline = _unopt(_DEADLINE.unpack_from(head, DEADLINE_AT)[0])
    return deadline is None or now < deadline


def parent_of(head: Any) -> bytes | None:
    """The parent key recorded by the value that begins with ``head`` (at least its envelope's
    bytes, or all of it); None when it records none (an older envelope, or none)."""
    if not _enveloped(head) or head[4] != ENVELOPE_VERSION or len(head) < ENVELOPE.size:
        return None
    _, _, flags, _, _, _, parent = ENVELOPE.unpack_from(head)
    return bytes(parent) if flags & PARENT_RECORDED else None


def update_ttl_command(key: bytes, deadline: float | None, px: int | None) -> tuple[Any, ...]:
    """The command that sets the deadline of the value at ``key`` to ``deadline`` (None: none)
    and its Redis expiry to ``px`` ms (None: persistent), together; it replies 1, or 0 (nothing
    changed) when the key holds no value with the envelope."""
    return ("EVAL", _UPDATE_TTL, 1, key, ENVELOPE_MAGIC, _DEADLINE.pack(_opt(deadline)),
            "" if px is None else str(px))


def cap_ttl_command(key: bytes, deadline: float, px: int) -> tuple[Any, ...]:
    """The command that lowers the deadline of the value at ``key`` to ``deadline`` when it is
    later or none, and its Redis expiry to ``px`` ms (> 0) unless it expires sooner already; it
    replies 1 when it moved the deadline, 0 when not (or the key holds no value with the
    envelope: never one without it, nor a key it would create)."""
    return ("EVAL", _CAP_TTL, 1, key, ENVELOPE_MAGIC, repr(float(deadline)), _DEADLINE.pack(float(deadline)),
            str(px))


__all__ = ["DEADLINE_AT", "ENVELOPE", "ENVELOPE_MAGIC", "ENVELOPE_V1", "ENVELOPE_V2", "ENVELOPE_VERSION", "NO_KID",
           "PARENT_RECORDED", "UNKNOWN", "RemoteInfo", "cap_ttl_command", "live_at", "pack_envelope", "parent_of",
           "split_value", "update_ttl_command"]
