"""Remote (Redis/Valkey) tier fixes, second round: deletions that reach every remote descendant
and every model, tenant deletion that fails before it deletes anything, concurrent tenant
deletions, TTL moves that reach the remote copy, data keys of re-created tenants, distinct
deletion counts, and clock skew.

Tests share the Redis on 127.0.0.1:6379 through the ``servers`` fixture (own namespace, one
FakeClock); tests that pause Redis use ``private_redis``. Nothing sleeps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from conftest import MASTER, FakeClock, make_kv, tokens
from remote_harness import PrivateRedis

from kvstore.config import StoreConfig
from kvstore.errors import Unavailable
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef
from tiers.remote_config import RemoteConfig
from tiers.remote_redis import RedisKeyBackend

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
N = SPEC.block_nbytes


def _refs(tenant: str, keys: list[bytes], spec: ModelSpec = SPEC) -> list[BlockRef]:
    return [BlockRef(tenant, k, spec) for k in keys]


def _in_redis(url: str, store: Store, tenant: str, keys: list[bytes]) -> list[bool]:
    """Whether Redis holds each block's value (expired on some clock or not)."""
    raw = redis.Redis.from_url(url)
    try:
        return [bool(raw.exists(store._remote.redis_key(r))) for r in _refs(tenant, keys)]
    finally:
        raw.close()


def _values(servers) -> list[bytes]:
    """The block values (``<ns>:<tenant>:<model>:<key>``) in the servers' namespace."""
    raw = redis.Redis.from_url(servers.url)
    try:
        return [k for k in raw.scan_iter(match=f"{servers.ns}:*", count=1000)
                if k.count(b":") == 3 and b":keyring:" not in k and b":dropped:" not in k]
    finally:
        raw.close()


# -- p4: two servers delete one tenant at once -----------------------------------------------------
def test_a_tenant_key_deleted_by_another_server_meanwhile_is_no_error(servers, monkeypatch) -> None:
    """Keyring.destroy checked ``tenant in backend`` then deleted it: when another server's
    drop_tenant deleted the key in between, a bare KeyError came out of drop_tenant and the
    remote purge never ran."""
    a = servers("a")
    keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
    a.put("acme", SPEC, keys, make_kv(SPEC, 2))
    a.flush()
    assert len(_values(servers)) == 2
    real_get = RedisKeyBackend.__getitem__
    real_del = RedisKeyBackend.__delitem__

    def other_server_first(self, tenant):  # the other server's deletion lands first
        self._client.delete(self._k(tenant))
        return real_del(self, tenant)

    monkeypatch.setattr(RedisKeyBackend, "__delitem__", other_server_first)
    monkeypatch.setattr(RedisKeyBackend, "__contains__",
                        lambda self, t: (real_get(self, t), self._client.delete(self._k(t)))[1] >= 0)
    a.drop_tenant("acme")  # raised KeyError
    assert _values(servers) == []
    assert a.get("acme", SPEC, keys).shape[0] == 0


# -- p5: a delete removes every remote descendant, whoever wrote it --------------------------------
def _evicted_chain(servers, name: str = "a", n: int = 4):
    """A server (write-back: ``remote_write="demote"``) whose chain of ``n`` blocks was evicted,
    leaf first, to the remote tier: it holds none of them locally any more."""
    s = servers(name, hbm=n, remote_write="demote")
    keys = s.block_keys("acme", SPEC, tokens(n, SPEC))
    kv = make_kv(SPEC, n)
    s.put("acme", SPEC, keys, kv)
    s.put("acme", SPEC, s.block_keys("acme", SPEC, tokens(n, SPEC, start=7_000)), make_kv(SPEC, n, 3))
    assert s._remote.flush(10)
    assert all(s._index.get("acme", k) is None for k in keys)
    return s, keys, kv


