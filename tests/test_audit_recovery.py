"""The audit log after a crash: an append cut short (a power cut between the write and its
fsync) must not stop the server from starting, and must not pass unnoticed either."""

from __future__ import annotations

import json

import pytest

from kvstore.audit import AuditLog
from kvstore.errors import IntegrityError


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
