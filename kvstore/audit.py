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
  Admin ReadAudit response must fit the gRPC message limit) and says whether more follow. It
  starts reading near the first entry asked for (a sparse index of byte offsets, built by the
  open's scan and extended by each append) and reads up to where the file ended when it began,
  without holding the append lock: the bytes before that end never change (an append only adds
  past it, and a torn append is cut back to it at most). Why: it parsed the whole file under
  the lock, so on a log of 300,000 entries (59 MiB) each ReadAudit of the last entries took
  3.7 s and every audited change (a block deletion, an admin call) waited for it.
* An append that cannot be written whole (a full disk, an I/O error) leaves the file as it was
  (a torn line is cut off again; when that cut fails too, before the next append) and raises
  :class:`kvstore.errors.FailedPrecondition` saying so. At open, a last line without its
  newline (an append cut short by a crash or a power cut) is mended: an entry that parses gets
  its newline back (the next append was glued to it, and the open after that refused the log);
  one that does not is removed, with a warning and an ``audit.recover`` entry. Any other
  malformed line stops the open (:class:`kvstore.errors.IntegrityError` naming the line), and
  :meth:`AuditLog.verify` reports a torn last entry. A line is malformed when it is not a JSON
  object of exactly the entry's fields with their types (:func:`parse_entry`): a line with
  ``"seq": "7"`` used to be taken, and then every append failed with a TypeError.
* An audit log that cannot be opened (a directory in its place, no permission) is a
  :class:`kvstore.errors.FailedPrecondition` naming the file and what is wrong, not an OSError.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
from array import array
from bisect import bisect_right
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
#: one entry in this many has its byte offset in the index :meth:`AuditLog.page` starts from;
#: a page parses at most this many entries before the first one it returns
INDEX_EVERY = 64


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


_INT, _NUMBER, _STR = ((int,), "an integer"), ((int, float), "a number"), ((str,), "a string")
#: each field of an entry's line: the JSON types it may have (a bool, an int to Python, is
#: refused apart) and their name; ``detail``, ``prev`` and ``ref`` may be missing (lines of
#: earlier versions)
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "seq": _INT, "time": _NUMBER, "principal": _STR, "action": _STR, "target": _STR,
    "result": _STR, "detail": _STR, "prev": _STR, "ref": _INT,
}
_OPTIONAL_FIELDS = frozenset({"detail", "prev", "ref"})
_MAX_SEQ = 1 << 63
_NUMBERS = (int, float)


def parse_entry(raw: bytes) -> AuditEntry:
    """The entry of one line (without its newline). ValueError or TypeError saying what is
    wrong when it is not JSON, not an object, lacks a field, has one the entry does not, or
    has one of the wrong type (a seq or ref out of range, a time that is not finite).

    NOTE: the entry used to be built as ``AuditEntry(**json.loads(raw))``, which checks no
    type: a line with ``"seq": "7"`` opened, and every append after it failed with
    ``can only concatenate str (not "int") to str``."""
    data = json.loads(raw)
    if isinstance(data, dict) and _well_formed(data):
        try:
            return AuditEntry(**data)
        except TypeError:  # a field the entry does not have
            pass
    raise _explain(data)


def _well_formed(data: dict[str, object]) -> bool:
    """Whether every field of an entry is there (bar the optional ones) with its type and in
    its range: the open's fast path (each entry of the log is checked), :func:`_explain` says
    what is wrong otherwise."""
    g = data.get
    seq, ref, when = g("seq"), g("ref", 0), g("time")
    return (type(seq) is int and type(ref) is int and type(when) in _NUMBERS
            and type(g("principal")) is str and type(g("action")) is str and type(g("target")) is str
            and type(g("result")) is str and type(g("detail", "")) is str and type(g("prev", "")) is str
            and 0 < seq < _MAX_SEQ and 0 <= ref < _MAX_SEQ and -math.inf < when < math.inf)  # type: ignore[operator]


