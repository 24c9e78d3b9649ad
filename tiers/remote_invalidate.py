"""Deletions shared by the servers of one Redis: a stream of what each delete and purge removed.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's config, namespace, lock and
counters, ``_tenant_hex`` (and its names, ``_th``), the keyring and the tenants' cached
tombstones (``_marks``), ``_multi`` of :mod:`tiers.remote_calls`, the accounting's
``_unheld_where`` and the writer's queue (``_cond``, ``_drop_queued``, ``_wait_writing``);
``_init_deletions(key)`` makes its state (``key``: from :func:`derive_deletions_key`, which
:meth:`RemoteTier.open` calls; a tier built without one neither publishes nor reads).

Several servers may share one Redis, each with its own local tiers. A ``delete`` on one of them
removes the blocks from its local tiers and from Redis, but the others' local copies would stay:
served there, and written to Redis again when they leave those servers' last local tier. So:

* ``_deletion_entries(tenant, keys, fingerprints)`` / ``_model_entry(fingerprint)`` /
  ``_tenant_entry(tenant)`` — the ``XADD`` commands (for ``_multi``) that record a deletion in the
  stream ``<namespace>:deletions`` (:mod:`tiers.remote_delete` sends them with the last step of
  ``delete_subtrees``, after ``purge_model``, and after ``purge_tenant``: the Store's
  ``drop_tenant``): the publishing server's id, the tenant's hash (what the Redis keys carry, never
  the name), the models and the keys of every block removed (roots and subtree; at most
  :data:`ENTRY_KEYS` keys and :data:`ENTRY_FINGERPRINTS` models per entry), or the model purged,
  or the tenant deleted. Each ``XADD`` trims the stream to about
  ``deletions_maxlen`` entries (``MAXLEN ~``). ``_published(replies)`` counts them: a publish that
  fails is logged and counted (``deletions_publish_failed``); the deletion itself stands, but
  the other servers keep their local copies (served there, and demoted to Redis again when
  evicted) until they expire: deleting again publishes again.
* Authentication: every entry carries ``mac``, an HMAC-SHA256 (:func:`entry_mac`) of all its
  other fields (format, origin, kind, tenant hash, fingerprints, keys; each length-prefixed,
  in a fixed order) under a key derived from the master key for this purpose and namespace
  only (:func:`derive_deletions_key`: HKDF-SHA256, info ``kvstore deletions v1``), which every
  server sharing the blocks holds. Anyone else who can write to the Redis can add entries
  (the stream is an ordinary key) but not make one a server applies: an entry without a MAC
  or with a wrong one (forged, altered, written by a server with another master key, or of
  format 1, before this: during a rolling upgrade old and new servers do not apply each
  other's) is never applied, counted ``deletions_unauthenticated`` and logged
  (the first, then one per :data:`_LOG_EVERY`). Parsing is strict and bounded
  (:func:`parse_entry`): exactly the signed fields and the MAC, bytes only, each within its
  size (at most :data:`ENTRY_KEYS` keys, :data:`ENTRY_FINGERPRINTS` models) before the MAC is
  computed, then the format, kind, hex ids and counts of its kind; anything else is counted
  ``deletions_malformed`` (logged likewise) and skipped, and the reader goes on. What the MAC
  does not stop: a writer of the Redis can replay an authentic entry (it repeats that
  deletion: the servers drop their local copies of those blocks again — lost cache, never
  other bytes), or delete or trim the stream (the deletions are missed, as below).
* ``on_deletion(apply, position=)`` — starts the reader: a thread that reads the stream
  (``XREAD BLOCK deletions_block_s``, on a connection of its own) from the last entry it has seen
  (at the first start: the stream's end, as ``$``; with ``position``, a file, from the entry
  recorded there, so a server that was down applies what was deleted meanwhile while the stream
  still holds it: before ``on_deletion`` returns, for up to :data:`CATCH_UP_S`, so the restarted
  server serves none of it; a trim past the position is told by the stream's
  ``max-deleted-entry-id``). For each authenticated entry of another server it cancels this server's
  queued demotions of the blocks (and of blocks queued under them; for a tenant, every one of
  the tenant, whose cached data key and tombstone are forgotten too, so the next write re-reads
  them from Redis and is refused), forgets them in the accounting, then calls
  ``apply(deletion)`` (the Store drops its local copies; returns how many; of a tenant, every
  block of it and nothing else: its sessions and rules there stay, and a server that holds no
  block of it drops nothing) and cancels once more
  (demotions queued meanwhile). In Redis it deletes only what this server itself wrote there
  recently of what the entry covers (``delete_rewritten``, below; the rest the publisher
  deleted), and it never raises: a fault is counted (``deletions_read_errors``) and retried with
  backoff (the breaker's base and cap), a failing ``apply`` is logged and counted
  (``deletions_apply_errors``).
* ``rewritten_tenants(d)`` / ``delete_rewritten(d, local)`` — what the Store's ``apply`` calls
  once its local part is done, with the writer's filter for the deletion held and a matching
  write in flight waited for: this server's demotions that landed in Redis after the other
  server's deletion and before this entry was read (the writer records every write it
  completed, :class:`~tiers.remote_writer.RecentWrites`, for ``rewrite_window_s``, at most
  ``rewrite_window_blocks``) are checked (one ``EXISTS`` round trip) and the ones still there
  deleted with their Redis subtrees (``delete_subtrees``: children sets too), counted
  ``deletions_rewritten``; that deletion is published (the servers that read one meanwhile drop
  it) only when a value was found, so an entry never echoes. A Redis fault meanwhile is
  counted (``deletions_rewritten_failed``, blocks) and logged; those copies stay until they
  expire.
* ``stop_deletions()`` — stops the reader promptly (its connection is shut down, so a read blocked
  on a paused Redis ends at once); :meth:`RemoteTier.close` calls it first.

What remains open: a server that cannot read the stream (Redis down, or trimmed past its
position) misses those deletions (counted ``deletions_missed`` when a trim past the saved
position is seen at open): its local copies stay until they expire or are evicted, and may then
be written back to Redis. The window between the removal of a block's value from Redis and the
moment another server cancels its demotions (one round trip of the deleting server, then the
delivery of the entry: measured on loopback, 2-core VM, 300 deletions, the reader cancelled
them 0.1 ms before the publisher had the ``XADD`` reply (median), 0.6 ms after it at p99) is
closed afterwards by ``delete_rewritten``, as long as the entry is applied within
``rewrite_window_s`` of the write (and fewer than ``rewrite_window_blocks`` writes came after
it): a server whose reader is stalled longer (Redis unreachable) leaves its write there until it
expires; and a third server that read the block from Redis in the instant between the rewrite
and its deletion serves it until it applies the entry that deletion publishes (about a
millisecond more). Closing it at the
source needs the demotion's ``SET`` to check a per-block marker the deletion leaves, atomically
(a script in :mod:`tiers.remote_put`), which is not done.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from redis.backoff import EqualJitterBackoff
from redis.exceptions import ResponseError

from kvstore.codec_format import TENANT_HASH_BYTES
from kvstore.errors import Unavailable
from kvstore.keys import KEY_BYTES
from kvstore.spec import FINGERPRINT_BYTES
from tiers.remote_calls import FAULTS, Command, succeeded
from tiers.remote_redis import connect

log = logging.getLogger(__name__)

#: block keys in one stream entry at most (32 bytes each: 128 KiB); a bigger deletion is several
ENTRY_KEYS = 4096
#: model fingerprints in one stream entry at most (16 bytes each: 64 KiB)
ENTRY_FINGERPRINTS = 4096
#: bytes of an entry's MAC (HMAC-SHA256)
MAC_BYTES = 32
_FORMAT = b"2"  # 1: no MAC (refused: unauthenticated)
_KDF_INFO = b"kvstore deletions v1"  # HKDF info of the MAC key, with the namespace
#: the signed fields of an entry, in the order the MAC covers them; each at most this long
_FIELDS: dict[bytes, int] = {
    b"v": 8, b"origin": 64, b"kind": 16, b"tenant": 2 * TENANT_HASH_BYTES,
    b"fps": ENTRY_FINGERPRINTS * FINGERPRINT_BYTES, b"keys": ENTRY_KEYS * KEY_BYTES}
_MAC = b"mac"
_KINDS: dict[bytes, Literal["subtree", "model", "tenant"]] = {
    b"subtree": "subtree", b"model": "model", b"tenant": "tenant"}
_HEX_ORIGIN = re.compile(rb"[0-9a-f]{1,64}")
_HEX_TENANT = re.compile(rb"[0-9a-f]{%d}" % (2 * TENANT_HASH_BYTES))
_READ_COUNT = 64  # entries per XREAD
#: seconds an open spends applying what was deleted while the server was down, at most
CATCH_UP_S = 30.0
_LOG_EVERY = 1000  # a refused entry is logged the first time, then once per this many
#: a position file: ``<namespace> <entry id>`` and a newline (without it: torn)
_POSITION = re.compile(rb"(\S+) ([0-9]{1,20}-[0-9]{1,20})\n")


class Deletion(NamedTuple):
    """One entry of the deletions stream: what another server deleted."""

    id: str
    """The entry's stream id (``<ms>-<seq>``, Redis' clock)."""
    origin: str
    """The id of the server that deleted (a fresh one per :class:`RemoteTier`)."""
    kind: Literal["subtree", "model", "tenant"]
    """``subtree``: the blocks ``keys`` of one tenant with everything under them;
    ``model``: every block of ``fingerprints[0]``, all tenants; ``tenant``: every block of the
    tenant (its ``drop_tenant``)."""
    tenant: str
    """Hex of the tenant's hash (:func:`kvstore.codec.tenant_hash`); empty for a model."""
    keys: frozenset[bytes]
    """The keys of the blocks removed (roots and subtree); empty for a model or a tenant."""
    fingerprints: tuple[bytes, ...]
    """The models whose blocks were removed (empty for a tenant)."""


