"""Admin calls that race on one name (kvstore.service_admin.AdminPlane), each interleaving forced.

* ``tenant add NAME`` while ``tenant delete NAME`` was still running took the running deletion
  for one left over: it ran it a second time, created the tenant, and the first deletion then
  removed the new tenant's blocks and data key (its audit entry counting them). Now a deletion
  running in this process is neither run again nor overtaken: the add (and a second delete) is
  FAILED_PRECONDITION naming the state; a deletion left over is still finished by the add.
* ``policy set`` racing ``tenant delete``: the policy was applied to the Store, the deletion
  removed the tenant (and that policy), the save failed NotFound, and the rollback put the old
  policy back in the Store: a tenant created again under the name was held to the old quota and
  TTL that ``policy get`` did not show, until a restart.
* Two overlapping ``policy set``: the Store enforced one policy, ``policy get`` (and the next
  start) the other; the later call's audit entry named as "before" a policy it did not replace.

Each test holds the first call at its critical step and starts the second; the second is let
go on once it has finished (the code before) or waits for the plane's lock (now).
"""

from __future__ import annotations

import threading
from typing import Any, Self

import pytest
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.errors import FailedPrecondition
from kvstore.service_admin import AdminPlane

B = SPEC.block_nbytes
#: a bound on every wait (a hang guard, not a timing assertion)
WAIT_S = 20.0


class _Contended:
    """A lock that tells (``waiting``) when a caller has to wait for it."""

    def __init__(self, waiting: threading.Event) -> None:
        self._lock = threading.Lock()
        self.waiting = waiting

    def __enter__(self) -> Self:
        if not self._lock.acquire(blocking=False):
            self.waiting.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class _Call:
    """``fn()`` in a thread; ``done`` is set when it ended, ``outcome`` is what it returned or raised."""

    def __init__(self, fn: Any, done: threading.Event | None = None) -> None:
        self.done = done or threading.Event()
        self.outcome: list[Any] = []

        def run() -> None:
            try:
                self.outcome.append(fn())
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                self.outcome.append(exc)
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def result(self) -> Any:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()
        if isinstance(self.outcome[0], BaseException):
            raise self.outcome[0]
        return self.outcome[0]


@pytest.fixture
def sidecar(tmp_path, monkeypatch):
    """A sidecar (HBM of 8 blocks) and its AdminPlane's lock, which tells when a call waits on it
    (``sc.lock_waited``)."""
    planes: list[AdminPlane] = []
    real_init = AdminPlane.__init__

    def init(self: AdminPlane, *args: Any, **kw: Any) -> None:
        real_init(self, *args, **kw)
        planes.append(self)

    monkeypatch.setattr(AdminPlane, "__init__", init)
    sc = start(tmp_path, store={"hbm_bytes": 8 * B, "dram_bytes": 16 * B, "nvme_bytes": 64 * B})
    sc.lock_waited = threading.Event()
    (plane,) = planes
    plane._lock = _Contended(sc.lock_waited)  # the code before had none: this one is then unused
    yield sc
    sc.stop()


