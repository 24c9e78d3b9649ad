"""What the audit log, the directory lock and the NVMe tier say of odd files at open.

* A line that is JSON but not an entry (``"seq": "7"``) was taken at open: the server started,
  then every audited change failed with gRPC UNKNOWN ("can only concatenate str (not "int")
  to str") and ReadAudit with INTERNAL. It is now refused like any malformed line.
* A directory where the audit log or the lock file goes, or a file where the NVMe directory
  goes, gave a raw IsADirectoryError / FileExistsError traceback; now a FailedPrecondition
  naming the path and what is wrong.
* An outcome record that cannot be written for a reason other than a KVStoreError no longer
  replaces the call's own status with UNKNOWN.
"""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest

from kvstore.audit import AuditLog
from kvstore.dirlock import DirLock
from kvstore.errors import FailedPrecondition, IntegrityError, KVStoreError
from kvstore.service_rpc import _audit_quietly
from tiers.nvme import NVMeTier

GOOD = {"action": "tenant.create", "detail": "", "prev": "0" * 64, "principal": "admin", "ref": 0,
        "result": "OK", "seq": 1, "target": "acme", "time": 1000.0}


def _line(**changes: object) -> bytes:
    entry = {**GOOD, **changes}
    for name, value in changes.items():
        if value is _DROP:
            del entry[name]
    return json.dumps(entry, separators=(",", ":"), sort_keys=True).encode()


_DROP = object()


def _open(path) -> AuditLog:
    return AuditLog(path, clock=lambda: 2000.0, fsync=False)


@pytest.mark.parametrize(("changes", "says"), [
    ({"seq": "7"}, "seq must be an integer, got str '7'"),
    ({"seq": None, "result": "STARTED"}, "seq must be an integer, got NoneType"),
    ({"seq": True}, "seq must be an integer, got bool"),
    ({"seq": 0}, "seq must be in 1..2**63-1"),
    ({"seq": 1 << 64}, "seq must be in 1..2**63-1"),
    ({"time": "yesterday"}, "time must be a number, got str"),
    ({"time": 1e400}, "time must be a finite number"),
    ({"principal": 5}, "principal must be a string, got int"),
    ({"action": ["x"]}, "action must be a string, got list"),
    ({"target": None}, "target must be a string"),
    ({"result": {}}, "result must be a string"),
    ({"detail": 1}, "detail must be a string"),
    ({"prev": 0}, "prev must be a string"),
    ({"ref": "3"}, "ref must be an integer, got str"),
    ({"ref": -1}, "ref must be in 0..2**63-1"),
    ({"extra": 1}, "unknown field(s) extra"),
    ({"target": _DROP}, "missing field(s) target"),
])
def test_a_line_with_a_field_of_the_wrong_type_stops_the_open(tmp_path, changes, says) -> None:
    path = tmp_path / "audit.log"
    log = _open(path)
    log.append("admin", "tenant.create", "first", "OK")
    log.close()
    path.write_bytes(path.read_bytes() + _line(**{"seq": 2, **changes}) + b"\n")
    with pytest.raises(IntegrityError) as err:
        _open(path)
    assert f"{path} has a malformed line 2 (byte " in str(err.value)
    assert says in str(err.value)


def test_a_line_that_is_json_but_not_an_object_stops_the_open(tmp_path) -> None:
    path = tmp_path / "audit.log"
    path.write_bytes(b'[1, 2, 3]\n' + _line() + b"\n")
    with pytest.raises(IntegrityError, match="malformed line 1 .*not a JSON object but a list"):
        _open(path)


def test_lines_that_leave_out_the_optional_fields_still_open(tmp_path) -> None:
    """detail, prev and ref came later: lines of earlier versions lack them."""
    path = tmp_path / "audit.log"
    path.write_bytes(_line(detail=_DROP, prev=_DROP, ref=_DROP, time=1000) + b"\n")
    log = _open(path)
    try:
        [entry] = log.read()
        assert (entry.seq, entry.detail, entry.ref, entry.time) == (1, "", 0, 1000)
        assert log.append("admin", "x", "y", "OK").seq == 2
    finally:
        log.close()


