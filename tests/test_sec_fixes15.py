"""Session 15's security fixes: a put racing a shared namespace's wipe, the audit of deletions
and of refused admin reads, an unknown role, and what a refused session put tells a tenant."""

from __future__ import annotations

import pytest
import torch
from service_harness import SPEC, HeldPut, fresh_tokens, random_kv

from kvstore import errors

torch.set_num_threads(1)


class _InNamespace:
    """A client whose ``put`` writes into ``namespace`` (for :class:`HeldPut`)."""

    def __init__(self, client, namespace: str) -> None:
        self.client, self.namespace = client, namespace

    def put(self, spec, keys, kv):
        return self.client.put(spec, keys, kv, namespace=self.namespace)


# -- 1: a put racing an admin's drop of a shared namespace's blocks ----------------------------
def test_a_put_racing_a_shared_namespace_drop_is_aborted_and_a_retry_stores(sidecar, monkeypatch):
    """DeleteTenant of ``shared:x`` drops its blocks; the namespace, its publishers and grants
    stay. A publisher's put under way failed UNAUTHENTICATED "tenant was deleted", though its
    token was valid and the same put made again succeeded: it is ABORTED now, saying to retry."""
    admin = sidecar.admin()
    pub = sidecar.client(admin.create_tenant("pub", "publisher", ["shared:x"]), local=False)
    keys = pub.block_keys(SPEC, fresh_tokens(2), namespace="shared:x")
    kv = random_kv(2)
    held = HeldPut(monkeypatch, _InNamespace(pub, "shared:x"), SPEC, keys, kv)
    admin.delete_tenant("shared:x")
    outcome = held.finish()
    monkeypatch.undo()
    assert getattr(outcome, "code", None) == "ABORTED", outcome
    assert not isinstance(outcome, errors.Unauthenticated)
    assert "dropped" in str(outcome) and "retry" in str(outcome)
    assert pub.lookup(SPEC, keys, namespace="shared:x").num_blocks == 0  # nothing was stored
    pub.put(SPEC, keys, kv, namespace="shared:x")
    assert pub.lookup(SPEC, keys, namespace="shared:x").num_blocks == 2


def test_a_reservation_before_a_drop_is_aborted_when_the_namespace_stays(open_store, spec):
    """In-process: a reservation made before ``drop_tenant(namespace_stays=True)`` fails its
    commit with Aborted; before a plain ``drop_tenant`` (the tenant deleted) Unauthenticated."""
    s = open_store(spec)
    for stays, expected in ((True, "ABORTED"), (False, "UNAUTHENTICATED")):
        name = "shared:x" if stays else "gone"
        keys = s.block_keys(name, spec, list(range(spec.block_tokens * 2)))
        since = s.drop_epoch
        res = s.reserve_put(name, spec, keys, since=since)
        s.drop_tenant(name, namespace_stays=True) if stays else s.drop_tenant(name)
        kv = random_kv(2, spec).contiguous().view(torch.uint8).reshape(2, -1).numpy()
        with pytest.raises(errors.KVStoreError) as err:
            s.commit_put(res, kv.__getitem__)
        assert err.value.code == expected
        with pytest.raises(errors.KVStoreError) as err:  # a reservation after the epoch read, too
            s.reserve_put(name, spec, keys, since=since)
        assert err.value.code == expected
        assert s.lookup(name, spec, keys).num_blocks == 0


def test_aborted_travels_as_its_own_typed_error():
    import grpc

    from kvstore.status import from_rpc_error, to_status

    assert to_status(errors.Aborted("retry"))[0] == grpc.StatusCode.ABORTED

    class _Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.ABORTED

        def details(self):
            return "retry"

    assert isinstance(from_rpc_error(_Err()), errors.Aborted)


# -- 3: refused admin reads are recorded; an unknown role is refused ----------------------------
def _admin_stub(sidecar):
    import grpc

    from proto.kvstore.v1 import admin_pb2_grpc

    ch = grpc.insecure_channel(sidecar.target)
    return ch, admin_pb2_grpc.AdminStub(ch)


