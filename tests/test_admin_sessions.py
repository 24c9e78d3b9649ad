"""The operators' view of sessions and of deletions in progress (Admin ListSessions,
CloseSession, ListTenants; ``kvstore session list|close``, ``kvstore tenant list``).

* An engine that died left its session pinning HBM until the idle expiry (``session_idle_close_s``,
  a day by default), and no operator could see it or end it: other tenants' session puts were
  refused meanwhile. ListSessions shows every open session (state, blocks held and pinned,
  idle time); CloseSession closes one, audited with what it released.
* ``tenant list`` left out a principal marked as being deleted: a deletion in progress, or one a
  failed step left unfinished (its blocks still there), showed as done.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from service_harness import SPEC, fresh_tokens, random_kv, start
from typer.testing import CliRunner

from kvstore.admin_client import AdminClient
from kvstore.block import SessionState
from kvstore.cli_serve import admin_app
from kvstore.errors import KVStoreError, NotFound, PermissionDenied, ResourceExhausted, Unavailable
from kvstore.sizes import format_size

B = SPEC.block_nbytes


@pytest.fixture
def sidecar(tmp_path):
    # HBM holds 4 blocks: a session of 4 pins all of it
    sc = start(tmp_path, store={"hbm_bytes": 4 * B, "dram_bytes": 8 * B, "nvme_bytes": 64 * B})
    yield sc
    sc.stop()


def _session_of(sc, tenant: str, sid: str, n: int):
    """Tenant ``tenant`` (created) with session ``sid`` open and ``n`` blocks put in it."""
    c = sc.tenant(tenant, local=False)
    c.open_session(sid)
    keys = c.block_keys(SPEC, fresh_tokens(n))
    c.put(SPEC, keys, random_kv(n), session=sid)
    return c, keys


def _cli(sc, *args: str):
    return CliRunner().invoke(admin_app, [*args, "--target", sc.target, "--token", sc.admin_token],
                              env={"COLUMNS": "200"})


def test_list_sessions_shows_each_open_session_with_its_state_pins_and_idle_time(sidecar):
    _session_of(sidecar, "a", "chat", 3)
    b, _ = _session_of(sidecar, "b", "tool", 1)
    b.pause_session("tool")
    sidecar.clock.now += 42

    sessions = sidecar.admin().list_sessions()
    assert sessions == [
        {"tenant": "a", "session_id": "chat", "state": "active", "blocks": 3, "bytes": 3 * B,
         "pinned_blocks": 3, "pinned_bytes": 3 * B, "idle_s": 42.0, "only_pinned_blocks": 3,
         "only_pinned_bytes": 3 * B},
        {"tenant": "b", "session_id": "tool", "state": "paused", "blocks": 1, "bytes": B,
         "pinned_blocks": 0, "pinned_bytes": 0, "idle_s": 42.0, "only_pinned_blocks": 0, "only_pinned_bytes": 0},
    ]
    assert [s["session_id"] for s in sidecar.admin().list_sessions("b")] == ["tool"]
    assert sidecar.admin().list_sessions("nobody") == []
    # a look is no use: the idle time (and so the idle expiry) runs on
    sidecar.clock.now += 8
    assert [s["idle_s"] for s in sidecar.admin().list_sessions()] == [50.0, 50.0]


def test_list_sessions_reads_every_page(tmp_path, monkeypatch):
    """Sessions past one response's size come in further pages, in order, none twice."""
    sc = start(tmp_path, limits={"max_session_id_bytes": 4096})
    try:
        c = sc.tenant("many", local=False)
        ids = [f"s{i:02d}-" + "x" * 4000 for i in range(40)]  # 160 KB of ids
        for sid in ids:
            c.open_session(sid)
        pages = []
        real = type(sc.server.store).session_ids

        def counted(self, tenant=None):
            pages.append(tenant)
            return real(self, tenant)
        monkeypatch.setattr(type(sc.server.store), "session_ids", counted)
        admin = AdminClient(sc.target, sc.admin_token, max_message_bytes=64 * 1024)  # pages of 64 KiB
        try:
            got = admin.list_sessions()
        finally:
            admin.close()
        assert [s["session_id"] for s in got] == ids
        assert pages == [None, None, None]  # 15 + 15 + 10
    finally:
        sc.stop()