#: what the Store registers: drops its local copies of a deletion; returns how many blocks
Apply = Callable[[Deletion], int]


class Malformed(ValueError):
    """A stream entry that is not one of this format (counted ``deletions_malformed``)."""


class Unauthenticated(ValueError):
    """A stream entry without a MAC, or whose MAC is not the one of its fields under this
    server's key (counted ``deletions_unauthenticated``): never applied."""


def derive_deletions_key(master_key: bytes, namespace: str) -> bytes:
    """The key that authenticates the deletions stream of ``namespace``: HKDF-SHA256 of the
    master key, for this purpose only (info ``kvstore deletions v1``, NUL, the namespace), so
    it says nothing of the master key or the data keys it wraps, and an entry of one
    namespace does not verify in another."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=_KDF_INFO + b"\x00" + namespace.encode()).derive(bytes(master_key))


def entry_mac(key: bytes, fields: Mapping[bytes, bytes]) -> bytes:
    """HMAC-SHA256 under ``key`` of the signed fields of an entry (every one of
    :data:`_FIELDS`, in that order, each name and value prefixed by its length: 4 bytes,
    big-endian), so no two different entries sign the same bytes."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for name in _FIELDS:
        value = fields[name]
        mac.update(len(name).to_bytes(4, "big") + name + len(value).to_bytes(4, "big"))
        mac.update(value)
    return mac.digest()


