"""Deletions shared by the servers of one Redis: a stream of what each delete and purge removed.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's config, namespace, lock and
counters, ``_tenant_hex``, ``_multi`` of :mod:`tiers.remote_calls`, the accounting's
``_unheld_where`` and the writer's queue (``_cond``, ``_drop_queued``, ``_wait_writing``);
``_init_deletions`` makes its state.

Several servers may share one Redis, each with its own local tiers. A ``delete`` on one of them
removes the blocks from its local tiers and from Redis, but the others' local copies would stay:
served there, and written to Redis again when they leave those servers' last local tier. So:

* ``_deletion_entries(tenant, keys, fingerprints)`` / ``_model_entry(fingerprint)`` — the
  ``XADD`` commands (for ``_multi``) that record a deletion in the stream ``<namespace>:deletions``
  (:mod:`tiers.remote_delete` sends them with the last step of ``delete_subtrees``, and after
  ``purge_model``): the publishing server's id, the tenant's hash (what the Redis keys carry, never
  the name), the models and the keys of every block removed (roots and subtree; at most
  :data:`ENTRY_KEYS` per entry), or the model purged. Each ``XADD`` trims the stream to about
  ``deletions_maxlen`` entries (``MAXLEN ~``). ``_published(replies)`` counts them: a publish that
  fails is logged and counted (``deletions_publish_failed``); the deletion itself stands, but
  the other servers keep their local copies (served there, and demoted to Redis again when
  evicted) until they expire: deleting again publishes again.
* ``on_deletion(apply, position=)`` — starts the reader: a thread that reads the stream
  (``XREAD BLOCK deletions_block_s``, on a connection of its own) from the last entry it has seen
  (at the first start: the stream's end, as ``$``; with ``position``, a file, from the entry
  recorded there, so a server that was down applies what was deleted meanwhile while the stream
  still holds it). For each entry of another server it cancels this server's queued demotions of
  the blocks (and of blocks queued under them), forgets them in the accounting, then calls
  ``apply(deletion)`` (the Store drops its local copies; returns how many) and cancels once more
  (demotions queued meanwhile). It never deletes anything in Redis (the publisher did) and never
  raises: a fault is counted (``deletions_read_errors``) and retried with backoff (the breaker's
  base and cap), a failing ``apply`` is logged and counted (``deletions_apply_errors``).
* ``stop_deletions()`` — stops the reader promptly (its connection is shut down, so a read blocked
  on a paused Redis ends at once); :meth:`RemoteTier.close` calls it first.

What remains open: a server that cannot read the stream (Redis down, or trimmed past its
position) misses those deletions (counted ``deletions_missed`` when a trim past the saved
position is seen at open): its local copies stay until they expire or are evicted, and may then
be written back to Redis. And a window: a demotion another server writes between the removal of
the block's value from Redis and the moment that server cancels it (one round trip of the
deleting server, then the delivery of the entry; for a block it evicts from its last local tier
meanwhile, also the wait for its Store's lock) brings the block back. Measured on loopback
(2-core VM, 300 deletions): the reader cancelled the queued demotions 0.1 ms before the
publisher had the ``XADD`` reply (median), 0.6 ms after it at p99, 0.8 ms at most; one round
trip is 0.08 ms. Closing it needs the demotion's ``SET`` to check a per-block marker the deletion
leaves, atomically (a script in :mod:`tiers.remote_put`), which is not done.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from redis.backoff import EqualJitterBackoff
from redis.exceptions import ResponseError

from kvstore.keys import KEY_BYTES
from kvstore.spec import FINGERPRINT_BYTES
from tiers.remote_calls import FAULTS, Command, succeeded
from tiers.remote_redis import connect

log = logging.getLogger(__name__)

#: block keys in one stream entry at most (32 bytes each: 128 KiB); a bigger deletion is several
ENTRY_KEYS = 4096
_FORMAT = b"1"
_READ_COUNT = 64  # entries per XREAD


class Deletion(NamedTuple):
    """One entry of the deletions stream: what another server deleted."""

    id: str
    """The entry's stream id (``<ms>-<seq>``, Redis' clock)."""
    origin: str
    """The id of the server that deleted (a fresh one per :class:`RemoteTier`)."""
    kind: Literal["subtree", "model"]
    """``subtree``: the blocks ``keys`` of one tenant with everything under them;
    ``model``: every block of ``fingerprints[0]``, all tenants."""
    tenant: str
    """Hex of the tenant's hash (:func:`kvstore.codec.tenant_hash`); empty for a model."""
    keys: frozenset[bytes]
    """The keys of the blocks removed (roots and subtree); empty for a model."""
    fingerprints: tuple[bytes, ...]
    """The models whose blocks were removed."""


