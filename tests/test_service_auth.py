"""Bearer tokens, roles, tenant isolation, shared namespaces and the audit of admin actions."""

from __future__ import annotations

import grpc
import pytest
import torch
from service_harness import SPEC, HeldPut, fresh_tokens, random_kv

from kvstore.admin_client import AdminClient
from kvstore.audit import AuditLog
from kvstore.client import Client, spec_to_pb
from kvstore.errors import (
    IntegrityError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

torch.set_num_threads(1)


def _raw_lookup(target: str, metadata):
    with grpc.insecure_channel(target) as ch:
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        stub.WhoAmI(pb.WhoAmIRequest(), metadata=metadata, timeout=5)


@pytest.mark.parametrize("metadata", [
    (),
    (("authorization", "Bearer kvs_not-a-real-token"),),
    (("authorization", "Basic dXNlcjpwYXNz"),),
    (("authorization", "Bearer "),),
], ids=["missing", "unknown", "wrong-scheme", "empty"])
def test_bad_tokens_are_unauthenticated(sidecar, metadata):
    with pytest.raises(grpc.RpcError) as err:
        _raw_lookup(sidecar.target, metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("token", ["", "   ", "kvs_a b", "kvs_\u00e9t\u00e9", "kvs_a\nb"],
                         ids=["empty", "blank", "space", "non-ascii", "inner-newline"])
def test_a_token_grpc_cannot_carry_is_refused_by_the_client_with_a_clear_error(sidecar, token):
    """Not an opaque INTERNAL error at the first call: InvalidArgument when the client is made."""
    with pytest.raises(InvalidArgument, match="token"):
        Client(sidecar.target, token, local=False)
    with pytest.raises(InvalidArgument, match="token"):
        AdminClient(sidecar.target, token)


def test_a_token_read_from_a_file_with_its_newline_still_works(sidecar, tmp_path):
    path = tmp_path / "token"
    path.write_text(sidecar.admin().create_tenant("filed") + "\n")
    with Client(sidecar.target, path.read_text(), local=False) as c:
        assert c.whoami()["principal"] == "filed"


def test_tenant_calling_admin_is_permission_denied_and_audited(sidecar):
    token = sidecar.admin().create_tenant("sneaky")
    with AdminClient(sidecar.target, token) as not_admin:
        with pytest.raises(PermissionDenied):
            not_admin.create_tenant("evil")
        with pytest.raises(PermissionDenied):
            not_admin.audit()
    entries = sidecar.admin().audit()
    assert entries[-1]["principal"] == "sneaky" and entries[-1]["result"] == "PERMISSION_DENIED"


def test_admin_token_has_no_data_plane(sidecar):
    c = sidecar.client(sidecar.admin_token, local=False)
    with pytest.raises(PermissionDenied):
        c.lookup(SPEC, [bytes(32)])


def test_another_tenants_blocks_are_a_plain_miss(sidecar):
    a = sidecar.tenant("alice")
    b = sidecar.tenant("bob")
    keys = a.block_keys(SPEC, fresh_tokens(2))
    a.put(SPEC, keys, random_kv(2))
    assert b.lookup(SPEC, keys).num_blocks == 0  # same keys, bob's namespace: a miss
    assert len(b.get(SPEC, keys)) == 0
    assert b.delete(keys) == 0
    assert a.lookup(SPEC, keys).num_blocks == 2
    with pytest.raises(PermissionDenied):  # naming alice's namespace is not a way in either
        b.lookup(SPEC, keys, namespace="alice")


def test_shared_namespace_read_by_grantees_written_by_publisher_only(sidecar):
    admin = sidecar.admin()
    pub = sidecar.client(admin.create_tenant("sysprompt", role="publisher", namespaces=["shared:sys"]))
    reader = sidecar.client(admin.create_tenant("reader", namespaces=["shared:sys"]))
    outsider = sidecar.tenant("outsider")
    tokens = fresh_tokens(2)
    keys = pub.block_keys(SPEC, tokens, namespace="shared:sys")
    kv = random_kv(2, seed=21)
    pub.put(SPEC, keys, kv, namespace="shared:sys")

    assert reader.lookup(SPEC, token_ids=tokens, namespace="shared:sys").num_blocks == 2
    assert torch.equal(reader.get(SPEC, keys, namespace="shared:sys").view(torch.int16), kv.view(torch.int16))
    with pytest.raises(PermissionDenied):
        reader.put(SPEC, keys, kv, namespace="shared:sys")
    with pytest.raises(PermissionDenied):
        reader.delete(keys, namespace="shared:sys")
    with pytest.raises(PermissionDenied):
        outsider.lookup(SPEC, keys, namespace="shared:sys")
    assert reader.lookup(SPEC, keys).num_blocks == 0  # its own namespace does not hold them

    admin.grant("outsider", "shared:sys")
    assert outsider.lookup(SPEC, keys, namespace="shared:sys").num_blocks == 2
    admin.grant("outsider", "shared:sys", revoke=True)
    with pytest.raises(PermissionDenied):
        outsider.lookup(SPEC, keys, namespace="shared:sys")


def test_rotate_invalidates_the_old_token(sidecar):
    admin = sidecar.admin()
    old = admin.create_tenant("rot")
    new = admin.rotate_token("rot")
    assert new != old
    with pytest.raises(Unauthenticated):
        Client(sidecar.target, old, local=False).whoami()
    assert sidecar.client(new, local=False).whoami()["principal"] == "rot"


def test_delete_tenant_revokes_token_and_destroys_its_blocks(sidecar):
    admin = sidecar.admin()
    token = admin.create_tenant("gone")
    c = sidecar.client(token)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, keys, random_kv(2))
    admin.delete_tenant("gone")
    with pytest.raises(Unauthenticated):
        c.lookup(SPEC, keys)
    token = admin.create_tenant("gone")  # the name can be reused; nothing of the old one remains
    assert sidecar.client(token).lookup(SPEC, keys).num_blocks == 0


def test_every_admin_action_is_audited_with_its_result(sidecar):
    """A change is recorded before it is made (STARTED) and after (its outcome, whose ref names
    the STARTED entry); a read only after."""
    admin = sidecar.admin()
    admin.create_tenant("aud")
    admin.rotate_token("aud")
    admin.grant("aud", "shared:x")
    admin.set_policy("aud", ttl_s=10.0, quota_bytes={"hbm": 1 << 20})
    admin.get_policy("aud")
    admin.list_tenants()
    admin.purge_model(SPEC)
    admin.delete_tenant("aud")
    with pytest.raises(NotFound):
        admin.delete_tenant("aud")  # NOT_FOUND, audited too
    entries = admin.audit()
    actions = [(e["action"], e["result"]) for e in entries]
    changes = ["tenant.create", "tenant.rotate", "namespace.grant", "policy.set"]
    assert actions == [*((a, r) for a in changes for r in ("STARTED", "OK")),
                       ("policy.get", "OK"), ("tenant.list", "OK"),
                       ("model.purge", "STARTED"), ("model.purge", "OK"),
                       ("tenant.delete", "STARTED"), ("tenant.delete", "OK"),
                       ("tenant.delete", "STARTED"), ("tenant.delete", "NOT_FOUND")]
    assert all(e["principal"] == "admin" for e in entries)
    seq = {e["seq"]: e for e in entries}
    for e in entries:
        if e["result"] == "STARTED" or e["action"] in ("policy.get", "tenant.list"):
            assert e["ref"] == 0
        else:  # an outcome names the entry written before its change, just before it here
            assert e["ref"] == e["seq"] - 1 and seq[e["ref"]]["result"] == "STARTED"
            assert seq[e["ref"]]["action"] == e["action"] and seq[e["ref"]]["target"] == e["target"]


def test_a_change_left_without_an_outcome_gets_unknown_at_the_next_open(tmp_path):
    """A crash between a change and its outcome record: the STARTED entry is closed with
    UNKNOWN when the log is next opened (once), so the log shows the action and that its
    outcome is not known. Before, the only record was written after the action, so a crash
    between the two left no trace of it."""
    log = AuditLog(tmp_path / "audit.log", clock=lambda: 5.0, fsync=False)
    done = log.append("admin", "tenant.create", "a", "STARTED")
    log.append("admin", "tenant.create", "a", "OK", ref=done.seq)
    cut = log.append("admin", "tenant.delete", "b", "STARTED")
    log.close()  # the server stops here
    reopened = AuditLog(tmp_path / "audit.log", clock=lambda: 6.0, fsync=False)
    last = reopened.read()[-1]
    assert (last.seq, last.action, last.target, last.result, last.ref) == (4, "tenant.delete", "b", "UNKNOWN", cut.seq)
    assert "no outcome was recorded" in last.detail and last.time == 6.0
    reopened.close()
    again = AuditLog(tmp_path / "audit.log", clock=lambda: 7.0, fsync=False)
    assert again.verify() == 4  # closed once, not at every open
    again.close()


def test_audit_log_written_before_outcomes_had_refs_still_opens(tmp_path):
    """Lines without ``ref`` (logs of earlier versions) read as ref 0."""
    log = AuditLog(tmp_path / "audit.log", clock=lambda: 5.0, fsync=False)
    log.append("admin", "tenant.create", "a", "OK")
    log.close()
    path = tmp_path / "audit.log"
    path.write_text(path.read_text().replace(',"ref":0', ""))
    old = AuditLog(path, clock=lambda: 6.0, fsync=False)
    assert [e.ref for e in old.read()] == [0] and old.append("admin", "x", "y", "OK").seq == 2
    old.close()


def test_audit_log_is_append_only_and_chained(tmp_path):
    log = AuditLog(tmp_path / "audit.log", clock=lambda: 5.0, fsync=False)
    for i in range(3):
        log.append("admin", "tenant.create", f"t{i}", "OK")
    assert log.verify() == 3
    log.close()
    reopened = AuditLog(tmp_path / "audit.log", clock=lambda: 6.0, fsync=False)
    assert reopened.append("admin", "x", "y", "OK").seq == 4
    reopened.close()
    lines = (tmp_path / "audit.log").read_text().splitlines()
    lines[1] = lines[1].replace('"t1"', '"tX"')
    (tmp_path / "audit.log").write_text("\n".join(lines) + "\n")
    with pytest.raises(IntegrityError):
        AuditLog(tmp_path / "audit.log", clock=lambda: 7.0, fsync=False).verify()


def test_tokens_are_stored_hashed(sidecar):
    token = sidecar.admin().create_tenant("hashed")
    text = (sidecar.data_dir / "auth.json").read_text()
    assert token not in text and sidecar.admin_token not in text
    assert "token_sha256" in text


def test_a_principal_recreated_under_a_deleted_ones_name_cannot_reach_its_regions(sidecar):
    """Regions belong to a principal name: deleting the principal drops them, so a new tenant
    given the same name cannot read or write the old one's client memory by region id."""
    old = sidecar.tenant("reused", local=True)
    assert old.uses_shared_memory
    rid = old._local.region_id
    admin = sidecar.admin()
    admin.delete_tenant("reused")
    token = admin.create_tenant("reused")
    stub_md = (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(sidecar.target) as ch:
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        target = pb.Target(spec=spec_to_pb(SPEC), keys=bytes(32))
        for call, req in ((stub.GetLocal, pb.GetLocalRequest(target=target, region_id=rid, offsets=[0])),
                          (stub.PutLocal, pb.PutLocalRequest(target=target, region_id=rid, offsets=[0]))):
            with pytest.raises(grpc.RpcError) as err:
                call(req, metadata=stub_md, timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "unknown region" in err.value.details()


def test_an_audit_record_that_cannot_be_written_leaves_no_torn_line(tmp_path, monkeypatch):
    """A full disk mid-append: the torn line is cut off again (the next start would refuse a
    malformed line), the append fails with FailedPrecondition, and the log goes on after."""
    import kvstore.audit as audit_mod
    from kvstore.errors import FailedPrecondition

    log = AuditLog(tmp_path / "audit.log", clock=lambda: 5.0, fsync=False)
    log.append("admin", "tenant.create", "a", "OK")
    size = (tmp_path / "audit.log").stat().st_size
    real_write = audit_mod.os.write
    monkeypatch.setattr(audit_mod.os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))
    with pytest.raises(FailedPrecondition, match="could not be written: wrote"):
        log.append("admin", "tenant.create", "b", "OK")
    assert (tmp_path / "audit.log").stat().st_size == size
    monkeypatch.setattr(audit_mod.os, "write", real_write)
    assert log.append("admin", "tenant.create", "c", "OK").seq == 2
    log.close()
    reopened = AuditLog(tmp_path / "audit.log", clock=lambda: 6.0, fsync=False)
    assert reopened.verify() == 2 and [e.target for e in reopened.read()] == ["a", "c"]
    reopened.close()


def test_an_admin_change_whose_first_audit_record_fails_is_not_made(sidecar, monkeypatch):
    """The STARTED record is written before the change: when it cannot be, the change is not
    made and the caller gets FAILED_PRECONDITION saying so (before, the action was carried out
    and only its record was missing)."""
    from kvstore.errors import FailedPrecondition

    admin = sidecar.admin()
    audit = sidecar.server.data.audit

    def failing(*args, **kw):
        raise FailedPrecondition("the audit log x could not be written: [Errno 28] No space left on device")

    monkeypatch.setattr(audit, "append", failing)
    with pytest.raises(FailedPrecondition, match="could not be written.*so tenant.create was not carried out"):
        admin.create_tenant("unrecorded")
    monkeypatch.undo()
    assert "unrecorded" not in [t["name"] for t in admin.list_tenants()]
    token = admin.create_tenant("recorded")
    client = sidecar.client(token)
    keys = client.block_keys(SPEC, fresh_tokens(1))
    client.put(SPEC, keys, random_kv(1))
    monkeypatch.setattr(audit, "append", failing)
    with pytest.raises(FailedPrecondition, match="so blocks.delete was not carried out"):
        client.delete(keys)
    monkeypatch.undo()
    assert client.lookup(SPEC, keys).num_blocks == 1


def test_an_admin_action_whose_outcome_record_fails_says_so(sidecar, monkeypatch):
    """The STARTED record was written and the action carried out; the caller gets
    FAILED_PRECONDITION saying its outcome could not be recorded (not an INTERNAL error), the
    server goes on, and the log's next open closes the entry with UNKNOWN."""
    from kvstore.audit import STARTED
    from kvstore.errors import FailedPrecondition

    admin = sidecar.admin()
    audit = sidecar.server.data.audit
    real = audit.append

    def outcome_fails(principal, action, target, result, *args, **kw):
        if result == STARTED:
            return real(principal, action, target, result, *args, **kw)
        raise FailedPrecondition("the audit log x could not be written: [Errno 28] No space left on device")

    monkeypatch.setattr(audit, "append", outcome_fails)
    with pytest.raises(FailedPrecondition, match="Admin.CreateTenant was carried out, but the audit log"):
        admin.create_tenant("unrecorded")
    monkeypatch.undo()
    assert "unrecorded" in [t["name"] for t in admin.list_tenants()]
    token = admin.rotate_token("unrecorded")
    client = sidecar.client(token)
    monkeypatch.setattr(audit, "append", outcome_fails)
    with pytest.raises(FailedPrecondition, match="the blocks were deleted, but the audit log"):
        client.delete([b"\0" * 32])
    monkeypatch.undo()
    reopened = AuditLog(audit.path, clock=lambda: 9.0, fsync=False)
    unknown = [(e.action, e.target) for e in reopened.read() if e.result == "UNKNOWN"]
    reopened.close()
    assert unknown == [("tenant.create", "unrecorded"), ("blocks.delete", "unrecorded")]


def test_a_principals_file_that_cannot_be_saved_changes_nothing(tmp_path, monkeypatch):
    """A full disk while saving principals: the change is undone in memory too, so memory and
    file agree. Before, a deletion or rotation the file had not taken stayed in effect only
    until the next start, when the revoked token worked again."""
    import errno

    import kvstore.auth as auth_mod
    from kvstore.auth import AuthRegistry
    from kvstore.errors import FailedPrecondition

    reg = AuthRegistry(tmp_path / "auth.json", clock=lambda: 1.0)
    token = reg.create("acme")

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(auth_mod.os, "replace", full)
    with pytest.raises(FailedPrecondition, match="could not be saved .*No space left.*nothing was changed"):
        reg.delete("acme")
    assert reg.authenticate(token).name == "acme"
    with pytest.raises(FailedPrecondition):
        reg.rotate("acme")
    assert reg.authenticate(token).name == "acme"
    with pytest.raises(FailedPrecondition):
        reg.create("other")
    assert [p.name for p in reg.list()] == ["acme"]
    assert not (tmp_path / "auth.tmp").exists()
    monkeypatch.undo()
    reg.delete("acme")
    again = AuthRegistry(tmp_path / "auth.json", clock=lambda: 2.0)
    assert again.list() == []
    with pytest.raises(Unauthenticated):
        again.authenticate(token)


def test_a_tenant_deletion_that_fails_half_way_can_be_run_again(sidecar, monkeypatch):
    """Marked first, data next, principal last: when destroying the data fails (here: a full
    disk), the principal stays marked (its token refused from the mark on: see
    test_tenant_delete_crash15.py) and the deletion runs again; and a principal deleted without its
    data (as the earlier order could leave it) has that data dropped by a delete of its name,
    so a tenant created later under it reads nothing of it."""
    from kvstore.errors import NVMeWriteFailed

    admin = sidecar.admin()
    c = sidecar.client(admin.create_tenant("halfway"), local=False)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, keys, random_kv(2))
    store = sidecar.server.store
    real_drop = store.drop_tenant

    def full(tenant):
        raise NVMeWriteFailed(f"could not destroy tenant {tenant!r}'s data key: disk full")

    monkeypatch.setattr(store, "drop_tenant", full)
    with pytest.raises(Exception, match="disk full"):
        admin.delete_tenant("halfway")
    with pytest.raises(Unauthenticated):  # marked: its token is refused, its data still there
        c.lookup(SPEC, keys)
    assert store.lookup("halfway", SPEC, keys).num_blocks == 2
    monkeypatch.setattr(store, "drop_tenant", real_drop)
    admin.delete_tenant("halfway")
    with pytest.raises(Unauthenticated):
        c.lookup(SPEC, keys)
    # a principal gone, its data left behind: deleting the name drops the data
    c2 = sidecar.client(admin.create_tenant("orphan"), local=False)
    keys2 = c2.block_keys(SPEC, fresh_tokens(2))
    c2.put(SPEC, keys2, random_kv(2))
    sidecar.server.registry.delete("orphan")
    assert store.lookup("orphan", SPEC, keys2).num_blocks == 2
    admin.delete_tenant("orphan")
    assert store.lookup("orphan", SPEC, keys2).num_blocks == 0
    c3 = sidecar.client(admin.create_tenant("orphan"), local=False)
    assert c3.lookup(SPEC, keys2).num_blocks == 0
    with pytest.raises(NotFound):
        admin.delete_tenant("never-was")


@pytest.mark.parametrize("local", [False, True], ids=["stream", "shm"])
def test_a_put_under_way_when_its_tenant_is_deleted_stores_nothing(sidecar, monkeypatch, local):
    """A Put authenticated before its tenant was deleted committed after the deletion: the
    blocks stayed, and a tenant created later under the same name (same keys) read them."""
    admin = sidecar.admin()
    c = sidecar.tenant("eve", local=local)
    keys = c.block_keys(SPEC, fresh_tokens(3))
    kv = random_kv(3, seed=21)
    held = HeldPut(monkeypatch, c, SPEC, keys, kv)  # the tenant is deleted between auth and commit
    admin.delete_tenant("eve")
    outcome = held.finish()
    assert isinstance(outcome, Unauthenticated) and "deleted while this call ran" in str(outcome)
    monkeypatch.undo()
    assert "eve" not in sidecar.server.store.stats()["tenants"]
    again = Client(sidecar.target, admin.create_tenant("eve"), local=local)
    try:
        assert again.lookup(SPEC, keys).num_blocks == 0
        again.put(SPEC, keys, kv)  # the new tenant writes as usual
        assert again.lookup(SPEC, keys).num_blocks == 3
    finally:
        again.close()


@pytest.mark.parametrize("damage", [b"\xff\xfe garbage", b'{"principals": {"admin": {"ro', b"",
                                    b'{"principals": {"x": {"role": "king", "token_sha256": "00"}}}'])
def test_a_damaged_principals_file_fails_closed_by_name(tmp_path, damage):
    """It was a raw UnicodeDecodeError / JSONDecodeError traceback naming no file."""
    import time

    from kvstore.auth import AuthRegistry

    path = tmp_path / "auth.json"
    path.write_bytes(damage)
    with pytest.raises(IntegrityError, match=f"principals file {path} is damaged"):
        AuthRegistry(path, clock=time.time)


def test_a_principals_file_that_cannot_be_read_is_not_called_damaged(tmp_path):
    """A directory in its place was reported as a damaged file to restore from a backup."""
    import time

    from kvstore.auth import AuthRegistry
    from kvstore.errors import FailedPrecondition

    path = tmp_path / "auth.json"
    path.mkdir()
    with pytest.raises(FailedPrecondition, match=f"cannot read the principals file {path}"):
        AuthRegistry(path, clock=time.time)


def test_an_invalid_saved_policy_stops_the_start_naming_tenant_and_file(tmp_path):
    """A NaN TTL saved before it was checked: the start failed on "ttl_s must be > 0, got nan"."""
    import json
    import time

    from service_harness import start

    from kvstore.auth import AuthRegistry, Role, TenantPolicy
    from kvstore.errors import InvalidArgument as Invalid

    auth = tmp_path / "auth.json"
    reg = AuthRegistry(auth, clock=time.time)
    reg.create("bob", Role.TENANT)
    reg.set_policy("bob", TenantPolicy(ttl_s=5.0))
    data = json.loads(auth.read_text())
    data["policies"]["bob"]["ttl_s"] = float("nan")
    auth.write_text(json.dumps(data))
    with pytest.raises(Invalid, match=r"the policy of 'bob' in .*auth.json is not valid"):
        start(tmp_path)


def test_deleting_a_shared_namespaces_blocks_keeps_its_policy_in_force(sidecar):
    """The deletion took the namespace's quota and TTL out of the Store while `policy get` still
    showed them: the publisher then stored past its quota until the next restart."""
    admin = sidecar.admin()
    pub = sidecar.client(admin.create_tenant("pub", role="publisher", namespaces=["shared:kept"]))
    keys = pub.block_keys(SPEC, fresh_tokens(2), namespace="shared:kept")
    pub.put(SPEC, keys, random_kv(2), namespace="shared:kept")
    quota = SPEC.block_nbytes  # one block, in HBM only
    admin.set_policy("shared:kept", quota_bytes={"hbm": quota, "dram": 0, "nvme": 0})
    admin.delete_tenant("shared:kept")
    assert pub.lookup(SPEC, keys, namespace="shared:kept").num_blocks == 0
    assert admin.get_policy("shared:kept")["quota_bytes"]["hbm"] == quota
    with pytest.raises(ResourceExhausted):
        pub.put(SPEC, keys, random_kv(2), namespace="shared:kept")


def test_policies_belong_to_tenants_and_shared_namespaces(sidecar):
    admin = sidecar.admin()
    admin.create_tenant("pol-pub", role="publisher", namespaces=["shared:p"])
    with pytest.raises(NotFound):
        admin.get_policy("nobody")  # was an empty policy, as if set to nothing
    with pytest.raises(NotFound):
        admin.set_policy("nobody", ttl_s=5.0)
    for name in ("admin", "pol-pub"):
        with pytest.raises(InvalidArgument, match="policies are set on tenants"):
            admin.set_policy(name, ttl_s=5.0)
    assert admin.set_policy("shared:p", ttl_s=5.0)["ttl_s"] == 5.0
    assert admin.get_policy("shared:p")["ttl_s"] == 5.0