def _split(raw: bytes, size: int, what: str) -> list[bytes]:
    if len(raw) % size:
        raise Malformed(f"{what}: {len(raw)} bytes is not a multiple of {size}")
    return [raw[i:i + size] for i in range(0, len(raw), size)]


def _fields(fields: Any) -> dict[bytes, bytes]:
    """The fields of an entry as Redis returned them: at most the signed ones and the MAC,
    names and values bytes; Malformed otherwise."""
    if not isinstance(fields, dict):
        raise Malformed(f"fields are a {type(fields).__name__}, not a map")
    if len(fields) > len(_FIELDS) + 1:
        raise Malformed(f"{len(fields)} fields")
    if not all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in fields.items()):
        raise Malformed("a field name or value that is not bytes")
    return fields


def parse_entry(entry_id: Any, fields: Any, key: bytes) -> Deletion:
    """The :class:`Deletion` of one stream entry, authenticated with ``key`` (from
    :func:`derive_deletions_key`). Raises :class:`Unauthenticated` when its MAC is missing or
    wrong, :class:`Malformed` when it is not an entry of this format (the field set, types,
    sizes and counts are checked before the MAC is computed: an entry costs at most
    :data:`ENTRY_KEYS` keys' hashing); nothing else."""
    f = _fields(fields)
    mac = f.get(_MAC)
    if mac is None:
        raise Unauthenticated("no MAC")
    if f.keys() != {*_FIELDS, _MAC}:
        raise Malformed(f"fields {sorted(f)!r}")
    for name, most in _FIELDS.items():
        if len(f[name]) > most:
            raise Malformed(f"{name.decode()}: {len(f[name])} bytes (at most {most})")
    if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, entry_mac(key, f)):
        raise Unauthenticated("wrong MAC")
    if f[b"v"] != _FORMAT:
        raise Malformed(f"unknown format {f[b'v']!r}")
    kind = _KINDS.get(f[b"kind"])
    if kind is None:
        raise Malformed(f"unknown kind {f[b'kind']!r}")
    if not _HEX_ORIGIN.fullmatch(f[b"origin"]):
        raise Malformed("origin is not a server id")
    tenant, fps = f[b"tenant"], _split(f[b"fps"], FINGERPRINT_BYTES, "fingerprints")
    keys = _split(f[b"keys"], KEY_BYTES, "keys")
    if kind == "model":
        if tenant or keys or len(fps) != 1:
            raise Malformed("a model purge names one fingerprint, no tenant and no keys")
    elif not _HEX_TENANT.fullmatch(tenant):
        raise Malformed(f"a {kind} deletion names its tenant's hash")
    elif kind == "tenant" and (keys or fps):
        raise Malformed("a tenant deletion names no keys and no models")
    return Deletion(_text(entry_id), f[b"origin"].decode(), kind, tenant.decode(), frozenset(keys),
                    tuple(fps))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _entries(reply: Any) -> list[tuple[Any, dict[Any, Any]]]:
    """The ``(id, fields)`` of an ``XREAD`` reply of one stream (RESP2 list or RESP3 map)."""
    if not reply:
        return []
    per = reply.values() if isinstance(reply, dict) else [es for _, es in reply]
    return [(e[0], e[1]) for es in per for e in es]


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class SharedDeletions:
    """RemoteTier methods of the deletions stream (see the module docstring)."""

    def _init_deletions(self, key: bytes | None) -> None:
        self._stream = f"{self._ns}:deletions"
        self._origin = uuid.uuid4().hex
        self._deletions_key = key  # NOTE: a secret: never logged
        self._apply: Apply | None = None
        self._reader: threading.Thread | None = None
        self._reader_client: Any = None
        self._reader_stop = threading.Event()
        self._position: Path | None = None
        self._last_id: str | None = None  # the last entry read (None: not positioned yet)
        self._open_end: str | None = None  # the stream's last entry when the reader was positioned
        self._rewrite_failures = 0  # delete_rewritten calls that could not reach Redis

    # -- publishing -----------------------------------------------------------------------------
    def _sharing(self) -> bool:
        """Whether deletions are shared: ``share_deletions``, and a key to authenticate them
        (a tier built without :meth:`RemoteTier.open` has none: it neither publishes nor reads)."""
        return self.config.share_deletions and self._deletions_key is not None

    def _xadd(self, kind: bytes, tenant: bytes = b"", fps: bytes = b"", keys: bytes = b"") -> Command:
        assert self._deletions_key is not None
        f = {b"v": _FORMAT, b"origin": self._origin.encode(), b"kind": kind, b"tenant": tenant,
             b"fps": fps, b"keys": keys}
        mac = entry_mac(self._deletions_key, f)
        return (self._stream, ("XADD", self._stream, "MAXLEN", "~", self.config.deletions_maxlen,
                               "*", *(x for kv in f.items() for x in kv), _MAC, mac))

    def _deletion_entries(self, tenant: str, keys: Iterable[bytes],
                          fingerprints: Iterable[bytes]) -> list[Command]:
        """The commands that record the deletion of the blocks ``keys`` of ``tenant`` (of the
        models ``fingerprints``) in the stream; none when sharing is off or no key is deleted."""
        if not self._sharing():
            return []
        keys = list(dict.fromkeys(keys))
        fps = list(dict.fromkeys(fingerprints))
        if not keys:
            return []
        th = self._tenant_hex(tenant).encode()
        n = max(math.ceil(len(keys) / ENTRY_KEYS), math.ceil(len(fps) / ENTRY_FINGERPRINTS))
        return [self._xadd(b"subtree", th, b"".join(fps[i * ENTRY_FINGERPRINTS:(i + 1) * ENTRY_FINGERPRINTS]),
                           b"".join(keys[i * ENTRY_KEYS:(i + 1) * ENTRY_KEYS]))
                for i in range(n)]

    def _model_entry(self, fingerprint: bytes) -> list[Command]:
        """The command that records the purge of the model ``fingerprint``."""
        if not self._sharing():
            return []
        return [self._xadd(b"model", fps=fingerprint)]

    def _tenant_entry(self, tenant: str) -> list[Command]:
        """The command that records the deletion of ``tenant`` (every block of it)."""
        if not self._sharing():
            return []
        return [self._xadd(b"tenant", self._tenant_hex(tenant).encode())]

    def _published(self, replies: Sequence[Any]) -> None:
        """Count the replies of the ``XADD`` commands; log one that failed."""
        bad = [r for r in replies if not succeeded(r)]
        if len(replies) > len(bad):
            self._count("deletions_published", len(replies) - len(bad))
        if bad:
            self._count("deletions_publish_failed", len(bad))
            log.warning("a deletion succeeded but could not be published to the other servers "
                        "(%s): their local copies stay until they expire or are evicted", bad[0])

    # -- the reader -----------------------------------------------------------------------------
    def on_deletion(self, apply: Apply, *, position: Path | None = None) -> None:
        """Start reading the other servers' deletions and hand each to ``apply`` (from the
        reader thread). ``position``: a file that keeps the last entry read across restarts.
        Nothing when ``share_deletions`` is off (or the tier has no key to authenticate the
        entries: built without :meth:`RemoteTier.open`); once only."""
        if not self._sharing() or self._reader is not None:
            return
        self._apply = apply
        self._position = position
        cfg = self.config
        # its own connection: a read blocks for deletions_block_s, and close() shuts it down
        self._reader_client = connect(cfg.model_copy(update={
            "op_timeout_s": cfg.deletions_block_s + cfg.op_timeout_s, "retries": 0}))
        try:
            self._positioned()
            self._catch_up()
        except FAULTS as exc:  # positioned by the reader once Redis answers
            self._count("deletions_read_errors")
            log.warning("deletions stream %s unreadable at open (%s): the reader applies the "
                        "deletions made meanwhile once it answers (from the saved position; without "
                        "one, those made until then are missed)", self._stream, exc)
        self._reader = threading.Thread(target=self._read_loop, name="kvstore-remote-deletions",
                                        daemon=True)
        self._reader.start()

    def _positioned(self) -> None:
        """Set (and save) where reading starts. Redis faults propagate."""
        self._last_id = self._start_id()
        self._save_id(self._last_id)

    def _catch_up(self) -> None:
        """Apply, before :meth:`on_deletion` returns, the entries written since the saved
        position up to the stream's end as it is now (for at most :data:`CATCH_UP_S`; the
        reader goes on from there). Why: a restarted server opened and served blocks deleted
        while it was down until its reader thread got to them (a get 13 ms after the open
        served all three of a chain whose entry was the 301st of the backlog). Redis faults
        propagate."""
        end = self._open_end
        if end is None or _id_tuple(self._last_id) >= _id_tuple(end):
            return
        until = time.monotonic() + CATCH_UP_S
        while _id_tuple(self._last_id) < _id_tuple(end) and time.monotonic() < until:
            entries = _entries(self._reader_client.xread({self._stream: self._last_id}, count=_READ_COUNT))
            if not entries:
                break
            for entry_id, fields in entries:
                self._take(entry_id, fields)
            self._save_id(self._last_id)
        if _id_tuple(self._last_id) < _id_tuple(end):
            log.warning("deletions stream %s: %s s were not enough to apply what was deleted while this "
                        "server was down; the reader goes on", self._stream, CATCH_UP_S)

    def _start_id(self) -> str:
        """Where reading starts: the entry the position file names, when the stream still goes
        back that far and holds it, else the stream's end. Redis faults propagate."""
        try:
            info = self._reader_client.xinfo_stream(self._stream)
        except ResponseError as exc:
            if "no such key" not in str(exc).lower():
                raise
            info = {}
        end = _text(info.get("last-generated-id", b"0-0"))
        self._open_end = end
        saved = self._saved_id()
        if saved is None:
            return end
        if _id_tuple(saved) > _id_tuple(end):  # not this stream any more (a flush, a new Redis)
            log.warning("deletions stream %s is behind the position saved in %s: reading from its end",
                        self._stream, self._position)
            return end
        # NOTE: the newest entry trimmed (Redis 7): any first entry is past a position saved
        # when the stream was empty ("0-0"), and that was counted as missed
        trimmed = info.get("max-deleted-entry-id")
        if trimmed is None:  # an older server: the first entry left, approximately
            first = info.get("recorded-first-entry-id") or (info.get("first-entry") or (None,))[0]
            trimmed = None if first is None or saved == "0-0" else _text(first)
            missed = trimmed is not None and _id_tuple(trimmed) > _id_tuple(saved)
        else:
            missed = _id_tuple(_text(trimmed)) > _id_tuple(saved)
        if missed:
            self._count("deletions_missed")
            log.warning("deletions stream %s was trimmed past this server's position (%s): "
                        "deletions made while it was down may be missed (raise deletions_maxlen)",
                        self._stream, saved)
        return saved

    def _saved_id(self) -> str | None:
        """The entry the position file names: None when there is none to read (no file: the
        first start; a file of another namespace), ``"0-0"`` (the stream's start) when the file
        is there but unreadable, empty or torn (counted ``deletions_position_unknown``, logged).

        NOTE: an unreadable position read as none made the server start from the stream's end
        and skip, silently, every deletion made while it was down (a deleted tenant's blocks
        then served from its NVMe); applying the whole retained stream again is safe (a
        deletion applied twice removes nothing more) and costs at most some local cache."""
        if self._position is None:
            return None
        try:
            text = self._position.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._position_unknown(f"unreadable ({exc})")
        m = _POSITION.fullmatch(text)
        if m is None:
            return self._position_unknown(f"empty or torn ({len(text)} bytes)")
        if m[1].decode() != self._ns:
            return None
        return m[2].decode()

    def _position_unknown(self, why: str) -> str:
        self._count("deletions_position_unknown")
        log.warning("deletions stream position in %s is %s: applying every deletion the stream %s still "
                    "holds, from its start (what it no longer holds may be missed)",
                    self._position, why, self._stream)
        return "0-0"

    def _save_id(self, entry_id: str) -> None:
        """Write the position atomically and durably: a temporary file, fsynced, renamed over
        the position, then its directory fsynced. NOTE: written without fsync, a power loss
        could leave the position empty or torn (see :meth:`_saved_id`)."""
        if self._position is None:
            return
        tmp = self._position.with_name(self._position.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, f"{self._ns} {entry_id}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._position)
            dir_fd = os.open(self._position.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            log.warning("could not save the deletions stream position in %s: %s", self._position, exc)

    def _read_loop(self) -> None:
        cfg = self.config
        backoff = EqualJitterBackoff(cap=cfg.breaker_cap_s, base=cfg.breaker_base_s)
        fails = 0
        block_ms = max(1, int(cfg.deletions_block_s * 1000))
        while not self._reader_stop.is_set():
            try:
                if self._last_id is None:
                    self._positioned()
                reply = self._reader_client.xread({self._stream: self._last_id},
                                                  count=_READ_COUNT, block=block_ms)
            except FAULTS as exc:
                if self._reader_stop.is_set():
                    return
                fails += 1
                self._count("deletions_read_errors")
                if fails == 1:
                    log.warning("deletions stream %s unreadable (%s): retrying", self._stream, exc)
                self._reader_stop.wait(backoff.compute(fails))
                continue
            except Exception:  # NOTE: logged and counted; the reader must outlive it
                if self._reader_stop.is_set():
                    return  # NOTE: the stop closed the client under the read (redis-py: TypeError)
                self._count("deletions_read_errors")
                log.exception("reading the deletions stream %s failed", self._stream)
                self._reader_stop.wait(cfg.breaker_cap_s)
                continue
            if fails:
                log.info("deletions stream %s readable again", self._stream)
            fails = 0
            try:
                entries = _entries(reply)
            except (TypeError, ValueError, IndexError, AttributeError) as exc:  # not a reply of XREAD
                self._count("deletions_read_errors")
                log.warning("deletions stream %s: a reply that is not one of XREAD (%s)", self._stream, exc)
                self._reader_stop.wait(cfg.breaker_cap_s)
                continue
            for entry_id, fields in entries:
                self._take(entry_id, fields)
            if entries:
                self._save_id(self._last_id)

    def _take(self, entry_id: Any, fields: dict[Any, Any]) -> None:
        """Apply one entry (never raises); the reader's position moves past it."""
        eid = self._last_id = _text(entry_id)
        assert self._deletions_key is not None
        try:
            d = parse_entry(eid, fields, self._deletions_key)
        except Unauthenticated as exc:
            self._refused("deletions_unauthenticated", eid, f"{exc}: not written by a server with "
                          f"this master key (another writer of the Redis?)")
            return
        except Malformed as exc:
            self._refused("deletions_malformed", eid, str(exc))
            return
        if d.origin == self._origin:
            self._count("deletions_own")
            return
        try:
            cancelled = self._cancel_deleted(d)
            dropped = self._apply(d) if self._apply is not None else 0
            cancelled += self._cancel_deleted(d)  # queued while the Store dropped them
        except Exception:  # NOTE: logged and counted; the reader must outlive it
            self._count("deletions_apply_errors")
            log.exception("deletions stream %s: entry %s could not be applied", self._stream, eid)
            return
        self._count("deletions_applied")
        self._count("deletions_blocks_dropped", dropped)
        self._count("deletions_demotions_cancelled", cancelled)

    def _refused(self, counter: str, eid: str, why: str) -> None:
        """Count an entry not applied; log the first one, then one per :data:`_LOG_EVERY`."""
        with self._lock:
            self._counts[counter] += 1
            n = self._counts[counter]
        if n == 1 or n % _LOG_EVERY == 0:
            log.warning("deletions stream %s: entry %s not applied (%s); %d so far (%s)",
                        self._stream, eid, why, n, counter)

    def _cancel_deleted(self, d: Deletion) -> int:
        """Cancel this server's queued demotions (and the one being written: it is unlinked
        once written) of what ``d`` deleted, and forget those blocks in the accounting."""
        if d.kind == "model":
            fps = set(d.fingerprints)

            def hit(job: Any) -> bool:
                return job.ref.spec.fingerprint in fps
        elif d.kind == "tenant":
            self._forget_tenant_keys(d.tenant)

            def hit(job: Any) -> bool:
                return self._tenant_hex(job.ref.tenant) == d.tenant
        else:
            doomed = set(d.keys)

            def hit(job: Any) -> bool:
                if self._tenant_hex(job.ref.tenant) != d.tenant:
                    return False
                if job.ref.key in doomed or job.parent in doomed:
                    doomed.add(job.ref.key)  # so is what was queued under it
                    return True
                return False
        with self._cond:
            n = 0
            while True:  # a child queued before its parent is found once its parent is
                jobs = self._drop_queued(hit)
                n += len(jobs)
                if not jobs:
                    break
            n += self._wait_writing(hit)
            self._cond.notify_all()
        with self._lock:
            if d.kind == "model":
                self._unheld_where(lambda _, h: h.fingerprint in fps)
            elif d.kind == "tenant":
                self._unheld_where(lambda ident, _: self._tenant_hex(ident[0]) == d.tenant)
            else:
                self._unheld_where(lambda ident, _: ident[1] in doomed
                                   and self._tenant_hex(ident[0]) == d.tenant)
        return n

    # -- this server's writes that landed after another server's deletion ----------------------
    def rewritten_tenants(self, d: Deletion) -> set[str]:
        """The tenants whose writes this server's writer completed in the last
        ``rewrite_window_s`` (:class:`~tiers.remote_writer.RecentWrites`) that ``d`` may cover:
        of ``d.tenant``'s hash, or any for a model. The caller holds the writer's filter of
        each (with those it holds blocks of) while it applies ``d``."""
        names = self._recent.tenants()
        if d.kind == "model":
            return names
        return {t for t in names if self._tenant_hex(t) == d.tenant}

    def delete_rewritten(self, d: Deletion, local: Mapping[str, Iterable[bytes]]) -> dict[str, set[bytes]]:
        """Delete from Redis this server's recent writes (the last ``rewrite_window_s``) of what
        another server's deletion ``d`` removed: for blocks, those of ``d.keys`` and of
        ``local[tenant]`` (the local subtree the Store dropped), under any model, and the ones
        recorded under them; for a model or a tenant, every one of it. Why: the other server
        deleted the copies in Redis, but a demotion this server wrote before it read the entry
        (its queue, then its writer) put the block back, served to every server from then on.
        A write that landed before the deletion was deleted by it: deleting it again finds
        nothing. Through :meth:`delete_subtrees` (with their Redis subtrees and children
        sets); the deletion is published only when a value was found (counted
        ``deletions_rewritten``), so the servers that read the block meanwhile drop it too.

        Call it from the reader (never under the Store's lock: round trips) with the writer's
        filter for ``d`` held and a write it matches in flight waited for, so no write is
        missed. Returns, per tenant, the keys of the blocks removed: the Store drops the
        local copies a get promoted from the rewritten ones meanwhile. Never raises on a Redis
        fault: counted ``deletions_rewritten_failed`` (blocks) and logged; those copies stay
        until they expire."""
        if d.kind == "model":
            fp = d.fingerprints[0]
            writes = self._recent.where(lambda w: w.fingerprint == fp)
        elif d.kind == "tenant":
            writes = self._recent.where(lambda w: self._tenant_hex(w.tenant) == d.tenant)
        else:
            writes = [w for t in self.rewritten_tenants(d)
                      for w in self._recent.under(t, [*d.keys, *local.get(t, ())])]
        roots: dict[str, dict[tuple[bytes, bytes], None]] = {}
        for w in writes:
            roots.setdefault(w.tenant, {})[(w.key, w.fingerprint)] = None
        out: dict[str, set[bytes]] = {}
        for tenant, blocks in roots.items():
            try:
                there = self._still_there(tenant, list(blocks))
                if not there:
                    continue
                gone, unlinked = self._delete_subtrees(tenant, there, None, publish_unfound=False)
            except (Unavailable, *FAULTS) as exc:  # NOTE: the reader must outlive it
                self._rewrite_failed(len(blocks), d.id, exc)
                continue
            if unlinked:
                self._count("deletions_rewritten", len(unlinked))
            if gone:
                out[tenant] = gone
        return out

    def _still_there(self, tenant: str, blocks: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The blocks ``(key, fingerprint)`` of ``tenant`` that have a value in Redis (one
        pipelined ``EXISTS`` round trip); the others are forgotten (written before the
        deletion, which removed them). Why first: most recent writes of a deleted block went
        before the deletion, and a :meth:`delete_subtrees` of them costs a round trip per level
        and two more. Raises Unavailable when one cannot be read."""
        replies = self._checked(self._batch("EXISTS", [self._value_key(tenant, fp, k) for k, fp in blocks]),
                                len(blocks), "remote copies could not be checked")
        self._recent.forget(tenant, [b for b, r in zip(blocks, replies) if not r])
        return [b for b, r in zip(blocks, replies) if r]

    def _rewrite_failed(self, n: int, eid: str, exc: BaseException) -> None:
        """Count ``n`` rewritten blocks not deleted; log the first failure, then one per
        :data:`_LOG_EVERY`."""
        with self._lock:
            self._counts["deletions_rewritten_failed"] += n
            self._rewrite_failures += 1
            failures = self._rewrite_failures
        if failures == 1 or failures % _LOG_EVERY == 0:
            log.warning("deletions stream %s: entry %s: %d blocks this server wrote after the deletion "
                        "could not be deleted from Redis (%s); they stay until they expire (%d failures "
                        "so far)", self._stream, eid, n, exc, failures)

    def _forget_tenant_keys(self, th: str) -> None:
        """Forget the cached data key and tombstone of every tenant whose hash is ``th``: the
        next use reads them from Redis (the key destroyed, the tombstone there), so no write of
        its older blocks is admitted on the cached copies. The names come from those caches
        themselves (the tier's name-to-hash cache is cleared past 4,096 names, and a key cached
        before that was kept)."""
        with self._lock:
            names = set(self._marks)
        if self._keyring is not None:
            names.update(self._keyring.cached_tenants())
        for tenant in [t for t in names if self._tenant_hex(t) == th]:
            if self._keyring is not None:
                self._keyring.forget(tenant)
            with self._lock:
                self._marks.pop(tenant, None)

    def stop_deletions(self) -> None:
        """Stop the reader and wait for it: its connection is shut down, so a read blocked on a
        paused Redis ends at once. An ``apply`` running now is waited for, up to one write's
        timeouts (the Store calls this before it takes its lock to close). Idempotent."""
        self._reader_stop.set()
        if self._reader_client is not None:
            self._reader_client.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=self._one_write_s())
            if self._reader.is_alive():  # it connected again just before the stop
                self._reader_client.close()
                self._reader.join(timeout=1.0)


__all__ = ["ENTRY_FINGERPRINTS", "ENTRY_KEYS", "MAC_BYTES", "Apply", "Deletion", "Malformed", "SharedDeletions",
           "Unauthenticated", "derive_deletions_key", "entry_mac", "parse_entry"]