#: what the Store registers: drops its local copies of a deletion; returns how many blocks
Apply = Callable[[Deletion], int]


def _split(raw: bytes, size: int, what: str) -> list[bytes]:
    if len(raw) % size:
        raise ValueError(f"{what}: {len(raw)} bytes is not a multiple of {size}")
    return [raw[i:i + size] for i in range(0, len(raw), size)]


def parse_entry(entry_id: Any, fields: dict[Any, Any]) -> Deletion:
    """The :class:`Deletion` of one stream entry; ValueError when it is not one."""
    f = {bytes(k) if not isinstance(k, str) else k.encode(): v for k, v in fields.items()}
    if f.get(b"v") != _FORMAT:
        raise ValueError(f"unknown format {f.get(b'v')!r}")
    kind = f.get(b"kind")
    fps = _split(f.get(b"fps", b""), FINGERPRINT_BYTES, "fingerprints")
    eid = _text(entry_id)
    origin = bytes(f.get(b"origin", b"")).decode()
    if kind == b"model":
        if len(fps) != 1:
            raise ValueError("a model purge names one fingerprint")
        return Deletion(eid, origin, "model", "", frozenset(), tuple(fps))
    if kind != b"subtree":
        raise ValueError(f"unknown kind {kind!r}")
    tenant = bytes(f.get(b"tenant", b"")).decode()
    if not tenant:
        raise ValueError("a subtree deletion names its tenant")
    keys = frozenset(_split(f.get(b"keys", b""), KEY_BYTES, "keys"))
    return Deletion(eid, origin, "subtree", tenant, keys, tuple(fps))


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

    def _init_deletions(self) -> None:
        self._stream = f"{self._ns}:deletions"
        self._origin = uuid.uuid4().hex
        self._apply: Apply | None = None
        self._reader: threading.Thread | None = None
        self._reader_client: Any = None
        self._reader_stop = threading.Event()
        self._position: Path | None = None
        self._last_id: str | None = None  # the last entry read (None: not positioned yet)

    # -- publishing -----------------------------------------------------------------------------
    def _xadd(self, fields: list[bytes | str]) -> Command:
        return (self._stream, ("XADD", self._stream, "MAXLEN", "~", self.config.deletions_maxlen,
                               "*", "v", _FORMAT, "origin", self._origin, *fields))

    def _deletion_entries(self, tenant: str, keys: Iterable[bytes],
                          fingerprints: Iterable[bytes]) -> list[Command]:
        """The commands that record the deletion of the blocks ``keys`` of ``tenant`` (of the
        models ``fingerprints``) in the stream; none when sharing is off."""
        if not self.config.share_deletions:
            return []
        keys = list(dict.fromkeys(keys))
        fps = b"".join(dict.fromkeys(fingerprints))
        th = self._tenant_hex(tenant)
        return [self._xadd(["kind", "subtree", "tenant", th, "fps", fps,
                            "keys", b"".join(keys[i:i + ENTRY_KEYS])])
                for i in range(0, len(keys), ENTRY_KEYS)]

    def _model_entry(self, fingerprint: bytes) -> list[Command]:
        """The command that records the purge of the model ``fingerprint``."""
        if not self.config.share_deletions:
            return []
        return [self._xadd(["kind", "model", "fps", fingerprint])]

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
        Nothing when ``share_deletions`` is off; once only."""
        if not self.config.share_deletions or self._reader is not None:
            return
        self._apply = apply
        self._position = position
        cfg = self.config
        # its own connection: a read blocks for deletions_block_s, and close() shuts it down
        self._reader_client = connect(cfg.model_copy(update={
            "op_timeout_s": cfg.deletions_block_s + cfg.op_timeout_s, "retries": 0}))
        try:
            self._positioned()
        except FAULTS as exc:  # positioned by the reader once Redis answers
            self._count("deletions_read_errors")
            log.warning("deletions stream %s unreadable at open (%s): deletions made by other "
                        "servers until it answers are missed", self._stream, exc)
        self._reader = threading.Thread(target=self._read_loop, name="kvstore-remote-deletions",
                                        daemon=True)
        self._reader.start()

    def _positioned(self) -> None:
        """Set (and save) where reading starts. Redis faults propagate."""
        self._last_id = self._start_id()
        self._save_id(self._last_id)

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
        saved = self._saved_id()
        if saved is None:
            return end
        if _id_tuple(saved) > _id_tuple(end):  # not this stream any more (a flush, a new Redis)
            log.warning("deletions stream %s is behind the position saved in %s: reading from its end",
                        self._stream, self._position)
            return end
        first = info.get("recorded-first-entry-id") or (info.get("first-entry") or (None,))[0]
        if first is not None and _id_tuple(_text(first)) > _id_tuple(saved):
            self._count("deletions_missed")
            log.warning("deletions stream %s was trimmed past this server's position (%s): "
                        "deletions made while it was down may be missed (raise deletions_maxlen)",
                        self._stream, saved)
        return saved

    def _saved_id(self) -> str | None:
        if self._position is None:
            return None
        try:
            ns, _, eid = self._position.read_text().strip().partition(" ")
            if ns != self._ns:
                return None
            _id_tuple(eid)
            return eid
        except (OSError, ValueError):
            return None

    def _save_id(self, entry_id: str) -> None:
        if self._position is None:
            return
        tmp = self._position.with_name(self._position.name + ".tmp")
        try:
            tmp.write_text(f"{self._ns} {entry_id}\n")
            os.replace(tmp, self._position)
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
                self._count("deletions_read_errors")
                log.exception("reading the deletions stream %s failed", self._stream)
                self._reader_stop.wait(cfg.breaker_cap_s)
                continue
            if fails:
                log.info("deletions stream %s readable again", self._stream)
            fails = 0
            entries = _entries(reply)
            for entry_id, fields in entries:
                self._take(entry_id, fields)
            if entries:
                self._save_id(self._last_id)

    def _take(self, entry_id: Any, fields: dict[Any, Any]) -> None:
        """Apply one entry (never raises); the reader's position moves past it."""
        eid = self._last_id = _text(entry_id)
        try:
            d = parse_entry(eid, fields)
        except (ValueError, UnicodeDecodeError, TypeError) as exc:
            self._count("deletions_malformed")
            log.warning("deletions stream %s: entry %s skipped (%s)", self._stream, eid, exc)
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

    def _cancel_deleted(self, d: Deletion) -> int:
        """Cancel this server's queued demotions (and the one being written: it is unlinked
        once written) of what ``d`` deleted, and forget those blocks in the accounting."""
        if d.kind == "model":
            fps = set(d.fingerprints)

            def hit(job: Any) -> bool:
                return job.ref.spec.fingerprint in fps
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
            else:
                self._unheld_where(lambda ident, _: ident[1] in doomed
                                   and self._tenant_hex(ident[0]) == d.tenant)
        return n

    def stop_deletions(self) -> None:
        """Stop the reader and wait for it: its connection is shut down, so a read blocked on a
        paused Redis ends at once. An ``apply`` running now ends first (the Store calls this
        before it takes its lock to close). Idempotent."""
        self._reader_stop.set()
        if self._reader_client is not None:
            self._reader_client.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=self._one_write_s())
            if self._reader.is_alive():  # it connected again just before the stop
                self._reader_client.close()
                self._reader.join(timeout=1.0)


__all__ = ["ENTRY_KEYS", "Apply", "Deletion", "SharedDeletions", "parse_entry"]
