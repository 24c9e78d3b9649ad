"""Append-only audit log: who did what, when, with what result.

The log is a JSON-lines file in the store's directory (``audit.log``). Each entry is one line::

    {"seq": 7, "time": 1718000000.5, "principal": "admin", "action": "tenant.delete",
     "target": "acme", "result": "OK", "detail": "", "prev": "<sha256 hex of line 6>"}

Contract:

* Entries are only ever appended (``O_APPEND``), flushed, and fsynced when ``fsync`` is true.
* ``seq`` increases by one per entry, from 1, across restarts.
* ``prev`` chains each entry to the previous line's SHA-256, so an edited or removed line is
  detected by :meth:`AuditLog.verify`.
* Time comes from the injected ``clock``.
* Thread-safe: one lock serialises appends.
* A change is recorded twice (write-ahead): :class:`Recorder` appends a ``STARTED`` entry
  before the action runs, and the action is refused when that entry cannot be written; the
  outcome follows, its ``ref`` naming the ``STARTED`` entry's ``seq``. A ``STARTED`` entry left
  without an outcome (the server stopped mid-action, or the outcome could not be written) gets
  an ``UNKNOWN`` outcome when the log is next opened. Why: the outcome used to be the only
  record, written after the action, so a crash between the two left an action no one could
  see in the log. Read-only actions (``changes=False``) get only their outcome.
* Every recorded string is bounded (:func:`bounded`): a target or principal to
  :data:`FIELD_CHARS` characters, a detail to :data:`DETAIL_CHARS`, a longer one cut with a
  marker giving its length (``"abc…(3145728 bytes)"``), and the target of an unauthenticated
  call (principal :data:`ANONYMOUS`) to :data:`ANONYMOUS_TARGET_CHARS`. Why: the target is what
  the caller sent (a name, a namespace), and a caller sending names of megabytes grew the log
  by megabytes per call, token or not.
* :meth:`AuditLog.page` reads the entries after a ``seq`` while they fit a byte budget (the
  Admin ReadAudit response must fit the gRPC message limit) and says whether more follow.
* An append that cannot be written whole (a full disk, an I/O error) leaves the file as it was
  (a torn line is cut off again; when that cut fails too, before the next append) and raises
  :class:`kvstore.errors.FailedPrecondition` saying so. At open, a last line without its
  newline (an append cut short by a crash or a power cut) is mended: an entry that parses gets
  its newline back (the next append was glued to it, and the open after that refused the log);
  one that does not is removed, with a warning and an ``audit.recover`` entry. Any other
  malformed line stops the open (:class:`kvstore.errors.IntegrityError` naming the line), and
  :meth:`AuditLog.verify` reports a torn last entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstore.errors import FailedPrecondition, IntegrityError

log = logging.getLogger(__name__)

GENESIS = "0" * 64
#: the result of the entry written before a change is made
STARTED = "STARTED"
#: the outcome given, at the next open, to a STARTED entry left without one
UNKNOWN = "UNKNOWN"
#: the principal recorded for a call whose token was missing or not valid
ANONYMOUS = "?"
#: the most characters recorded of a target, principal, action or result
FIELD_CHARS = 256
#: the most characters recorded of a detail
DETAIL_CHARS = 1024
#: the most characters recorded of the target of an unauthenticated call
ANONYMOUS_TARGET_CHARS = 64
#: what a cut value may exceed its bound by: the marker (an ellipsis and up to 20 digits). A
#: value within it is kept whole, so that bounding a bounded value changes nothing.
_MARKER_CHARS = 32


def bounded(value: str, limit: int = FIELD_CHARS) -> str:
    """``value``, or its first ``limit`` characters and a marker with its length in UTF-8 bytes
    (``"abc…(3145728 bytes)"``) when it is longer than ``limit`` plus the marker's room."""
    if len(value) <= limit + _MARKER_CHARS:
        return value
    return f"{value[:limit]}…({len(value.encode('utf-8', 'surrogatepass'))} bytes)"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    seq: int
    time: float
    principal: str
    action: str
    target: str
    result: str
    detail: str = ""
    prev: str = GENESIS
    #: for an outcome, the seq of the STARTED entry it ends (0: none)
    ref: int = 0


def _digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


