"""Stopping the sidecar while a call is still running, and what a model purge records."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.audit import AuditLog
from kvstore.errors import InvalidArgument
from proto.kvstore.v1 import admin_pb2 as apb
from proto.kvstore.v1 import kvstore_pb2 as pb


class _HeldDelete:
    """``sc.server.store.delete`` held (entered, not returning) until :attr:`go` is set."""

    def __init__(self, monkeypatch, store) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        real = store.delete

        def delete(tenant, keys):
            self.entered.set()
            self.go.wait(30)
            return real(tenant, keys)
        monkeypatch.setattr(store, "delete", delete)


def _entries(sc, action: str) -> list:
    log = AuditLog(sc.server.config.audit_file, clock=time.time)
    try:
        return [e for e in log.read(0, 10_000) if e.action == action]
    finally:
        log.close()


def _delete_in_thread(client, keys) -> list:
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(client.delete(keys))
        except Exception as exc:  # noqa: BLE001 - the stop cancels it
            outcome.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return outcome


def _a_delete_held(tmp_path, monkeypatch, **overrides):
    """A sidecar whose Delete of a stored block is inside the Store, held there."""
    sc = start(tmp_path, **overrides)
    c = sc.tenant("t")
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, keys, random_kv(2))
    held = _HeldDelete(monkeypatch, sc.server.store)
    _delete_in_thread(c, keys[:1])
    assert held.entered.wait(10)
    return sc, held


def test_stop_waits_for_a_running_delete_before_closing_the_audit_log(tmp_path, monkeypatch):
    """grpc's stop cancels a call but not its thread: a delete still in its Store part found the
    audit log closed and its outcome was never recorded (the STARTED entry was closed as
    UNKNOWN at the next open). The server now waits for it (``drain_s``) first."""
    sc, held = _a_delete_held(tmp_path, monkeypatch)
    threading.Timer(0.5, held.go.set).start()  # the delete ends after grpc's stop returned
    sc.stop()
    deletes = _entries(sc, "blocks.delete")
    assert [e.result for e in deletes] == ["STARTED", "OK"]
    assert deletes[1].ref == deletes[0].seq


def test_stop_gives_up_on_a_call_after_drain_s_and_says_so(tmp_path, monkeypatch, caplog):
    sc, held = _a_delete_held(tmp_path, monkeypatch, drain_s=0.3)
    began = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.server"):
            sc.stop()
        took = time.monotonic() - began
    finally:
        held.go.set()
    assert took < 10, f"stop waited {took:.1f} s for a call past drain_s=0.3"
    assert any("1 calls still running" in r.getMessage() for r in caplog.records)


def test_a_model_purge_records_the_fingerprint_the_revision_and_the_count(sidecar):
    """The entry named only the model (``test/model``): which revision was purged, and how much
    went, was not on record."""
    c = sidecar.tenant("p")
    keys = c.block_keys(SPEC, fresh_tokens(3))
    c.put(SPEC, keys, random_kv(3))
    admin = sidecar.admin()
    assert admin.purge_model(SPEC) == 3
    assert admin.purge_model(SPEC.fingerprint) == 0
    purges = [e for e in admin.audit() if e["action"] == "model.purge"]
    assert [e["result"] for e in purges] == ["STARTED", "OK", "STARTED", "OK"]
    assert {e["target"] for e in purges} == {SPEC.fingerprint.hex()}
    assert purges[0]["detail"] == "model=test/model revision=r1"
    assert purges[1]["detail"] == "model=test/model revision=r1 blocks=3"
    assert purges[3]["detail"] == "blocks=0"


def test_a_purge_with_a_malformed_spec_is_refused_and_audited(sidecar):
    admin = sidecar.admin()
    with pytest.raises(InvalidArgument):  # no layers, no heads: not a spec
        admin._call("PurgeModel", apb.PurgeModelRequest(spec=pb.ModelSpec(model="m")))
    purges = [e for e in admin.audit() if e["action"] == "model.purge"]
    assert [e["result"] for e in purges] == ["STARTED", "INVALID_ARGUMENT"]
    assert purges[0]["target"] == "m"
