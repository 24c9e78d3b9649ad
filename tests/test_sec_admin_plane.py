"""The admin plane against a hostile caller: bounded audit entries, a ReadAudit that fits the
message limit, a CLI that prints what callers sent without obeying it, complete audit details,
metrics that forget a deleted tenant, and listen addresses parsed as written."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from service_harness import SPEC, fresh_tokens, random_kv, start
from typer.testing import CliRunner

import kvstore.audit as audit_mod
from kvstore import server_config
from kvstore.audit import AuditLog
from kvstore.cli_serve import admin_app
from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted
from kvstore.metrics import ServiceMetrics
from kvstore.metrics_http import serve_metrics
from proto.kvstore.v1 import admin_pb2 as apb
from proto.kvstore.v1 import admin_pb2_grpc

HUGE = 3 << 20  # a name of 3 MiB: fits the server's 4 MiB message limit
FIELD_CHARS = 256  # what the log keeps of a target (kvstore.audit.FIELD_CHARS)
ANONYMOUS_TARGET_CHARS = 64  # ... of an unauthenticated call's target


def _stub(sidecar, token: str):
    channel = grpc.insecure_channel(sidecar.target, options=[("grpc.max_send_message_length", 8 << 20)])
    return channel, admin_pb2_grpc.AdminStub(channel), (("authorization", f"Bearer {token}"),)


def _log_bytes(sidecar) -> int:
    return sidecar.server.config.audit_file.stat().st_size


# -- 3. the audit log and ReadAudit are bounded ------------------------------------------------------
def test_an_unauthenticated_call_with_a_huge_name_adds_a_small_entry(sidecar):
    channel, stub, md = _stub(sidecar, "kvs_not-a-token")
    before = _log_bytes(sidecar)
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.RotateToken(apb.TenantName(name="x" * HUGE), metadata=md, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _log_bytes(sidecar) - before < 1024
    last = sidecar.admin().audit()[-1]
    assert (last["principal"], last["action"], last["result"]) == ("?", "tenant.rotate", "UNAUTHENTICATED")
    assert last["target"] == "x" * ANONYMOUS_TARGET_CHARS + f"…({HUGE} bytes)"


def test_an_admin_call_with_a_huge_name_is_recorded_cut_with_its_length(sidecar):
    channel, stub, md = _stub(sidecar, sidecar.admin_token)
    before = _log_bytes(sidecar)
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.CreateTenant(apb.CreateTenantRequest(name="é" * (1 << 20), namespaces=["n" * (1 << 20)]),
                          metadata=md, timeout=30)
    # NOTE: the error echoed the whole name: too large for the trailers, it arrived as
    # RESOURCE_EXHAUSTED "Stream removed" in place of the bad name's own status
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bad name" in err.value.details() and len(err.value.details()) <= 1024
    assert _log_bytes(sidecar) - before < 16 * 1024  # two entries (STARTED, outcome)
    entries = sidecar.admin().audit()  # and the log reads back
    assert [e["result"] for e in entries[-2:]] == ["STARTED", "INVALID_ARGUMENT"]
    assert all(e["target"] == "é" * FIELD_CHARS + f"…({2 << 20} bytes)" for e in entries[-2:])
    assert all(len(e["detail"]) < 1100 for e in entries[-2:])
    assert sidecar.server.audit.verify() == entries[-1]["seq"]


def _grow(log: AuditLog, n: int) -> None:
    """``n`` entries of about 300 bytes each."""
    for i in range(n):
        log.append("admin", "policy.set", f"t{i}-" + "p" * FIELD_CHARS, "OK")


def test_read_audit_pages_a_log_larger_than_the_message_limit(tmp_path):
    """ReadAudit answered "message too large" once the entries asked for passed the limit."""
    sc = start(tmp_path, limits={"max_message_bytes": 64 * 1024, "chunk_bytes": 32 * 1024,
                                 "max_keys_per_call": 1024})
    try:
        _grow(sc.server.audit, 600)  # ~180 KiB of entries
        admin = sc.admin()
        everything = admin.audit(0, 1000)
        assert [e["seq"] for e in everything] == list(range(1, 601))
        page, more = admin.audit_page(0, 1000)
        assert more and 0 < len(page) < 600
        assert [e["seq"] for e in page] == list(range(1, len(page) + 1))
        assert [e["seq"] for e in admin.audit(0, 450)] == list(range(1, 451))
        assert admin.audit_page(600, 10) == ([], False)
    finally:
        sc.stop()


def test_read_audit_fits_the_callers_receive_limit(sidecar):
    """The server's limit (4 MiB) is not the client's: the client says how much it takes."""
    from kvstore.admin_client import AdminClient

    _grow(sidecar.server.audit, 900)  # ~270 KiB
    with AdminClient(sidecar.target, sidecar.admin_token, max_message_bytes=128 * 1024) as admin:
        page, more = admin.audit_page(0, 1000)
        assert more and len(page) < 900
        assert len(admin.audit(0, 1000)) == 900
    channel, stub, md = _stub(sidecar, sidecar.admin_token)
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.ReadAudit(apb.ReadAuditRequest(max_bytes=1000), metadata=md, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at least 65536" in err.value.details()


def test_entries_written_unbounded_by_an_earlier_version_are_read_cut(sidecar, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(audit_mod, "bounded", lambda value, limit=0: value)  # as before the bound
        for _ in range(3):
            sidecar.server.audit.append("admin", "tenant.rotate", "y" * HUGE, "NOT_FOUND")
    entries = sidecar.admin().audit()
    assert len(entries) == 3
    assert all(e["target"] == "y" * FIELD_CHARS + f"…({HUGE} bytes)" for e in entries)


def test_a_long_error_message_is_cut_to_fit_the_status_details():
    from kvstore.status import MAX_DETAILS, to_status

    code, message = to_status(InvalidArgument("y" * 100_000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(message) <= MAX_DETAILS and message.endswith("…(100000 chars)")
    assert to_status(InvalidArgument("short"))[1] == "short"


def test_bounded_is_idempotent_and_leaves_short_values():
    assert audit_mod.bounded("acme") == "acme"
    cut = audit_mod.bounded("z" * 10_000)
    assert cut == "z" * FIELD_CHARS + "…(10000 bytes)"
    assert audit_mod.bounded(cut) == cut


# -- 4. the CLI prints audit entries, never obeys them -----------------------------------------------
def test_cli_audit_table_shows_markup_and_escape_sequences_as_text(sidecar):
    admin = sidecar.admin()
    for name in ("[red]x", "evil\x1b[2J\x1b]0;pwned\x07", "rtl\u202eexe.txt"):
        with pytest.raises(KVStoreError):  # no such (well-formed) name
            admin.rotate_token(name)
    result = CliRunner().invoke(admin_app, ["audit", "--target", sidecar.target, "--token", sidecar.admin_token],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "[red]x" in out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "evil\\x1b[2J\\x1b]0;pwned\\x07" in out
    assert "rtl\\u202eexe.txt" in out


def test_cli_errors_show_control_characters_escaped():
    from kvstore.cli_serve import _shown

    assert _shown("a\x1b[31mb\r\n[bold]c") == "a\\x1b[31mb\\x0d\\x0a\\[bold]c"


# -- 6. the audit entries of changes say what was granted ---------------------------------------------
def test_tenant_create_grant_and_policy_entries_record_what_was_given(sidecar):
    admin = sidecar.admin()
    admin.create_tenant("pub", "publisher", ["shared:docs"])
    admin.create_tenant("reader")
    admin.grant("reader", "shared:docs")
    admin.grant("reader", "shared:docs", revoke=True)
    admin.set_policy("reader", ttl_s=30.0, quota_bytes={"hbm": 1 << 20}, priority=2)
    details = [(e["action"], e["target"], e["result"], e["detail"]) for e in admin.audit()]
    assert ("tenant.create", "pub", "OK", "role=publisher namespaces=[shared:docs]") in details
    assert ("tenant.create", "pub", "STARTED", "role=publisher namespaces=[shared:docs]") in details
    assert ("tenant.create", "reader", "OK", "role=tenant namespaces=[]") in details
    assert ("namespace.grant", "reader shared:docs", "OK", "namespaces [] -> [shared:docs]") in details
    assert ("namespace.revoke", "reader shared:docs", "OK", "namespaces [shared:docs] -> []") in details
    assert ("policy.set", "reader", "OK",
            "ttl_s=None quota={} priority=0 -> ttl_s=30.0 quota={hbm=1048576} priority=2") in details


# -- 7. a deleted tenant's quota rejections go with it ------------------------------------------------
def test_forget_tenant_drops_its_quota_rejection_series_only():
    m = ServiceMetrics(CollectorRegistry())
    for resource in ("quota:acme:hbm", "quota:acme:nvme", "quota:acme2:hbm", "quota:shared:acme:hbm", "hbm"):
        m.rejections.labels(resource=resource).inc()
    m.forget_tenant("acme")
    text = generate_latest(m.registry).decode()
    assert "quota:acme:" not in text
    for kept in ("quota:acme2:hbm", "quota:shared:acme:hbm", 'resource="hbm"'):
        assert kept in text
    m.forget_tenant("shared:acme")
    assert "quota:shared:acme:" not in generate_latest(m.registry).decode()


def test_deleting_a_tenant_drops_its_quota_rejections_from_the_endpoint(sidecar):
    admin = sidecar.admin()
    c = sidecar.tenant("capped")
    admin.set_policy("capped", quota_bytes={"hbm": 1, "dram": 1, "nvme": 1})
    with pytest.raises(ResourceExhausted):
        c.put(SPEC, c.block_keys(SPEC, fresh_tokens(1)), random_kv(1))
    assert 'resource="quota:capped:' in generate_latest(sidecar.server.metrics_registry).decode()
    admin.delete_tenant("capped")
    text = generate_latest(sidecar.server.metrics_registry).decode()
    # NOTE: the tenant as a label value or in a resource label, not the word: the Store's
    # counters exist from the start now, kvstore_store_counters_ttl_capped among them
    assert '"capped"' not in text and "quota:capped:" not in text


# -- 9. listen addresses: IPv6 in brackets -------------------------------------------------------------
def test_metrics_serve_on_a_bracketed_ipv6_address():
    server = serve_metrics(CollectorRegistry(), "[::1]:0")
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        server.shutdown()


def test_a_sidecar_serves_metrics_on_ipv6_loopback(tmp_path):
    sc = start(tmp_path, metrics={"enabled": True, "listen": "[::1]:0", "auth": "none"})
    try:
        port = sc.server._metrics_http.server_address[1]
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as r:
            assert b"kvstore_store_" in r.read()
    finally:
        sc.stop()


@pytest.mark.parametrize("listen, says", [
    ("::1:9400", "an IPv6 address goes in brackets"),
    ("[::1:9400", "not an IPv6 address in brackets"),
    ("[nothost]:9400", "not an IPv6 address in brackets"),
    ("[::1]x:9400", "not an IPv6 address in brackets"),
    ("unix:/tmp/metrics.sock", "not a unix socket"),
])
def test_a_metrics_address_that_cannot_be_served_is_refused_at_load(tmp_path, listen, says):
    with pytest.raises(InvalidArgument, match="metrics.listen") as err:
        server_config.build({"metrics": {"listen": listen}}, data_dir=tmp_path)
    assert says in str(err.value)
    assert "\n" not in str(err.value)


def test_split_host_port():
    assert server_config.split_host_port("[::1]:9400") == ("::1", 9400)
    assert server_config.split_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert server_config.split_host_port("localhost:80") == ("localhost", 80)
    assert json.dumps(server_config.build({"listen": "[::]:50551"}, data_dir=None).listen) == '"[::]:50551"'
