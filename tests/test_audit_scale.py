"""Reading the audit log does not scale with its length, and does not stop appends.

ReadAudit parsed the whole file while holding the append lock: on a log of 300,000 entries
(59 MiB) a read of the last entries took 3.7 s, and every audited change (a block deletion,
an admin call) waited for it. A page now starts near the first entry asked for (a sparse
index of byte offsets) and reads, without the lock, up to where the log ended when it began.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

import kvstore.audit as audit_mod
from kvstore.audit import INDEX_EVERY, AuditEntry, AuditLog
from kvstore.errors import FailedPrecondition, IntegrityError


def _log(path, clock: float = 1000.0) -> AuditLog:
    return AuditLog(path, clock=lambda: clock, fsync=False)


def _grow(log: AuditLog, n: int) -> None:
    for i in range(n):
        log.append("admin", "tenant.create", f"t{i}", "OK")


def _all_entries(path) -> list[AuditEntry]:
    """Every entry of the file, parsed the plain way: the reference pages are checked against."""
    return [AuditEntry(**json.loads(line)) for line in path.read_bytes().splitlines() if line]


class _CountingJSON:
    """Stands in for the json module in kvstore.audit, counting the lines parsed."""

    def __init__(self) -> None:
        self.loads_calls = 0

    def loads(self, raw: Any) -> Any:
        self.loads_calls += 1
        return json.loads(raw)

    def dumps(self, *args: Any, **kwargs: Any) -> str:
        return json.dumps(*args, **kwargs)


def test_a_page_of_the_tail_parses_only_the_tail(tmp_path, monkeypatch) -> None:
    """Before: every page parsed each of the 5,000 lines (and did so under the append lock)."""
    path = tmp_path / "audit.log"
    log = _log(path)
    _grow(log, 3000)
    log.close()
    log = _log(path)  # the index built by the open's scan
    _grow(log, 2000)  # and extended by appends
    counting = _CountingJSON()
    monkeypatch.setattr(audit_mod, "json", counting)
    try:
        for since in (4990, 2990, 5000):
            counting.loads_calls = 0
            entries = log.read(since, 10)
            assert [e.seq for e in entries] == list(range(since + 1, min(since + 10, 5000) + 1))
            assert counting.loads_calls <= INDEX_EVERY + 11, (since, counting.loads_calls)
    finally:
        log.close()


def test_pages_from_every_seq_match_the_whole_file(tmp_path) -> None:
    """Every ``since`` (on, between and around the index's marks), across a reopen and appends."""
    path = tmp_path / "audit.log"
    log = _log(path)
    _grow(log, 2 * INDEX_EVERY + 5)
    log.close()
    log = _log(path)
    _grow(log, INDEX_EVERY + 3)
    try:
        every = _all_entries(path)
        total = len(every)
        for since in range(total + 2):
            for limit in (1, 7, 1000):
                page, more = log.page(since, limit)
                want = [e for e in every if e.seq > since]
                assert page == want[:limit]
                assert more == (len(want) > limit)
    finally:
        log.close()


def test_a_log_whose_seqs_go_back_pages_as_the_whole_file_filtered(tmp_path) -> None:
    """The open does not refuse a broken sequence (``verify`` reports it), so the index must
    not assume seqs increase: a page is every entry after ``since``, in file order."""
    path = tmp_path / "audit.log"
    log = _log(path)
    _grow(log, 3 * INDEX_EVERY)
    log.close()
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines + lines[:INDEX_EVERY + 9]))  # seqs 1..192, then 1..73 again
    log = _log(path)
    try:
        every = _all_entries(path)
        for since in (0, 5, INDEX_EVERY, INDEX_EVERY + 8, 2 * INDEX_EVERY + 1, 3 * INDEX_EVERY):
            assert log.read(since, 10_000) == [e for e in every if e.seq > since]
        with pytest.raises(IntegrityError, match="chain broken"):
            log.verify()
    finally:
        log.close()