def test_a_torn_last_line_of_the_wrong_type_is_cut_like_any_torn_line(tmp_path) -> None:
    path = tmp_path / "audit.log"
    path.write_bytes(_line() + b"\n" + _line(seq="2"))  # no newline: an append cut short
    log = _open(path)
    try:
        assert [(e.seq, e.action) for e in log.read()] == [(1, "tenant.create"), (2, "audit.recover")]
    finally:
        log.close()


def test_an_audit_log_that_is_a_directory_is_a_failed_precondition(tmp_path) -> None:
    path = tmp_path / "audit.log"
    path.mkdir()
    with pytest.raises(FailedPrecondition, match=f"the audit log {path} is a directory: move it away"):
        _open(path)


def test_an_audit_log_that_is_a_fifo_is_refused_without_opening_it(tmp_path) -> None:
    """Opening a fifo to read waits for a writer: the open would hang, not fail."""
    path = tmp_path / "audit.log"
    os.mkfifo(path)
    outcome: list[Exception | None] = []

    def open_it() -> None:
        try:
            _open(path).close()
            outcome.append(None)
        except (KVStoreError, OSError) as exc:  # handed to the test's thread
            outcome.append(exc)

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(timeout=10)
    if opener.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # lets the waiting open through
        opener.join(timeout=10)
        pytest.fail("the open waited for a writer on the fifo")
    assert outcome and isinstance(outcome[0], FailedPrecondition), outcome
    assert f"the audit log {path} is not a regular file" in str(outcome[0])


def test_an_audit_log_under_a_file_is_a_failed_precondition(tmp_path) -> None:
    (tmp_path / "data").write_text("not a directory")
    with pytest.raises(FailedPrecondition, match=f"{tmp_path / 'data'} is not a directory"):
        _open(tmp_path / "data" / "audit.log")


def test_a_lock_file_that_is_a_directory_is_a_failed_precondition(tmp_path) -> None:
    (tmp_path / "lock").mkdir()
    with pytest.raises(FailedPrecondition, match=f"lock file {tmp_path / 'lock'} is a directory: move it away"):
        DirLock(tmp_path)


def test_the_lock_is_still_taken_and_given_back(tmp_path) -> None:
    lock = DirLock(tmp_path)
    with pytest.raises(FailedPrecondition, match="in use by another kvstore Store"):
        DirLock(tmp_path)
    lock.release()
    DirLock(tmp_path).release()


def test_a_file_where_the_nvme_directory_goes_is_a_failed_precondition(tmp_path) -> None:
    (tmp_path / "nvme").write_text("")
    with pytest.raises(FailedPrecondition, match=f"NVMe tier's directory {tmp_path / 'nvme'} is not a directory"):
        NVMeTier(tmp_path / "nvme", 1 << 20, durable=False)


def test_a_file_where_the_nvme_keys_directory_goes_is_a_failed_precondition(tmp_path) -> None:
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "keys").write_text("")
    with pytest.raises(FailedPrecondition, match=f"{tmp_path / 'nvme' / 'keys'} is not a directory"):
        NVMeTier(tmp_path / "nvme", 1 << 20, durable=False)
    (tmp_path / "nvme" / "keys").unlink()  # and the environment it had opened was closed
    NVMeTier(tmp_path / "nvme", 1 << 20, durable=False).close()


class _BrokenRecorder:
    def end(self, principal: str, result: str) -> None:
        raise TypeError('can only concatenate str (not "int") to str')


def test_an_outcome_record_that_fails_otherwise_is_logged_not_raised(caplog) -> None:
    """Before, only a KVStoreError was caught: the TypeError escaped the handler of the
    failed call, and its client saw UNKNOWN instead of the call's own status."""
    with caplog.at_level(logging.ERROR, logger="kvstore.service_rpc"):
        _audit_quietly(_BrokenRecorder(), "admin", "INVALID_ARGUMENT", "Admin.CreateTenant")  # type: ignore[arg-type]
    assert "Admin.CreateTenant by admin failed with INVALID_ARGUMENT, and its audit record was not written" in caplog.text
    assert "can only concatenate" in caplog.text
