"""The audit log after a crash: an append cut short (a power cut between the write and its
fsync) must not stop the server from starting, now or one restart later, and must not pass
unnoticed either."""

from __future__ import annotations

import json

import pytest

import kvstore.audit as audit_mod
from kvstore.audit import AuditLog
from kvstore.errors import FailedPrecondition, IntegrityError


def _log(path) -> AuditLog:
    return AuditLog(path, clock=lambda: 1000.0, fsync=False)


def test_a_torn_last_line_is_cut_and_the_cut_recorded(tmp_path) -> None:
    path = tmp_path / "audit.log"
    log = _log(path)
    log.append("admin", "tenant.create", "acme", "OK")
    log.append("admin", "tenant.delete", "acme", "OK")
    log.close()
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"seq":3,"time":1000.0,"princ')  # the crash
    log = _log(path)  # before: IntegrityError, and the server refused to start
    try:
        assert log.verify() == 3
        lines = path.read_bytes().splitlines()
        assert b"\n".join(lines[:2]) + b"\n" == whole
        last = json.loads(lines[2])
        assert (last["seq"], last["action"], last["result"]) == (3, "audit.recover", "OK")
        assert "29 bytes" in last["detail"]
        assert log.append("admin", "tenant.create", "beta", "OK").seq == 4
        assert log.verify() == 4
    finally:
        log.close()


def test_a_malformed_line_before_the_end_still_stops_the_open(tmp_path) -> None:
    path = tmp_path / "audit.log"
    log = _log(path)
    log.append("admin", "tenant.create", "acme", "OK")
    log.close()
    good = path.read_bytes()
    path.write_bytes(b"not json\n" + good)
    with pytest.raises(IntegrityError, match="line 1"):
        _log(path)
    path.write_bytes(good + b"not json\n")  # terminated: written whole, so not torn
    with pytest.raises(IntegrityError, match="line 2"):
        _log(path)


def test_an_entry_that_lost_only_its_newline_gets_it_back(tmp_path) -> None:
    """The whole entry was written, its newline was not: the next append was glued to it and
    the open after that refused the log (malformed line 2)."""
    path = tmp_path / "audit.log"
    log = _log(path)
    log.append("admin", "tenant.create", "acme", "OK")
    log.append("admin", "tenant.delete", "acme", "OK")
    log.close()
    path.write_bytes(path.read_bytes()[:-1])
    for name in ("beta", "gamma"):  # two restarts, an append after each
        log = _log(path)
        log.append("admin", "tenant.create", name, "OK")
        log.close()
    log = _log(path)
    try:
        assert log.verify() == 4
        assert [e.target for e in log.read()] == ["acme", "acme", "beta", "gamma"]
    finally:
        log.close()


def test_a_torn_append_that_could_not_be_cut_is_cut_before_the_next(tmp_path, monkeypatch) -> None:
    path = tmp_path / "audit.log"
    log = _log(path)
    log.append("admin", "tenant.create", "acme", "OK")
    real_write, real_truncate = audit_mod.os.write, audit_mod.os.ftruncate
    monkeypatch.setattr(audit_mod.os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))
    monkeypatch.setattr(audit_mod.os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(OSError("EIO")))
    with pytest.raises(FailedPrecondition):
        log.append("admin", "tenant.create", "beta", "OK")
    monkeypatch.setattr(audit_mod.os, "write", real_write)
    with pytest.raises(IntegrityError, match="torn entry"):  # verify said 1 entry, all well
        log.verify()
    with pytest.raises(FailedPrecondition, match="could not be cut"):  # still cannot cut it
        log.append("admin", "tenant.create", "beta", "OK")
    monkeypatch.setattr(audit_mod.os, "ftruncate", real_truncate)
    assert log.append("admin", "tenant.create", "beta", "OK").seq == 2  # glued on before
    assert log.verify() == 2
    log.close()
    log = _log(path)
    try:
        assert log.verify() == 2
    finally:
        log.close()