def _explain(data: object) -> ValueError | TypeError:
    """The error saying why ``data`` (which :func:`_well_formed` refused) is not an entry."""
    if not isinstance(data, dict):
        return TypeError(f"not a JSON object but a {type(data).__name__}")
    unknown = sorted(data.keys() - _FIELD_TYPES.keys())
    if unknown:
        return ValueError(f"unknown field(s) {', '.join(unknown)}")
    missing = sorted(_FIELD_TYPES.keys() - _OPTIONAL_FIELDS - data.keys())
    if missing:
        return ValueError(f"missing field(s) {', '.join(missing)}")
    for name, value in data.items():
        kinds, wanted = _FIELD_TYPES[name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            return TypeError(f"{name} must be {wanted}, got {type(value).__name__} {value!r:.40}")
    for name, low in (("seq", 1), ("ref", 0)):  # what ReadAudit's uint64 fields can carry
        if not low <= data.get(name, low) < _MAX_SEQ:
            return ValueError(f"{name} must be in {low}..2**63-1, got {str(data[name])[:40]}")
    return ValueError(f"time must be a finite number of seconds, got {str(data['time'])[:40]}")


def _digest(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


class AuditLog:
    """An append-only JSON-lines audit log at ``path``."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float], fsync: bool = True) -> None:
        self.path = Path(path)
        self._clock = clock
        self._fsync = fsync
        self._lock = threading.Lock()  # serialises appends
        # guards what a reader starts from (_end and the index): taken by an append only once its
        # line is written, so a page never waits for an append's write and fsync
        self._published = threading.Lock()
        self._seq = 0
        self._prev = GENESIS
        self._cut_at: int | None = None  # where a failed append left bytes it could not cut
        # The sparse index page() starts from: at offset _index_offsets[i] begins an entry, and
        # every entry before it has a seq <= _index_seqs[i] (the largest seq before it, so the
        # array never decreases, even in a log whose seqs do not). (0, 0) is the file's start.
        self._index_seqs = array("q", [0])
        self._index_offsets = array("q", [0])
        self._max_seq = 0  # the largest seq in the file
        self._unindexed = 0  # entries appended since the last one indexed
        self._end = 0  # where the last whole entry ends: the bytes before never change
        self._fd = -1
        try:
            self._open()
        except BaseException as exc:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if isinstance(exc, OSError):  # NOTE: was the raw OSError (IsADirectoryError...)
                raise FailedPrecondition(self._cannot_open(exc)) from None
            raise

    def _cannot_open(self, exc: OSError | None) -> str:
        """What is wrong with the file (or its directory), for people."""
        try:
            if self.path.parent.exists() and not self.path.parent.is_dir():
                return f"the audit log {self.path} cannot be made: {self.path.parent} is not a directory"
            if self.path.is_dir():
                return f"the audit log {self.path} is a directory: move it away (the server creates the file)"
            if os.path.lexists(self.path) and not self.path.is_file():
                return f"the audit log {self.path} is not a regular file: move it away (the server creates the file)"
        except OSError:
            pass  # what exc says is all there is to say
        return f"the audit log {self.path} cannot be opened: {(exc.strerror or exc) if exc else 'unknown'}"

    def _open(self) -> None:
        """Scan the file (the sequence, the chain's last digest, the index, STARTED entries
        left open), open it for appending, mend its end, and close what was left open."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(self.path) and not self.path.is_file():  # a fifo would block the scan
            raise FailedPrecondition(self._cannot_open(None))
        open_changes: dict[int, AuditEntry] = {}
        for entry, raw, start in self._scan():
            self._seq = entry.seq
            self._prev = _digest(raw)
            self._note(entry.seq, start)
            if entry.result == STARTED:
                open_changes[entry.seq] = entry
            open_changes.pop(entry.ref, None)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._end = os.fstat(self._fd).st_size
        self._mend_tail()
        for entry in open_changes.values():
            self._close_unfinished(entry)

    def _note(self, seq: int, start: int) -> None:
        """Index the entry ``seq`` beginning at byte ``start`` when its turn has come."""
        if self._unindexed >= INDEX_EVERY:
            self._index_seqs.append(self._max_seq)
            self._index_offsets.append(start)
            self._unindexed = 0
        self._unindexed += 1
        self._max_seq = max(self._max_seq, seq)

    def _close_unfinished(self, started: AuditEntry) -> None:
        detail = "no outcome was recorded (the server stopped during the action, or its record could not be written)"
        try:
            self.append(started.principal, started.action, started.target, UNKNOWN, detail, ref=started.seq)
        except FailedPrecondition as exc:  # NOTE: left open; the next start tries again
            log.error("audit entry %d has no outcome, and none could be written: %s", started.seq, exc)

    def _scan(self) -> Iterator[tuple[AuditEntry, bytes, int]]:
        """Every entry with its line and the byte it starts at. A malformed line is an
        IntegrityError naming its number, except a last line with no newline: an append torn
        by a crash or power cut (nothing after it was written). What the last line lacks is
        left in ``self._tail`` (None: the file ends with a newline): ``(start, size, whole)``,
        ``whole`` when the line parsed and only its newline is missing."""
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
                    entry = parse_entry(raw)
                except (ValueError, TypeError) as exc:
                    if last:
                        self._tail = (start, len(line), False)
                        return
                    raise IntegrityError(f"audit log {self.path} has a malformed line {number} "
                                         f"(byte {start}): {exc}") from None
                yield entry, raw, start

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
            self._end = start + size + 1
            log.warning("audit log %s: the last entry lacked its newline; added", self.path)
        else:
            os.ftruncate(self._fd, start)
            self._end = start
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
            start = self._write_whole(raw + b"\n")
            self._seq = entry.seq
            self._prev = _digest(raw)
            with self._published:
                self._note(entry.seq, start)
                self._end = start + len(raw) + 1
            return entry

    def _write_whole(self, line: bytes) -> int:
        """Append ``line`` whole, or leave the file as it was; returns the byte it starts at."""
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
        return end

    def read(self, since_seq: int = 0, limit: int = 1000) -> list[AuditEntry]:
        """Entries with ``seq > since_seq``, oldest first, at most ``limit``."""
        return self.page(since_seq, limit)[0]

    def page(self, since_seq: int = 0, limit: int = 1000,
             fits: Callable[[AuditEntry], bool] | None = None) -> tuple[list[AuditEntry], bool]:
        """Entries with ``seq > since_seq``, oldest first: at most ``limit``, and while
        ``fits(entry)`` (which may count each entry against a budget; an entry it refuses is
        not returned). Also returns whether entries follow the last one returned.

        Reads from the last indexed entry before the first one asked for, up to the end of
        the last entry appended when the call began, without holding the append lock (the
        bytes before that end do not change; entries appended meanwhile are left to the next
        page). NOTE: it parsed the whole file under the append lock (3.7 s on 59 MiB, and
        every audited change waited)."""
        with self._published:  # not the append lock: an append under way holds that one
            end = self._end
            at = bisect_right(self._index_seqs, since_seq) - 1  # the last one before it: <= since_seq
            start = self._index_offsets[at]
        out: list[AuditEntry] = []
        for entry, _, _ in self._read_range(start, end):
            if entry.seq <= since_seq:
                continue
            if len(out) >= limit or (fits is not None and not fits(entry)):
                return out, True
            out.append(entry)
        return out, False

    def _read_range(self, start: int, end: int) -> Iterator[tuple[AuditEntry, bytes, int]]:
        """The entries whose lines begin in ``[start, end)`` (``start`` the beginning of a
        line, ``end`` the end of one), with their lines and offsets. A line that no longer
        parses (the file was changed under the server) is an IntegrityError naming its byte;
        a file that cannot be read, a FailedPrecondition."""
        try:
            with open(self.path, "rb") as f:
                self._same_file(os.fstat(f.fileno()), end)
                f.seek(start)
                offset = start
                for line in f:  # NOTE: may read ahead past end, into an append under way: unused
                    if offset >= end:
                        return
                    at, offset = offset, offset + len(line)
                    raw = line.rstrip(b"\n")
                    if not raw:
                        continue
                    try:
                        entry = parse_entry(raw)
                    except (ValueError, TypeError) as exc:
                        raise IntegrityError(f"audit log {self.path} has a malformed line at byte {at} "
                                             f"(it changed since the server opened it?): {exc}") from None
                    yield entry, raw, at
        except OSError as exc:
            raise FailedPrecondition(f"the audit log {self.path} could not be read: {exc.strerror or exc}") from None

    def _same_file(self, read: os.stat_result, end: int) -> None:
        """FailedPrecondition unless the file opened for reading (``read``) is the one this log
        appends to, holding at least ``end`` bytes. NOTE: a log rotated under the server (renamed
        and replaced by a new file, logrotate's default) read as empty, without a word, while
        every entry went on into the renamed file; one truncated in place (copytruncate) read
        as empty too. The log is one hash chain: it cannot be rotated while the server runs."""
        fd = self._fd
        if fd < 0:
            return
        try:
            written = os.fstat(fd)
        except OSError:
            return
        why = ""
        if (read.st_dev, read.st_ino) != (written.st_dev, written.st_ino):
            why = "is no longer the file this server appends to (renamed or replaced since it started)"
        elif read.st_size < end:
            why = f"was cut to {read.st_size} bytes since the server wrote {end}"
        if why:
            raise FailedPrecondition(
                f"the audit log {self.path} {why}: it cannot be rotated while the server runs (it is one hash "
                f"chain; its entries go on into the file the server opened); stop the server, move the file "
                f"away, start it again")

    def verify(self) -> int:
        """Check the hash chain and sequence; return the entry count or raise IntegrityError.
        Reads, like :meth:`page`, up to the last entry appended when it began, without holding
        the append lock."""
        with self._lock, self._published:  # the state after the append under way, if any
            end, last_seq, last_prev, cut_at = self._end, self._seq, self._prev, self._cut_at
        prev, seq = GENESIS, 0
        for entry, raw, _ in self._read_range(0, end):
            if entry.prev != prev or entry.seq != seq + 1:
                raise IntegrityError(f"audit log chain broken at seq {entry.seq}")
            prev, seq = _digest(raw), entry.seq
        if (seq, prev) != (last_seq, last_prev):
            raise IntegrityError(f"audit log {self.path} does not end with the last entry written (seq "
                                 f"{last_seq}) but with seq {seq}: it changed since the server opened it")
        if cut_at is not None:
            torn = self._size() - cut_at
            raise IntegrityError(f"audit log {self.path} ends with a torn entry of {torn} "
                                 "bytes (an append cut short; the next append or open cuts it)")
        return seq

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return -1

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