def test_delete_removes_remote_descendants_the_server_no_longer_holds(servers) -> None:
    """The chain was evicted to Redis: delete(keys[0]) found no local descendant, removed only
    keys[0]'s copy, and the three below it were still served as a continuation of keys[1]."""
    a, keys, kv = _evicted_chain(servers)
    b = servers("b", remote={"share_deletions": False})  # NOTE: its own copies stay (see below)
    assert torch.equal(b.get("acme", SPEC, keys[2:], parent=keys[1]), kv[2:])  # before: served
    b.put("acme", SPEC, keys[:2], kv[:2])  # b holds the first two now (and writes them through)
    assert a.delete("acme", [keys[0]]) >= 1
    assert a._remote.contains_many(_refs("acme", keys)) == [False] * 4
    for s in (a, b):
        assert s.get("acme", SPEC, keys[2:], parent=keys[1]).shape[0] == 0
        assert s.lookup("acme", SPEC, keys[2:], parent=keys[1]).num_blocks == 0
        assert s.get("acme", SPEC, keys[3:], parent=keys[2]).shape[0] == 0
    # b's own copies of keys[:2] are b's (without share_deletions a delete is per server, with the
    # shared remote tier; with it they go too: tests/test_remote_invalidation.py); what lay
    # below them remotely is gone
    assert b.get("acme", SPEC, keys).shape[0] == 2


def test_delete_cancels_queued_demotions_of_descendants(servers) -> None:
    """Demotions still queued (children queued before their parents, leaf first) were written
    after the delete of their ancestor: back in Redis under a deleted block."""
    import threading

    a = servers("a", hbm=4, remote_write="demote")
    t = a._remote
    entered, release = threading.Event(), threading.Event()
    real = t._put_with
    stopper = BlockRef("other", b"\x07" * 32, SPEC)

    def slow(scratch, ref, *args):
        if ref.key == stopper.key:
            entered.set()
            release.wait(10)
        return real(scratch, ref, *args)

    t._put_with = slow  # type: ignore[method-assign]
    try:
        assert t.submit(stopper, torch.zeros(N, dtype=torch.uint8).numpy())
        assert entered.wait(10)  # the writer is busy: what follows stays queued
        keys = a.block_keys("acme", SPEC, tokens(4, SPEC))
        a.put("acme", SPEC, keys, make_kv(SPEC, 4))
        a.put("acme", SPEC, a.block_keys("acme", SPEC, tokens(4, SPEC, start=7_000)), make_kv(SPEC, 4, 3))
        assert all(a._index.get("acme", k) is None for k in keys)  # evicted: queued only
        a.delete("acme", [keys[0]])
    finally:
        release.set()
    assert t.flush(10)
    assert t.contains_many(_refs("acme", keys)) == [False] * 4


def test_children_sets_and_subtree_deletion_on_a_cluster(tmp_path) -> None:
    """The children set is written in the same pipeline as the value (an EVAL routed by its own
    key), and a subtree spread over three masters is found and deleted."""
    import uuid

    import numpy as np
    from remote_harness import LocalCluster, require_redis

    from kvstore.keys import ROOT_KEY
    from tiers.remote import RemoteTier
    from tiers.remote_config import RemoteConfig

    require_redis()
    c = LocalCluster(tmp_path / "cluster").start()
    try:
        cfg = RemoteConfig(urls=c.urls, cluster=True, namespace=f"c-{uuid.uuid4().hex[:8]}",
                           retries=0, connect_timeout_s=0.5, op_timeout_s=1.0)
        t = RemoteTier.open(cfg, bytes(range(32)))
        try:
            keys = [i.to_bytes(4, "little") * 8 for i in range(1, 13)]
            data = np.arange(N, dtype=np.uint8)
            parent = ROOT_KEY
            for k in keys[:8]:  # a chain ...
                assert t.put(BlockRef("acme", k, SPEC), data, parent=parent)
                parent = k
            for k in keys[8:]:  # ... and four siblings under its third block
                assert t.put(BlockRef("acme", k, SPEC), data, parent=keys[2])
            assert t.delete_subtrees("acme", [(keys[1], SPEC.fingerprint)]) == set(keys[1:])
            assert t.contains_many(_refs("acme", keys)) == [True] + [False] * 11
        finally:
            t.close()
    finally:
        c.stop()