def test_an_append_goes_through_while_a_page_is_being_read(tmp_path) -> None:
    """``fits`` runs for each entry a page reads: an append from another thread in it finishes
    at once. Before, the page held the append lock throughout, and the append waited for it."""
    path = tmp_path / "audit.log"
    log = _log(path)
    _grow(log, 50)
    appended = threading.Event()
    writer = threading.Thread(target=lambda: (log.append("acme", "blocks.delete", "acme", "OK"), appended.set()))
    seen: list[int] = []
    went_through: list[bool] = []

    def fits(entry: AuditEntry) -> bool:
        seen.append(entry.seq)
        if entry.seq == 45:
            writer.start()
            went_through.append(appended.wait(timeout=10))
        return True

    try:
        page, more = log.page(40, 1000, fits)
        writer.join(timeout=30)
        assert went_through == [True]
        assert [e.seq for e in page] == list(range(41, 51)) and not more  # what was there when it began
        assert [e.seq for e in log.read(50)] == [51]  # and the next page has it
        assert log.verify() == 51
    finally:
        log.close()


def test_a_page_read_during_an_append_is_not_held_up_and_skips_the_half_written_line(tmp_path, monkeypatch) -> None:
    """An append stopped halfway through writing its line (its bytes are in the file, its
    newline is not): a page read meanwhile returns at once, without that line and without
    taking it for a malformed one; the append then finishes."""
    path = tmp_path / "audit.log"
    log = _log(path)
    _grow(log, 20)
    half_written, finish = threading.Event(), threading.Event()
    real_write = audit_mod.os.write

    def slow_write(fd: int, data: bytes) -> int:
        if threading.current_thread() is writer:
            half = len(data) // 2
            real_write(fd, data[:half])
            half_written.set()
            finish.wait(timeout=30)
            return half + real_write(fd, data[half:])
        return real_write(fd, data)

    monkeypatch.setattr(audit_mod.os, "write", slow_write)
    writer = threading.Thread(target=log.append, args=("acme", "blocks.delete", "acme", "OK"))
    pages: list[tuple[list[AuditEntry], bool]] = []
    reader = threading.Thread(target=lambda: pages.append(log.page(15, 1000)))
    try:
        writer.start()
        assert half_written.wait(timeout=10)
        assert path.read_bytes()[-1:] != b"\n"  # the torn line is in the file
        reader.start()
        reader.join(timeout=10)
        assert not reader.is_alive(), "the page waited for the append"
        page, more = pages[0]
        assert [e.seq for e in page] == [16, 17, 18, 19, 20] and not more
    finally:
        finish.set()
        writer.join(timeout=30)
        reader.join(timeout=30)
    try:
        assert [e.seq for e in log.read(15)] == [16, 17, 18, 19, 20, 21]
        assert log.verify() == 21
    finally:
        log.close()


def test_a_torn_append_left_uncut_is_not_read_and_is_cut_before_the_next(tmp_path, monkeypatch) -> None:
    """The bytes of an append that failed and could not be cut lie past the end a page reads
    to; cutting them (at the next append) never cuts below it."""
    path = tmp_path / "audit.log"
    log = _log(path)
    _grow(log, 3)
    real_write, real_truncate = audit_mod.os.write, audit_mod.os.ftruncate
    monkeypatch.setattr(audit_mod.os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))
    monkeypatch.setattr(audit_mod.os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(OSError("EIO")))
    with pytest.raises(FailedPrecondition):
        log.append("admin", "tenant.create", "torn", "OK")
    monkeypatch.setattr(audit_mod.os, "write", real_write)
    monkeypatch.setattr(audit_mod.os, "ftruncate", real_truncate)
    try:
        assert [e.seq for e in log.read(0)] == [1, 2, 3]
        with pytest.raises(IntegrityError, match="torn entry"):
            log.verify()
        assert log.append("admin", "tenant.create", "whole", "OK").seq == 4
        assert [e.target for e in log.read(2)] == ["t2", "whole"]
        assert log.verify() == 4
    finally:
        log.close()


def test_a_page_refuses_a_line_changed_under_the_server(tmp_path) -> None:
    """The bytes a page reads are the ones the open checked; a line changed since is an
    IntegrityError naming its byte, not a raw error."""
    path = tmp_path / "audit.log"
    log = _log(path)
    _grow(log, 5)
    try:
        data = path.read_bytes()
        at = data.index(b'"seq":4')
        path.write_bytes(data[:at] + b'"seq":"4"' + data[at + len(b'"seq":4'):])
        with pytest.raises(IntegrityError, match=r"malformed line at byte \d+.*seq must be an integer"):
            log.read(2)
    finally:
        log.close()
