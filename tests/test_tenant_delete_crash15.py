"""A tenant deletion interrupted half-way (a crash, a failed step) is finished, never left with
the tenant's data readable under its name.

Found by a kill -9 during ``tenant delete acme`` while acme's engine kept putting: the data went
first, then the principal (saved), then the data again; killed between the last two, the restart
found the principal gone but the blocks put meanwhile and the data key still there, nothing
finished the deletion, and a tenant created again as ``acme`` read the old tenant's blocks.
Now the principal is marked as being deleted first (its token refused from then on, saved), its
data and key go next, the principal last; a start finishes a deletion left marked (audited),
and so does a ``tenant add`` of the name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from service_harness import SPEC, HeldPut, fresh_tokens, random_kv, restart, start

from kvstore.errors import KVStoreError, Unauthenticated, Unavailable

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: NVMe only (nothing held in memory that a kill -9 would lose), durable commits
OVERRIDES = {"store": {"hbm_bytes": 0, "dram_bytes": 0, "durable": True}}

# The server runs in a child process that dies (os._exit, as a kill -9 leaves it: nothing closed,
# nothing committed at stop) right after the principals file was saved without acme's token. An
# engine of acme puts blocks after the deletion's first step that drops data (where the old order
# let it: between the first drop and the principal's removal).
_CHILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    sys.path[:0] = [{tests!r}, {root!r}]
    from service_harness import SPEC, fresh_tokens, random_kv, start
    from kvstore import auth, store_admin
    from kvstore.errors import KVStoreError

    sc = start(Path(sys.argv[1]), **json.loads(sys.argv[2]))
    adm = sc.admin()
    tok = adm.create_tenant("acme")
    client = sc.client(tok)
    before = client.block_keys(SPEC, fresh_tokens(3))
    client.put(SPEC, before, random_kv(len(before), seed=1))
    during = client.block_keys(SPEC, fresh_tokens(3))
    print(json.dumps({{"admin": sc.admin_token, "before": [k.hex() for k in before],
                      "during": [k.hex() for k in during]}}), flush=True)

    real_drop = store_admin.TenantAdmin.drop_tenant
    def drop_tenant(self, tenant, **kw):
        n = real_drop(self, tenant, **kw)
        if tenant == "acme":
            try:  # the engine goes on writing while the admin deletes it
                client.put(SPEC, during, random_kv(len(during), seed=2))
            except KVStoreError:
                pass
        return n
    store_admin.TenantAdmin.drop_tenant = drop_tenant

    real_save = auth.AuthRegistry._save
    def save(self):
        real_save(self)
        if "acme" not in self._hashes.values():
            os._exit(9)  # killed once the file no longer lets acme's token in
    auth.AuthRegistry._save = save
    adm.delete_tenant("acme")
    print("the deletion ended without the crash", flush=True)
""").format(tests=str(TESTS), root=str(ROOT))


def _crash_during_delete(data_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{ROOT}"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(data_dir), json.dumps(OVERRIDES)],
                          check=False, capture_output=True, text=True, timeout=240, env=env, cwd=str(ROOT))
    assert proc.returncode == 9, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[0])


def _nothing_left(sc, keys: list[bytes]) -> None:
    """No principal, no blocks, no data key of acme; a new acme finds none of the old keys."""
    adm = sc.admin()
    assert "acme" not in [t["name"] for t in adm.list_tenants()]
    assert "acme" not in adm.stats().get("tenants", {})
    assert "acme" not in sc.server.store.keyring.tenants()
    client = sc.client(adm.create_tenant("acme"))
    assert client.lookup(SPEC, keys).num_blocks == 0


def test_a_deletion_killed_after_the_principal_was_saved_is_finished_at_the_next_start(tmp_path):
    out = _crash_during_delete(tmp_path)
    sc = start(tmp_path, admin_token=out["admin"], **OVERRIDES)
    try:
        _nothing_left(sc, [bytes.fromhex(k) for k in out["before"] + out["during"]])
        entries = [e for e in sc.admin().audit() if e["action"] == "tenant.delete" and e["target"] == "acme"]
        # the call's STARTED entry, its UNKNOWN outcome (the open's), and the start's finish
        assert [e["result"] for e in entries][:2] == ["STARTED", "UNKNOWN"]
        finished = [e for e in entries if e["result"] == "OK"]
        assert len(finished) == 1 and "finished" in finished[0]["detail"]
    finally:
        sc.stop()