# -- p15: drop_tenant that cannot reach Redis deletes nothing --------------------------------------
def _paused_store(tmp_path: Path, private_redis: PrivateRedis, **kw: object) -> Store:
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=16 * N, dram_bytes=0, nvme_bytes=16 * N,
                      master_key=MASTER, remote_write="through",
                      remote=RemoteConfig(urls=[private_redis.url], op_timeout_s=0.2, retries=0,
                                          connect_timeout_s=0.2), **kw)
    return Store.open(cfg, clock=FakeClock())


def test_drop_tenant_that_cannot_reach_redis_fails_and_deletes_nothing(
        tmp_path: Path, private_redis: PrivateRedis) -> None:
    """drop_tenant deleted the local blocks and key first, then failed (FailedPrecondition):
    once Redis answered again a get served the tenant's remote copies and promoted them."""
    s = _paused_store(tmp_path, private_redis)
    try:
        keys = s.block_keys("acme", SPEC, tokens(3, SPEC))
        kv = make_kv(SPEC, 3)
        s.put("acme", SPEC, keys, kv)
        s.flush()
        private_redis.pause()
        try:
            with pytest.raises(Unavailable, match="retry"):
                s.drop_tenant("acme")
        finally:
            private_redis.resume()
        assert len(s._index.of_tenant("acme")) == 3  # nothing deleted here
        assert "acme" in s.keyring.tenants()
        s._remote._breakers.clear()  # the open period is over
        assert torch.equal(s.get("acme", SPEC, keys), kv)  # still the tenant's: not deleted
        s.drop_tenant("acme")  # the retry deletes it all
        assert s.get("acme", SPEC, keys).shape[0] == 0
        assert s._remote.contains_many(_refs("acme", keys)) == [False] * 3
        assert "acme" not in s.keyring.tenants()
    finally:
        s.close()


def test_drop_tenant_failing_half_way_in_redis_keeps_the_local_blocks(
        tmp_path: Path, private_redis: PrivateRedis, monkeypatch) -> None:
    """The tombstone and key are gone from Redis but the values could not be deleted: the call
    fails, the local blocks stay (the caller retries), and no server serves the old remote
    copies meanwhile (the tombstone)."""
    s = _paused_store(tmp_path, private_redis)
    try:
        keys = s.block_keys("acme", SPEC, tokens(2, SPEC))
        s.put("acme", SPEC, keys, make_kv(SPEC, 2))
        s.flush()

        def down(pattern):
            raise redis.ConnectionError("node down")

        monkeypatch.setattr(s._remote, "_purge", down)
        with pytest.raises(Unavailable):
            s.drop_tenant("acme")
        assert len(s._index.of_tenant("acme")) == 2
        monkeypatch.undo()
        s.drop_tenant("acme")
        assert s._index.of_tenant("acme") == []
        assert s._remote.contains_many(_refs("acme", keys)) == [False] * 2
    finally:
        s.close()


# -- p14: a server that never saw the model deletes its blocks -------------------------------------
def test_delete_on_a_server_that_never_saw_the_model(servers) -> None:
    """A fresh server (restarted, another replica: the service's Delete carries no model)
    deleted no remote copy, returned 0, and the chain stayed served."""
    a = servers("a")
    keys = a.block_keys("acme", SPEC, tokens(3, SPEC))
    kv = make_kv(SPEC, 3)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    a.close()
    b = servers("b")
    assert b._specs == {}
    assert b.delete("acme", [keys[1]]) >= 2
    assert b.get("acme", SPEC, keys).shape[0] == 1
    assert b._remote.contains_many(_refs("acme", keys)) == [True, False, False]