def _hold_first_apply(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold the first ``AdminPlane._apply`` (a policy set) after the Store took the policy, before
    it is saved; returns (held, go)."""
    real = AdminPlane._apply
    held, go = threading.Event(), threading.Event()

    def apply(self: AdminPlane, namespace: str, policy: Any, **kw: Any) -> None:
        real(self, namespace, policy, **kw)
        if not held.is_set():
            held.set()
            assert go.wait(WAIT_S)

    monkeypatch.setattr(AdminPlane, "_apply", apply)
    return held, go


def _hold_first_drop(monkeypatch, store: Any) -> tuple[threading.Event, threading.Event, list[str]]:
    """Hold the Store part of the first tenant deletion (in production: the remote tier's SCAN of
    the whole keyspace); returns (held, go, the tenants each drop was called for)."""
    real = store.drop_tenant
    held, go, calls = threading.Event(), threading.Event(), []

    def drop(tenant: str, **kw: Any) -> int:
        calls.append(tenant)
        if len(calls) == 1:
            held.set()
            assert go.wait(WAIT_S)
        return real(tenant, **kw)

    monkeypatch.setattr(store, "drop_tenant", drop)
    return held, go, calls


def _put(client: Any, n: int) -> list[bytes]:
    keys = client.block_keys(SPEC, fresh_tokens(n))
    client.put(SPEC, keys, random_kv(n))
    return keys


def _entries(sc: Any, action: str, target: str) -> list[tuple[str, str, str]]:
    return [(e["principal"], e["result"], e["detail"]) for e in sc.admin().audit()
            if e["action"] == action and e["target"] == target and e["result"] != "STARTED"]


# -- 1: tenant add / tenant delete while a deletion of the name runs ---------------------------------
def test_tenant_add_while_its_deletion_runs_is_refused_and_the_deletion_counts_only_the_old_blocks(
        sidecar, monkeypatch):
    old = sidecar.tenant("alice")
    _put(old, 4)
    held, go, drops = _hold_first_drop(monkeypatch, sidecar.server.store)
    delete = _Call(lambda: sidecar.admin().delete_tenant("alice"))
    try:
        assert held.wait(WAIT_S)
        with pytest.raises(FailedPrecondition, match="being deleted.*still running"):
            sidecar.admin().create_tenant("alice")
    finally:
        go.set()
    assert delete.result() == 4  # the old tenant's blocks
    assert drops == ["alice"]  # run once: not a second time by the add
    assert "alice" not in [t["name"] for t in sidecar.admin().list_tenants()]
    assert _entries(sidecar, "tenant.delete", "alice") == [("admin", "OK", "blocks=4")]
    assert [r for _, r, _ in _entries(sidecar, "tenant.create", "alice")] == ["OK", "FAILED_PRECONDITION"]

    # once the deletion ended, the name is free, and the new tenant keeps its blocks
    new = sidecar.tenant("alice")
    keys = _put(new, 4)
    assert new.lookup(SPEC, keys).num_blocks == 4


def test_a_second_tenant_delete_while_the_first_runs_is_refused_not_run_twice(sidecar, monkeypatch):
    old = sidecar.tenant("alice")
    _put(old, 3)
    held, go, drops = _hold_first_drop(monkeypatch, sidecar.server.store)
    first = _Call(lambda: sidecar.admin().delete_tenant("alice"))
    try:
        assert held.wait(WAIT_S)
        with pytest.raises(FailedPrecondition, match="being deleted"):
            sidecar.admin().delete_tenant("alice")
    finally:
        go.set()
    assert first.result() == 3
    assert drops == ["alice"]
    assert [t["name"] for t in sidecar.admin().list_tenants()] == ["admin"]


# -- 2: policy set racing tenant delete ------------------------------------------------------------
def test_policy_set_racing_tenant_delete_leaves_no_policy_for_a_tenant_created_again(sidecar, monkeypatch):
    adm = sidecar.admin()
    sidecar.tenant("alice")
    adm.set_policy("alice", quota_bytes={"hbm": 2 * B}, priority=-3, ttl_s=30)

    held, go = _hold_first_apply(monkeypatch)
    setting = _Call(lambda: sidecar.admin().set_policy("alice", quota_bytes={"hbm": B}, priority=7))
    try:
        assert held.wait(WAIT_S)  # the Store took the new policy; it is not saved yet
        deleting = _Call(lambda: sidecar.admin().delete_tenant("alice"), done=sidecar.lock_waited)
        assert sidecar.lock_waited.wait(WAIT_S)  # the deletion ended (before) or waits (now)
    finally:
        go.set()
    setting.thread.join(WAIT_S)
    assert deleting.result() == 0

    a = sidecar.tenant("alice")  # created again: no policy shown, none enforced
    assert adm.get_policy("alice") == {"tenant": "alice", "ttl_s": None, "quota_bytes": {}, "priority": 0}
    keys = _put(a, 6)
    assert adm.stats()["tenants"]["alice"] == {"hbm": 6 * B}  # no HBM quota of 1 or 2 blocks
    sidecar.clock.now += 31
    sidecar.server.store.expire()
    assert a.lookup(SPEC, keys).num_blocks == 6  # no TTL of 30 s


# -- 3: two overlapping policy set on one tenant -----------------------------------------------------
def test_overlapping_policy_sets_leave_the_store_enforcing_what_policy_get_shows(sidecar, monkeypatch):
    a = sidecar.tenant("alice")
    held, go = _hold_first_apply(monkeypatch)
    first = _Call(lambda: sidecar.admin().set_policy("alice", ttl_s=3600, priority=1))
    try:
        assert held.wait(WAIT_S)  # the Store took ttl 3600; it is not saved yet
        second = _Call(lambda: sidecar.admin().set_policy("alice", ttl_s=5, priority=2), done=sidecar.lock_waited)
        assert sidecar.lock_waited.wait(WAIT_S)  # the second call ended (before) or waits (now)
    finally:
        go.set()
    first.result()
    second.result()

    shown = sidecar.admin().get_policy("alice")
    assert (shown["ttl_s"], shown["priority"]) == (5.0, 2)  # the later call's, saved last
    keys = _put(a, 2)
    sidecar.clock.now += 6
    sidecar.server.store.expire()
    assert a.lookup(SPEC, keys).num_blocks == 0  # the Store enforces that 5 s TTL, not 3600 s
    # each entry's "before" is the policy it replaced
    assert [d for _, r, d in _entries(sidecar, "policy.set", "alice")] == [
        "ttl_s=None quota={} priority=0 -> ttl_s=3600.0 quota={} priority=1",
        "ttl_s=3600.0 quota={} priority=1 -> ttl_s=5.0 quota={} priority=2",
    ]


def test_policy_set_racing_a_shared_namespace_drop_stays_in_force(sidecar, monkeypatch):
    """``tenant delete shared:x`` keeps the namespace and re-applies its recorded policy after the
    drop: read while a ``policy set`` of it was between its apply and its save, the old one was
    put back in force while ``policy get`` showed the new one."""
    adm = sidecar.admin()
    pub = sidecar.client(adm.create_tenant("pub", "publisher", ["shared:docs"]))
    adm.set_policy("shared:docs", ttl_s=3600)
    held, go = _hold_first_apply(monkeypatch)
    setting = _Call(lambda: sidecar.admin().set_policy("shared:docs", ttl_s=5))
    try:
        assert held.wait(WAIT_S)
        dropping = _Call(lambda: sidecar.admin().delete_tenant("shared:docs"), done=sidecar.lock_waited)
        assert sidecar.lock_waited.wait(WAIT_S)  # the drop ended (before) or waits to re-apply (now)
    finally:
        go.set()
    setting.result()
    assert dropping.result() == 0

    assert adm.get_policy("shared:docs")["ttl_s"] == 5.0
    keys = pub.block_keys(SPEC, fresh_tokens(2), namespace="shared:docs")
    pub.put(SPEC, keys, random_kv(2), namespace="shared:docs")
    sidecar.clock.now += 6
    sidecar.server.store.expire()
    assert pub.lookup(SPEC, keys, namespace="shared:docs").num_blocks == 0  # 5 s in force, not 3600 s