def _half_deleted(sc, monkeypatch, error: Exception) -> tuple:
    """Tenant acme with 3 blocks, whose deletion failed after its mark (``drop_tenant`` raised
    ``error``); drop_tenant is restored. Returns acme's client and the blocks' keys."""
    client = sc.client(sc.admin().create_tenant("acme"))
    keys = client.block_keys(SPEC, fresh_tokens(3))
    client.put(SPEC, keys, random_kv(len(keys)))

    def failing(self, tenant, **kw):
        raise error
    monkeypatch.setattr(type(sc.server.store), "drop_tenant", failing)
    with pytest.raises(KVStoreError):
        sc.admin().delete_tenant("acme")
    monkeypatch.undo()
    return client, keys


def test_a_deletion_that_failed_after_its_mark_refuses_the_token_and_is_finished_by_a_retry(tmp_path, monkeypatch):
    sc = start(tmp_path)
    try:
        client, keys = _half_deleted(sc, monkeypatch, Unavailable("the remote tier cannot be reached"))
        with pytest.raises(Unauthenticated):  # the deletion began: its token is refused already
            client.lookup(SPEC, keys)
        sc.admin().delete_tenant("acme")  # run again: finished
        assert "acme" not in sc.server.store.keyring.tenants()
        _nothing_left(sc, keys)
    finally:
        sc.stop()


def test_a_tenant_created_under_a_name_being_deleted_finishes_the_deletion_first(tmp_path, monkeypatch):
    sc = start(tmp_path)
    try:
        _, keys = _half_deleted(sc, monkeypatch, Unavailable("the remote tier cannot be reached"))
        new = sc.client(sc.admin().create_tenant("acme"))
        assert new.lookup(SPEC, keys).num_blocks == 0
        entries = [e for e in sc.admin().audit() if e["action"] == "tenant.delete" and e["result"] == "OK"]
        assert entries and "finished" in entries[-1]["detail"]
        sc = restart(sc)  # and the new tenant is not deleted at the next start
        assert "acme" in [t["name"] for t in sc.admin().list_tenants()]
    finally:
        sc.stop()


def test_a_deletion_left_marked_with_the_server_stopped_is_finished_at_start(tmp_path, monkeypatch):
    """In-process: the step after the mark raises (the process then stops as at a crash)."""
    sc = start(tmp_path)
    try:
        _, keys = _half_deleted(sc, monkeypatch, RuntimeError("crash"))
        sc = restart(sc)
        _nothing_left(sc, keys)
    finally:
        sc.stop()


def test_a_put_held_across_the_deletion_leaves_nothing(tmp_path, monkeypatch):
    sc = start(tmp_path)
    try:
        client = sc.client(sc.admin().create_tenant("acme"))
        keys = client.block_keys(SPEC, fresh_tokens(3))
        held = HeldPut(monkeypatch, client, SPEC, keys, random_kv(len(keys)))
        sc.admin().delete_tenant("acme")
        assert isinstance(held.finish(), KVStoreError)
        monkeypatch.undo()
        assert "acme" not in sc.admin().stats().get("tenants", {})
        sc = restart(sc)
        _nothing_left(sc, keys)
    finally:
        sc.stop()


def test_a_lost_principals_file_keeps_the_tenants_data(tmp_path):
    """No deletion was begun: a start without the principals file (to be restored from a
    backup) must not take the tenants' data for a deletion to finish."""
    sc = start(tmp_path)
    admin_token = sc.admin_token
    tok = sc.admin().create_tenant("acme")
    client = sc.client(tok)
    keys = client.block_keys(SPEC, fresh_tokens(3))
    kv = random_kv(len(keys))
    client.put(SPEC, keys, kv)
    auth_file = sc.server.config.auth_file
    sc.stop()
    saved = auth_file.read_bytes()
    auth_file.unlink()
    sc = start(tmp_path)
    try:
        assert "acme" in sc.server.store.keyring.tenants()
        assert sum(sc.admin().stats()["tenants"]["acme"].values()) > 0
    finally:
        sc.stop()
    auth_file.write_bytes(saved)  # restored from the backup: acme reads its blocks again
    sc = start(tmp_path, admin_token=admin_token)
    try:
        assert sc.client(tok).lookup(SPEC, keys).num_blocks == len(keys)
    finally:
        sc.stop()