def test_refused_reads_of_the_audit_log_and_stats_are_recorded(sidecar):
    """A tenant calling Admin ReadAudit or Stats got PERMISSION_DENIED and nothing was recorded
    (a refused DeleteTenant was): both are recorded now, as outcome entries, and so are
    unauthenticated attempts (principal ``?``); an admin's reads still do not grow the log."""
    import grpc

    from proto.kvstore.v1 import admin_pb2 as apb
    from proto.kvstore.v1 import kvstore_pb2 as pb

    admin = sidecar.admin()
    token = admin.create_tenant("alice")
    ch, stub = _admin_stub(sidecar)
    try:
        for md, code in (([("authorization", "Bearer " + token)], grpc.StatusCode.PERMISSION_DENIED),
                         ([("authorization", "Bearer kvs_not_a_token")], grpc.StatusCode.UNAUTHENTICATED)):
            for call, req in ((stub.ReadAudit, apb.ReadAuditRequest()), (stub.Stats, pb.StatsRequest())):
                with pytest.raises(grpc.RpcError) as err:
                    call(req, metadata=md, timeout=10)
                assert err.value.code() == code
    finally:
        ch.close()
    entries = admin.audit()
    refused = [(e["principal"], e["action"], e["result"]) for e in entries
               if e["action"] in ("audit.read", "stats.read")]
    assert refused == [("alice", "audit.read", "PERMISSION_DENIED"), ("alice", "stats.read", "PERMISSION_DENIED"),
                       ("?", "audit.read", "UNAUTHENTICATED"), ("?", "stats.read", "UNAUTHENTICATED")]
    assert all(e["ref"] == 0 for e in entries if e["action"] in ("audit.read", "stats.read"))  # outcome only
    admin.stats()
    assert len(admin.audit()) == len(entries)  # an admin's reads are not recorded


def test_create_tenant_with_an_unknown_role_is_invalid_argument(sidecar):
    """role=99 created a full tenant (an unknown value fell back to ROLE_TENANT)."""
    import grpc

    from proto.kvstore.v1 import admin_pb2 as apb

    admin = sidecar.admin()
    ch, stub = _admin_stub(sidecar)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateTenant(apb.CreateTenantRequest(name="weird", role=99),
                              metadata=[("authorization", "Bearer " + sidecar.admin_token)], timeout=10)
    finally:
        ch.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "role" in err.value.details() and "99" in err.value.details()
    assert "weird" not in [t["name"] for t in admin.list_tenants()]
    outcome = [e for e in admin.audit() if e["action"] == "tenant.create" and e["target"] == "weird"][-1]
    assert outcome["result"] == "INVALID_ARGUMENT" and "role=99" in outcome["detail"]
    assert admin.create_tenant("plain")  # ROLE_UNSPECIFIED is still a tenant
    assert [t["role"] for t in admin.list_tenants() if t["name"] == "plain"] == ["tenant"]


# -- 2: the audit of a deletion says what it removed -------------------------------------------
def test_a_delete_records_how_many_blocks_it_removed(sidecar):
    """A Delete of 1 key removing 5 blocks (its descendants go with it) was recorded as
    ``'1 keys'``: its outcome entry says ``blocks=5`` now, as a model purge's does."""
    a = sidecar.tenant("alice", local=False)
    keys = a.block_keys(SPEC, fresh_tokens(5))
    a.put(SPEC, keys, random_kv(5))
    assert a.delete(keys[:1]) == 5
    entries = [e for e in sidecar.admin().audit() if e["action"] == "blocks.delete"]
    assert [(e["result"], e["detail"]) for e in entries] == [("STARTED", "1 keys"), ("OK", "1 keys blocks=5")]


def test_a_delete_with_a_bad_token_is_recorded_as_an_admin_call_is(sidecar):
    """An Admin call with a bad token was recorded (principal ``?``); a Delete with one left
    no trace."""
    from kvstore.client import Client

    with Client(sidecar.target, "kvs_not_a_token", local=False) as c, pytest.raises(errors.Unauthenticated):
        c.delete([bytes(32)], namespace="alice")
    entries = [e for e in sidecar.admin().audit() if e["action"] == "blocks.delete"]
    assert [(e["principal"], e["target"], e["result"], e["ref"]) for e in entries] == [
        ("?", "alice", "UNAUTHENTICATED", 0)]