# -- p1: a TTL moved by a later put reaches the remote copy ----------------------------------------
def test_a_deadline_moved_by_a_later_put_reaches_the_remote_copy(servers) -> None:
    """The second put moved the deadline locally (and on NVMe) but not in Redis: another
    server read the old deadline there, missed the blocks and deleted them."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
    kv = make_kv(SPEC, 2)
    a.put("acme", SPEC, keys, kv, ttl_s=10.0)
    a.flush()
    a.put("acme", SPEC, keys, kv, ttl_s=100.0)  # moves the deadline
    a.flush()
    servers.clock.advance(20.0)
    assert torch.equal(b.get("acme", SPEC, keys), kv)
    assert [b._index.get("acme", k).ttl_deadline for k in keys] == [servers.clock() + 80.0] * 2
    raw = redis.Redis.from_url(servers.url)
    try:  # Redis' own expiry moved too (the cap is 7 days): 80 s left, not none
        assert 70_000 < raw.pttl(a._remote.redis_key(_refs("acme", keys)[1])) <= 100_000
        children = a._remote._children_key("acme", SPEC.fingerprint, keys[0])
        assert 70_000 < raw.pttl(children) <= 100_000  # keys[1]'s parent's children set
    finally:
        raw.close()
    servers.clock.advance(80.0)
    assert b.get("acme", SPEC, keys).shape[0] == 0


# -- p2: a tenant deleted and created again, seen by a server with the old key cached --------------
def _recreated(servers):
    """B read the tenant's blocks (its data key is cached there); A deleted the tenant, and a
    put created it again (a new data key) with a new chain. B does not read the deletions stream:
    it missed the deletion (with it, B forgets the cached key at once)."""
    a, b = servers("a"), servers("b", remote={"share_deletions": False})
    old = a.block_keys("acme", SPEC, tokens(2, SPEC))
    a.put("acme", SPEC, old, make_kv(SPEC, 2))
    a.flush()
    assert b.get("acme", SPEC, old).shape[0] == 2  # the old key is cached in B now
    a.drop_tenant("acme")
    servers.clock.advance(1.0)
    new = a.block_keys("acme", SPEC, tokens(2, SPEC, start=1_000))
    kv = make_kv(SPEC, 2, seed=5)
    a.put("acme", SPEC, new, kv)
    a.flush()
    return a, b, new, kv


def test_a_reader_with_a_stale_key_rereads_it_and_deletes_nothing(servers) -> None:
    """B decrypted the new blocks with the destroyed key it had cached: integrity failures,
    and it DELETED them (valid blocks, for every server)."""
    a, b, new, kv = _recreated(servers)
    assert torch.equal(b.get("acme", SPEC, new), kv)
    assert b._remote.metrics().get("integrity_failures", 0) == 0
    assert b._remote.metrics()["key_rereads"] == 1
    assert a._remote.contains_many(_refs("acme", new)) == [True, True]


def test_a_writer_with_a_stale_key_writes_with_the_tenants_new_key(servers) -> None:
    """B wrote its new blocks with the destroyed key it had cached: nobody could read them
    (A took them for damaged and deleted them)."""
    a, b, _, _ = _recreated(servers)
    mine = b.block_keys("acme", SPEC, tokens(1, SPEC, start=5_000))
    kv = make_kv(SPEC, 1, seed=9)
    b.put("acme", SPEC, mine, kv)
    b.flush()
    assert b._remote.metrics()["put_stale_key"] == 1  # found out, taken back, written again
    assert torch.equal(a.get("acme", SPEC, mine), kv)
    assert a._remote.metrics().get("integrity_failures", 0) == 0


def test_a_value_under_a_destroyed_key_is_a_miss_and_is_deleted(servers) -> None:
    """A copy made with the tenant's old key (kept by the operator, or written by a server
    that missed the deletion) is read as what it is: under a key the tenant no longer has."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(1, SPEC))
    a.put("acme", SPEC, keys, make_kv(SPEC, 1))
    a.flush()
    raw = redis.Redis.from_url(servers.url)
    try:
        rkey = a._remote.redis_key(_refs("acme", keys)[0])
        straggler = raw.get(rkey)
        a.drop_tenant("acme")
        servers.clock.advance(1.0)
        a.put("acme", SPEC, a.block_keys("acme", SPEC, tokens(1, SPEC, start=99)), make_kv(SPEC, 1))
        a.flush()  # the tenant has a new key
        raw.set(rkey, straggler)
        assert b.get("acme", SPEC, keys).shape[0] == 0
        assert b._remote.metrics()["misses_foreign_key"] == 1
        assert raw.get(rkey) is None
    finally:
        raw.close()


