"""A rotated audit log is refused when read, not shown as empty.

The server appends through the file it opened at start and read the log by name: after a
rotation that renames the file and creates a new one (logrotate's default), ``kvstore audit``
showed an empty log, exit 0, while every new entry went on into the renamed file; after one
that truncates in place (copytruncate), the newest entries read as empty too. The log is one
hash chain: it cannot be rotated while the server runs, and a read says so."""

from __future__ import annotations

import os

import pytest
from service_harness import start

from kvstore.audit import AuditLog
from kvstore.errors import FailedPrecondition


def _log(tmp_path, n: int = 5) -> AuditLog:
    log = AuditLog(tmp_path / "audit.log", clock=lambda: 1000.0, fsync=False)
    for i in range(n):
        log.append("admin", "tenant.create", f"t{i}", "OK")
    return log


def test_a_log_renamed_and_replaced_under_the_server_is_refused_on_read(tmp_path):
    log = _log(tmp_path)
    assert [e.target for e in log.read()] == [f"t{i}" for i in range(5)]
    os.rename(log.path, tmp_path / "audit.log.1")
    log.path.write_bytes(b"")
    with pytest.raises(FailedPrecondition, match="no longer the file this server appends to.*cannot be rotated"):
        log.read()
    log.append("admin", "tenant.create", "after", "OK")  # kept: in the file the server opened
    assert (tmp_path / "audit.log.1").read_text().count('"after"') == 1
    log.close()


def test_a_log_truncated_in_place_is_refused_on_read(tmp_path):
    log = _log(tmp_path)
    os.truncate(log.path, 0)
    with pytest.raises(FailedPrecondition, match="was cut to 0 bytes.*cannot be rotated"):
        log.page(3, 10)
    log.close()


def test_read_audit_of_a_rotated_log_is_failed_precondition(tmp_path):
    from kvstore.admin_client import AdminClient  # noqa: F401 - the sidecar's admin client

    sc = start(tmp_path)
    try:
        sc.admin().create_tenant("a")
        path = sc.server.config.audit_file
        os.rename(path, path.with_name("audit.log.1"))
        path.write_bytes(b"")
        with pytest.raises(FailedPrecondition, match="cannot be rotated while the server runs"):
            sc.admin().audit()
    finally:
        sc.stop()