# -- 4: a refused session put does not tell a tenant what others hold pinned --------------------
def _refused_session_put(s, spec, tenant: str, n: int, start: int) -> errors.ResourceExhausted:
    s.open_session(tenant, f"probe{start}")
    keys = s.block_keys(tenant, spec, list(range(start, start + n * spec.block_tokens)))
    with pytest.raises(errors.ResourceExhausted) as err:
        s.put(tenant, spec, keys, random_kv(n, spec), session=f"probe{start}")
    s.close_session(tenant, f"probe{start}")
    return err.value


def test_a_refused_session_put_does_not_say_what_other_tenants_pin(open_store, spec):
    """Bob's refused session put said "only 8 could be made" with alice's 2 blocks pinned and
    "only 4" with 6: another tenant's session use, which Stats hides from him. The message is
    the same whatever alice pins now, and still says why and what to do."""
    s = open_store(spec, hbm_blocks=10, dram_blocks=10, nvme_blocks=64, high_watermark=1.0, low_watermark=1.0)
    seen = []
    for i, pinned in enumerate((2, 6)):
        s.open_session("alice", f"s{i}")
        keys = s.block_keys("alice", spec, list(range(10_000 * (i + 1), 10_000 * (i + 1) + pinned * spec.block_tokens)))
        s.put("alice", spec, keys, random_kv(pinned, spec), session=f"s{i}")
        err = _refused_session_put(s, spec, "bob", 10, 100_000)
        assert err.resource == "hbm"
        seen.append(str(err))
        s.close_session("alice", f"s{i}")
    assert seen[0] == seen[1], seen
    assert "could be made" not in seen[0] and "pinned (session)" in seen[0] and "nothing was evicted" in seen[0]
    assert "8" not in seen[0].replace(str(spec.block_nbytes), "")


def test_a_refused_session_put_names_the_tenants_own_quota_when_it_binds(open_store, spec):
    """When the tenant's own quota is what refuses it, the message names that quota and what the
    tenant holds (its own numbers)."""
    n = spec.block_nbytes
    s = open_store(spec, hbm_blocks=10, dram_blocks=10, nvme_blocks=64, high_watermark=1.0, low_watermark=1.0)
    s.set_tenant_policy("bob", quota_bytes={"hbm": 5 * n})
    s.open_session("bob", "mine")
    keys = s.block_keys("bob", spec, list(range(20_000, 20_000 + 2 * spec.block_tokens)))
    s.put("bob", spec, keys, random_kv(2, spec), session="mine")
    err = _refused_session_put(s, spec, "bob", 4, 200_000)
    assert err.resource == "quota:bob:hbm"
    from kvstore.sizes import format_size

    assert f"hbm={format_size(5 * n)} binds" in str(err) and f"holds {format_size(2 * n)}" in str(err)


def test_a_session_block_that_cannot_come_up_does_not_count_others_pins(open_store, spec):
    """The session put that must bring a stored block up into a full HBM said how many bytes of
    it were pinned, every tenant's sessions summed."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=16, nvme_blocks=64, policy="lru")
    keys = s.block_keys("bob", spec, list(range(30_000, 30_000 + 2 * spec.block_tokens)))
    s.put("bob", spec, keys, random_kv(2, spec))
    for i in range(8):  # push bob's blocks down with traffic
        other = s.block_keys("carol", spec, list(range(40_000 + i * 100, 40_000 + i * 100 + spec.block_tokens)))
        s.put("carol", spec, other, random_kv(1, spec))
    assert s.lookup("bob", spec, keys).tiers[0] != "hbm"
    s.open_session("alice", "pins")
    pins = s.block_keys("alice", spec, list(range(50_000, 50_000 + 4 * spec.block_tokens)))
    s.put("alice", spec, pins, random_kv(4, spec), session="pins")
    s.open_session("bob", "chat")
    with pytest.raises(errors.ResourceExhausted, match="pinned by sessions|held by pinned") as err:
        s.put("bob", spec, keys[1:], random_kv(1, spec), session="chat", parent=keys[0])
    assert "bytes of it" not in str(err.value) and str(4 * spec.block_nbytes) not in str(err.value)