def test_close_session_releases_its_pins_for_another_tenants_session(sidecar):
    _session_of(sidecar, "dead", "chat", 4)  # its engine dies now, the session left open
    b = sidecar.tenant("b", local=False)
    b.open_session("s")
    kb = b.block_keys(SPEC, fresh_tokens(1))
    with pytest.raises(ResourceExhausted):
        b.put(SPEC, kb, random_kv(1), session="s")  # HBM is pinned whole by dead's session

    closed = sidecar.admin().close_session("dead", "chat")
    assert closed == {"tenant": "dead", "session_id": "chat", "state": "active", "blocks": 4, "bytes": 4 * B,
                      "pinned_blocks": 4, "pinned_bytes": 4 * B, "idle_s": 0.0, "only_pinned_blocks": 4,
                      "only_pinned_bytes": 4 * B}
    assert [s["tenant"] for s in sidecar.admin().list_sessions()] == ["b"]
    b.put(SPEC, kb, random_kv(1), session="s")  # the room it pinned is free
    assert sidecar.admin().stats()["counters"]["sessions_admin_closed"] == 1

    entries = [e for e in sidecar.admin().audit() if e["action"] == "session.close"]
    assert [(e["principal"], e["target"], e["result"]) for e in entries] == [
        ("admin", "dead chat", "STARTED"), ("admin", "dead chat", "OK")]
    assert entries[1]["ref"] == entries[0]["seq"]
    assert entries[1]["detail"] == f"state=active blocks=4 bytes={4 * B} pinned=4 freed=4 idle_s=0.0"


def test_closing_one_of_two_sessions_sharing_a_prefix_says_the_shared_blocks_stay_pinned(sidecar):
    """Two sessions of a tenant put the same prefix (a shared system prompt): each pins it.
    Closing one frees no HBM; it said all its blocks were unpinned (pinned=4 in a 4-block HBM
    for each session, and the audit too), while the other session still held them."""
    c, keys = _session_of(sidecar, "a", "conv1", 3)
    c.open_session("conv2")
    c.put(SPEC, keys[:2], random_kv(2), session="conv2")  # the first two blocks: now pinned twice
    listed = {s["session_id"]: s for s in sidecar.admin().list_sessions("a")}
    assert (listed["conv1"]["pinned_blocks"], listed["conv1"]["only_pinned_blocks"]) == (3, 1)
    assert (listed["conv2"]["pinned_blocks"], listed["conv2"]["only_pinned_blocks"]) == (2, 0)
    assert listed["conv1"]["only_pinned_bytes"] == B

    result = _cli(sidecar, "session", "close", "a", "conv1")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.split())
    assert said == (f"closed session conv1 of a (active): 1 blocks ({format_size(B)}) of HBM unpinned, of 3 held; "
                    f"2 stay pinned by other sessions")
    assert [sidecar.server.store._index.get("a", k).pins for k in keys] == [1, 1, 0]
    detail = [e for e in sidecar.admin().audit() if e["action"] == "session.close"][-1]["detail"]
    assert "pinned=3 freed=1" in detail


def test_closing_an_unknown_session_is_not_found_and_audited(sidecar):
    sidecar.tenant("a", local=False)
    with pytest.raises(NotFound, match="no open session 'gone' in 'a'"):
        sidecar.admin().close_session("a", "gone")
    entries = [e for e in sidecar.admin().audit() if e["action"] == "session.close"]
    assert [(e["target"], e["result"]) for e in entries] == [("a gone", "STARTED"), ("a gone", "NOT_FOUND")]


def test_a_tenant_token_cannot_list_or_close_sessions(sidecar):
    _session_of(sidecar, "a", "chat", 1)
    as_tenant = AdminClient(sidecar.target, sidecar.admin().create_tenant("nosy"))
    try:
        with pytest.raises(PermissionDenied):
            as_tenant.list_sessions()
        with pytest.raises(PermissionDenied):
            as_tenant.close_session("a", "chat")
    finally:
        as_tenant.close()
    assert [s["state"] for s in sidecar.admin().list_sessions()] == ["active"]  # still open
    refused = [(e["action"], e["target"], e["result"]) for e in sidecar.admin().audit() if e["principal"] == "nosy"]
    assert refused == [("session.list", "", "PERMISSION_DENIED"), ("session.close", "a chat", "PERMISSION_DENIED")]


def test_tenant_list_shows_a_principal_marked_deleting(sidecar, monkeypatch):
    c = sidecar.client(sidecar.admin().create_tenant("acme"))
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, keys, random_kv(2))

    def failing(self, tenant, **kw):
        raise Unavailable("the remote tier cannot be reached")
    monkeypatch.setattr(type(sidecar.server.store), "drop_tenant", failing)
    with pytest.raises(KVStoreError):
        sidecar.admin().delete_tenant("acme")  # marked, its data still there
    monkeypatch.undo()

    rows = {t["name"]: t for t in sidecar.admin().list_tenants()}
    assert rows["acme"]["deleting"] is True and rows["acme"]["role"] == "tenant"
    assert rows["admin"]["deleting"] is False
    result = _cli(sidecar, "tenant", "list")
    assert result.exit_code == 0, result.output
    states = {line.split("\t")[0]: line.split("\t")[4] for line in result.stdout.splitlines()[1:]}
    assert states["acme"] == "deleting" and states["admin"] == "live"

    sidecar.admin().delete_tenant("acme")  # run again: finished, and gone from the list
    assert "acme" not in [t["name"] for t in sidecar.admin().list_tenants()]