# -- p8/p12: deletions count blocks, not copies ----------------------------------------------------
def test_deletions_count_each_block_once(servers) -> None:
    """A block with a local and a remote copy was counted twice: delete of a 3-block chain
    answered 6, drop_tenant and purge_model summed the tiers too."""
    a = servers("a")
    for tenant in ("acme", "globex", "initech"):
        keys = a.block_keys(tenant, SPEC, tokens(3, SPEC))
        a.put(tenant, SPEC, keys, make_kv(SPEC, 3))
    a.flush()
    assert a.delete("acme", [a.block_keys("acme", SPEC, tokens(3, SPEC))[0]]) == 3
    assert a.drop_tenant("globex") == 3
    assert a.purge_model(SPEC.fingerprint) == 3  # initech's
    b = servers("b", remote_write="demote")  # no remote copies: the same answers
    keys = b.block_keys("acme", SPEC, tokens(3, SPEC))
    b.put("acme", SPEC, keys, make_kv(SPEC, 3))
    assert b.delete("acme", [keys[0]]) == 3


# -- p16: clock skew -------------------------------------------------------------------------------
def test_a_server_whose_clock_runs_ahead_does_not_delete_valid_copies(tmp_path, redis_ns) -> None:
    """B's clock is 40 s ahead of A's: B read A's copies (30 s TTL) as expired and deleted
    them, though A (and Redis) still had 30 s to serve them."""
    url, ns = redis_ns
    clocks = {"a": FakeClock(1_000_000.0), "b": FakeClock(1_000_040.0)}
    stores = {name: Store.open(StoreConfig(
        path=tmp_path / name, hbm_bytes=16 * N, dram_bytes=0, nvme_bytes=0, master_key=MASTER,
        remote_write="through", remote=RemoteConfig(urls=[url], namespace=ns)), clock=clock)
        for name, clock in clocks.items()}
    a, b = stores["a"], stores["b"]
    try:
        keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
        kv = make_kv(SPEC, 2)
        a.put("acme", SPEC, keys, kv, ttl_s=30.0)
        a.flush()
        assert b.get("acme", SPEC, keys).shape[0] == 0  # expired on B's clock: a miss there
        assert _in_redis(url, a, "acme", keys) == [True, True]  # kept
        # A drops its local copies (as eviction would)
        for m in sorted(a._index.of_tenant("acme"), key=lambda m: -m.depth):
            a._place.drop(m, reason="test")
        assert torch.equal(a.get("acme", SPEC, keys), kv)  # A serves them from Redis
        clocks["b"].advance(60.0)  # past the deadline by more than the grace on B's clock too
        assert b.get("acme", SPEC, keys).shape[0] == 0
        assert _in_redis(url, b, "acme", keys) == [False, True]  # the first is deleted
    finally:
        for s in stores.values():
            s.close()


def test_a_key_lost_without_a_tombstone_is_not_replaced(servers) -> None:
    """The tenant's wrapped key vanished from Redis with no deletion (a cluster node lost, a
    flush): a writer holding it goes on writing with it (its blocks stay readable to the
    servers that hold it) instead of replacing it and orphaning every block already written."""
    a = servers("a")
    old = a.block_keys("acme", SPEC, tokens(2, SPEC))
    kv = make_kv(SPEC, 2)
    a.put("acme", SPEC, old, kv)
    a.flush()
    raw = redis.Redis.from_url(servers.url)
    try:
        raw.delete(f"{servers.ns}:keyring:" + b"acme".hex())
    finally:
        raw.close()
    new = a.block_keys("acme", SPEC, tokens(1, SPEC, start=500))
    a.put("acme", SPEC, new, kv[:1])
    a.flush()
    assert a._remote.metrics()["put_key_absent"] == 1
    assert a._remote.contains_many(_refs("acme", old + new)) == [True] * 3
    for m in sorted(a._index.of_tenant("acme"), key=lambda m: -m.depth):
        a._place.drop(m, reason="test")
    assert torch.equal(a.get("acme", SPEC, old), kv)
    assert torch.equal(a.get("acme", SPEC, new), kv[:1])