class AuditLog:
    """An append-only JSON-lines audit log at ``path``."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float], fsync: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._fsync = fsync
        self._lock = threading.Lock()
        self._seq = 0
        self._prev = GENESIS
        self._cut_at: int | None = None  # where a failed append left bytes it could not cut
        open_changes: dict[int, AuditEntry] = {}
        for entry, raw in self._scan():
            self._seq = entry.seq
            self._prev = _digest(raw)
            if entry.result == STARTED:
                open_changes[entry.seq] = entry
            open_changes.pop(entry.ref, None)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._mend_tail()
        for entry in open_changes.values():
            self._close_unfinished(entry)

    def _close_unfinished(self, started: AuditEntry) -> None:
        detail = "no outcome was recorded (the server stopped during the action, or its record could not be written)"
        try:
            self.append(started.principal, started.action, started.target, UNKNOWN, detail, ref=started.seq)
        except FailedPrecondition as exc:  # NOTE: left open; the next start tries again
            log.error("audit entry %d has no outcome, and none could be written: %s", started.seq, exc)

    def _scan(self) -> Iterator[tuple[AuditEntry, bytes]]:
        """Every entry with its line. A malformed line is an IntegrityError naming its number,
        except a last line with no newline: an append torn by a crash or power cut (nothing
        after it was written). What the last line lacks is left in ``self._tail`` (None: the
        file ends with a newline): ``(start, size, whole)``, ``whole`` when the line parsed
        and only its newline is missing."""
        self._tail: tuple[int, int, bool] | None = None
        if not self.path.exists():
            return
        offset = 0
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, 1):
                start, offset = offset, offset + len(line)
                raw = line.rstrip(b"\n")
                last = not line.endswith(b"\n")  # only the last line can lack its newline
                if last:
                    self._tail = (start, len(line), True)
                if not raw:
                    continue
                try:
                    entry = AuditEntry(**json.loads(raw))
                except (ValueError, TypeError) as exc:
                    if last:
                        self._tail = (start, len(line), False)
                        return
                    raise IntegrityError(f"audit log {self.path} has a malformed line {number} "
                                         f"(byte {start}): {exc}") from None
                yield entry, raw

    def _mend_tail(self) -> None:
        """Mend the end of the file as the last :meth:`_scan` found it: a whole last entry
        gets its newline (the next append was glued to it, and the open after that refused
        the log); a torn one is cut, and the cut recorded."""
        if self._tail is None:
            return
        start, size, whole = self._tail
        self._tail = None
        if whole:
            os.write(self._fd, b"\n")
            log.warning("audit log %s: the last entry lacked its newline; added", self.path)
        else:
            os.ftruncate(self._fd, start)
            log.warning("audit log %s: cut a torn last line of %d bytes at byte %d", self.path, size, start)
        if self._fsync:
            os.fsync(self._fd)
        if not whole:
            self.append("kvstore", "audit.recover", str(self.path), "OK",
                        f"a torn last line of {size} bytes (an append cut short by a crash) was removed")

    def append(self, principal: str, action: str, target: str, result: str, detail: str = "",
               ref: int = 0) -> AuditEntry:
        """Append one entry and return it (durable when ``fsync`` is on); every string is
        :func:`bounded`."""
        if principal == ANONYMOUS:
            target = bounded(target, ANONYMOUS_TARGET_CHARS)
        with self._lock:
            entry = AuditEntry(
                seq=self._seq + 1,
                time=self._clock(),
                principal=bounded(principal),
                action=bounded(action),
                target=bounded(target),
                result=bounded(result),
                detail=bounded(detail, DETAIL_CHARS),
                prev=self._prev,
                ref=ref,
            )
            raw = json.dumps(asdict(entry), separators=(",", ":"), sort_keys=True).encode()
            self._write_whole(raw + b"\n")
            self._seq = entry.seq
            self._prev = _digest(raw)
            return entry

    def _write_whole(self, line: bytes) -> None:
        if self._cut_at is not None:  # a torn append this process could not cut: cut it first
            try:
                os.ftruncate(self._fd, self._cut_at)
            except OSError as exc:
                raise FailedPrecondition(f"the audit log {self.path} could not be written: it ends "
                                         f"with a torn entry that could not be cut: {exc}") from None
            self._cut_at = None
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(f"wrote {written} of {len(line)} bytes (is the disk full?)")
            if self._fsync:
                os.fsync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, end)
            except OSError:
                self._cut_at = end  # NOTE: cut before the next append (or by the next open)
            raise FailedPrecondition(f"the audit log {self.path} could not be written: {exc}") from None

    def read(self, since_seq: int = 0, limit: int = 1000) -> list[AuditEntry]:
        """Entries with ``seq > since_seq``, oldest first, at most ``limit``."""
        return self.page(since_seq, limit)[0]

    def page(self, since_seq: int = 0, limit: int = 1000,
             fits: Callable[[AuditEntry], bool] | None = None) -> tuple[list[AuditEntry], bool]:
        """Entries with ``seq > since_seq``, oldest first: at most ``limit``, and while
        ``fits(entry)`` (which may count each entry against a budget; an entry it refuses is
        not returned). Also returns whether entries follow the last one returned."""
        out: list[AuditEntry] = []
        with self._lock:
            for entry, _ in self._scan():
                if entry.seq <= since_seq:
                    continue
                if len(out) >= limit or (fits is not None and not fits(entry)):
                    return out, True
                out.append(entry)
        return out, False

    def verify(self) -> int:
        """Check the hash chain and sequence; return the entry count or raise IntegrityError."""
        prev, seq = GENESIS, 0
        with self._lock:
            for entry, raw in self._scan():
                if entry.prev != prev or entry.seq != seq + 1:
                    raise IntegrityError(f"audit log chain broken at seq {entry.seq}")
                prev, seq = _digest(raw), entry.seq
            if self._tail is not None and not self._tail[2]:
                raise IntegrityError(f"audit log {self.path} ends with a torn entry of {self._tail[1]} "
                                     "bytes (an append cut short; the next append or open cuts it)")
        return seq

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class Recorder:
    """The audit record of one action of ``principal``: :meth:`begin` before it changes
    anything (raises FailedPrecondition, and so refuses the action, when the entry cannot be
    written), :meth:`end` with its outcome. With ``changes=False`` (a read), only the outcome
    is written."""

    def __init__(self, log: AuditLog, action: str, target: str, detail: str = "", *, changes: bool = True) -> None:
        self.log, self.action, self.target, self.detail, self.changes = log, action, target, detail, changes
        self._started = 0

    def begin(self, principal: str) -> None:
        if not self.changes:
            return
        try:
            self._started = self.log.append(principal, self.action, self.target, STARTED, self.detail).seq
        except FailedPrecondition as exc:
            raise FailedPrecondition(f"{exc}; so {self.action} was not carried out") from None

    def end(self, principal: str, result: str) -> AuditEntry:
        return self.log.append(principal, self.action, self.target, result, self.detail, ref=self._started)
