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
* An append that cannot be written whole (a full disk, an I/O error) leaves the file as it was
  (a torn line is cut off again: it would stop the next start, which refuses a malformed
  line) and raises :class:`kvstore.errors.FailedPrecondition` saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstore.errors import FailedPrecondition, IntegrityError

GENESIS = "0" * 64


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
        for entry, raw in self._scan():
            self._seq = entry.seq
            self._prev = _digest(raw)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def _scan(self) -> Iterator[tuple[AuditEntry, bytes]]:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            for raw in f:
                raw = raw.rstrip(b"\n")
                if not raw:
                    continue
                try:
                    yield AuditEntry(**json.loads(raw)), raw
                except (ValueError, TypeError) as exc:
                    raise IntegrityError(f"audit log {self.path} has a malformed line: {exc}") from None

    def append(self, principal: str, action: str, target: str, result: str, detail: str = "") -> AuditEntry:
        """Append one entry and return it (durable when ``fsync`` is on)."""
        with self._lock:
            entry = AuditEntry(
                seq=self._seq + 1,
                time=self._clock(),
                principal=principal,
                action=action,
                target=target,
                result=result,
                detail=detail,
                prev=self._prev,
            )
            raw = json.dumps(asdict(entry), separators=(",", ":"), sort_keys=True).encode()
            self._write_whole(raw + b"\n")
            self._seq = entry.seq
            self._prev = _digest(raw)
            return entry

    def _write_whole(self, line: bytes) -> None:
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
                pass  # NOTE: the next start reports the torn line (IntegrityError)
            raise FailedPrecondition(f"the audit log {self.path} could not be written: {exc}") from None

    def read(self, since_seq: int = 0, limit: int = 1000) -> list[AuditEntry]:
        """Entries with ``seq > since_seq``, oldest first, at most ``limit``."""
        out: list[AuditEntry] = []
        with self._lock:
            for entry, _ in self._scan():
                if entry.seq > since_seq:
                    out.append(entry)
                    if len(out) >= limit:
                        break
        return out

    def verify(self) -> int:
        """Check the hash chain and sequence; return the entry count or raise IntegrityError."""
        prev, seq = GENESIS, 0
        with self._lock:
            for entry, raw in self._scan():
                if entry.prev != prev or entry.seq != seq + 1:
                    raise IntegrityError(f"audit log chain broken at seq {entry.seq}")
                prev, seq = _digest(raw), entry.seq
        return seq

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