def test_cli_session_list_and_close(sidecar):
    _session_of(sidecar, "dead", "chat", 2)
    result = _cli(sidecar, "session", "list")
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if "chat" in line)
    two = format_size(2 * B)
    assert row.split("\t") == ["dead", "chat", "active", "2", two, "2", two, two, "0.0 s"]  # piped: one line

    result = _cli(sidecar, "session", "list", "--tenant", "dead", "--json")
    assert result.exit_code == 0, result.output
    assert [(s["tenant"], s["session_id"], s["pinned_blocks"]) for s in json.loads(result.stdout)] == [
        ("dead", "chat", 2)]

    result = _cli(sidecar, "session", "close", "dead", "chat")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.split())
    assert said == f"closed session chat of dead (active): 2 blocks ({two}) of HBM unpinned, of 2 held"
    assert sidecar.admin().list_sessions() == []

    result = _cli(sidecar, "session", "close", "dead", "chat")
    assert result.exit_code == 1
    assert "error (NOT_FOUND): no open session 'chat' in 'dead'" in " ".join(result.stderr.split())


def test_store_session_info_is_no_use_and_end_session_unpins(sidecar):
    _, keys = _session_of(sidecar, "a", "chat", 2)
    store = sidecar.server.store
    info = store.session_info("a", "chat")
    assert info is not None and info.state is SessionState.ACTIVE and info.pinned_blocks == 2
    assert store.session_info("a", "nope") is None
    store.end_session("a", "chat")
    assert [store._index.get("a", k).pins for k in keys] == [0, 0]


def test_tenant_list_names_a_principal_once_while_its_deletion_begins(sidecar, monkeypatch):
    """ListTenants read the live principals and those being deleted by two calls: a deletion
    marked between them (here: while the live ones are encoded, as with many principals) listed
    its principal twice, live and deleting. Both are read at one moment now."""
    from kvstore import servicer_admin

    sidecar.admin().create_tenant("acme")
    real_pb = servicer_admin._tenant_pb
    encoding = threading.Event()

    def slow_pb(p, **kw):
        if not kw.get("deleting"):
            encoding.set()
            time.sleep(0.3)
        return real_pb(p, **kw)
    monkeypatch.setattr(servicer_admin, "_tenant_pb", slow_pb)
    store_cls = type(sidecar.server.store)
    real_remove = store_cls._remove_tenant_blocks

    def slow_remove(self, tenant):  # the deletion stays marked while the list is answered
        time.sleep(1.0)
        return real_remove(self, tenant)
    monkeypatch.setattr(store_cls, "_remove_tenant_blocks", slow_remove)

    listed: list = []
    lister = threading.Thread(target=lambda: listed.append(sidecar.admin().list_tenants()))
    lister.start()
    assert encoding.wait(10)
    deleter = threading.Thread(target=lambda: sidecar.admin().delete_tenant("acme"))
    deleter.start()
    lister.join(30)
    deleter.join(30)
    names = [t["name"] for t in listed[0]]
    assert sorted(names) == sorted(set(names)) and "acme" in names


def test_the_longest_session_id_the_config_allows_is_listed_and_a_longer_limit_is_refused(tmp_path):
    """A config could allow session ids as long as a message: one such session made every
    unfiltered ListSessions fail in grpc ("Sent message larger than max"), hiding every other
    tenant's sessions. The limit must leave 1 KiB of max_message_bytes now."""
    from pydantic import ValidationError

    from kvstore.server_config import LimitsConfig

    limit = 64 * 1024
    with pytest.raises(ValidationError, match="max_session_id_bytes=65536 does not fit.*at most 64512"):
        LimitsConfig(max_message_bytes=limit, chunk_bytes=32 * 1024, max_session_id_bytes=limit)
    longest = limit - 1024
    sc = start(tmp_path, limits={"max_message_bytes": limit, "chunk_bytes": 32 * 1024, "max_keys_per_call": 1024,
                                 "max_session_id_bytes": longest})
    try:
        name = "t" * 63  # the longest tenant name
        sc.tenant(name, local=False).open_session("x" * longest)
        sc.tenant("b", local=False).open_session("short")
        admin = AdminClient(sc.target, sc.admin_token, max_message_bytes=limit)
        try:
            assert [(s["tenant"], len(s["session_id"])) for s in admin.list_sessions()] == [
                ("b", 5), (name, longest)]
        finally:
            admin.close()
    finally:
        sc.stop()
