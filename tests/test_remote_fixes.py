"""Remote (Redis/Valkey) tier fixes: deadlines that travel with remote copies, deletions that
reach descendants and fail loudly, tenant tombstones honoured by every server, accounting that
recovers when keys vanish, keyring reads under the circuit breaker.

Tests that share a Redis use the ``redis_ns`` fixture (own namespace); tests that flush or pause
Redis start their own ``redis-server`` on a loopback port (:mod:`remote_harness`). Time is the
injected clock; nothing sleeps.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from conftest import MASTER, FakeClock, make_kv, tokens
from remote_harness import PrivateRedis

from kvstore.config import StoreConfig
from kvstore.errors import Unavailable
from kvstore.keyring import Keyring
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef
from tiers.remote import ENVELOPE, RemoteTier
from tiers.remote_config import RemoteConfig

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
N = SPEC.block_nbytes


def _refs(tenant: str, keys: list[bytes]) -> list[BlockRef]:
    return [BlockRef(tenant, k, SPEC) for k in keys]


# -- 1. a remote copy carries its deadline ---------------------------------------------------------
def test_a_block_promoted_from_remote_keeps_its_deadline(servers) -> None:
    """B promoted A's blocks with the tenant's default TTL (none): they were served after the
    deadline A put them with, and a re-spill wrote them for the remote cap (7 days)."""
    a, b = servers("a"), servers("b")
    clock = servers.clock
    keys = a.block_keys("acme", SPEC, tokens(3, SPEC))
    kv = make_kv(SPEC, 3)
    a.put("acme", SPEC, keys, kv, ttl_s=100.0)
    a.flush()
    deadline = clock() + 100.0
    assert torch.equal(b.get("acme", SPEC, keys), kv)  # served by Redis, promoted into B
    promoted = [b._index.get("acme", k) for k in keys]
    assert all(m is not None and m.tier.label == "hbm" for m in promoted)
    assert [m.ttl_deadline for m in promoted] == [deadline] * 3  # was None
    clock.advance(101.0)
    assert b.get("acme", SPEC, keys).shape[0] == 0
    assert b.lookup("acme", SPEC, keys).num_blocks == 0


def test_an_expired_remote_copy_is_a_miss_and_is_deleted(servers) -> None:
    """Redis expires a copy on its own clock; a copy read at or past the deadline it was
    written with (the Store's clock) is a miss, and is deleted once ``skew_grace_s`` past it."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
    a.put("acme", SPEC, keys, make_kv(SPEC, 2), ttl_s=50.0)
    a.flush()
    servers.clock.advance(50.0)
    assert b.get("acme", SPEC, keys).shape[0] == 0
    assert b._remote.metrics()["misses_expired"] == 1
    raw = redis.Redis.from_url(servers.url)
    try:
        rkeys = [a._remote.redis_key(r) for r in _refs("acme", keys)]
        assert [raw.exists(k) for k in rkeys] == [1, 1]  # within the grace: kept
        assert a._remote.contains_many(_refs("acme", keys)) == [False, False]  # but expired
        servers.clock.advance(60.0)
        assert b.get("acme", SPEC, keys).shape[0] == 0
        assert [raw.exists(k) for k in rkeys] == [0, 1]  # the first is gone
    finally:
        raw.close()
    assert b._index.get("acme", keys[0]) is None


def test_respill_and_update_ttl_keep_the_deadline_in_the_value(servers) -> None:
    """The deadline a block is written with comes back with it (get ``info``), after a move of
    its TTL too; a value without the envelope (an older version) says nothing."""
    a = servers("a")
    t = a._remote
    clock = servers.clock
    ref = BlockRef("acme", bytes(range(32)), SPEC)
    data = np.arange(N, dtype=np.uint8)
    assert t.put(ref, data, ttl_deadline=clock() + 30.0, created=clock() - 5.0)
    info: list = []
    out = np.zeros(N, np.uint8)
    assert t.get_into(ref, out, info=info) and np.array_equal(out, data)
    assert info[0].deadline == clock() + 30.0 and info[0].created == clock() - 5.0
    assert t.update_ttl(ref, clock() + 90.0)
    info.clear()
    assert t.get_into(ref, out, info=info) and info[0].deadline == clock() + 90.0
    assert t.update_ttl(ref, None)
    info.clear()
    assert t.get_into(ref, out, info=info) and info[0].deadline is None
    raw = redis.Redis.from_url(servers.url)
    try:
        other = BlockRef("acme", bytes(range(1, 33)), SPEC)
        assert t.put(other, data)
        value = raw.get(t.redis_key(other))
        raw.set(t.redis_key(other), value[ENVELOPE.size:])  # as an older version wrote it
        info.clear()
        assert t.get_into(other, out, info=info) and not info[0].known
        assert np.array_equal(out, data)
        assert not t.update_ttl(other, clock() + 5.0)  # never rewrites a value it cannot parse
        assert raw.get(t.redis_key(other)) == value[ENVELOPE.size:]
    finally:
        raw.close()


# -- 2. delete reaches the descendants' remote copies ----------------------------------------------
def test_delete_removes_the_descendants_remote_copies(servers) -> None:
    """A deleted its block and, locally, its descendants; their remote copies stayed, and B
    found and served them as the continuation of the deleted block."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(4, SPEC))
    a.put("acme", SPEC, keys, make_kv(SPEC, 4))
    a.flush()
    assert a.delete("acme", [keys[1]]) >= 3
    assert a._remote.contains_many(_refs("acme", keys)) == [True, False, False, False]
    assert b.lookup("acme", SPEC, keys[2:], parent=keys[1]).num_blocks == 0
    assert b.get("acme", SPEC, keys[2:], parent=keys[1]).shape[0] == 0
    assert b.get("acme", SPEC, keys[3:], parent=keys[2]).shape[0] == 0
    assert b.lookup("acme", SPEC, keys).tiers == ["remote"]


def test_a_continuation_of_a_deleted_parent_is_not_served_from_remote(servers) -> None:
    """Blocks B put under A's block: A's delete of that block finds them (B's writes recorded
    them in their parent's children set in Redis), and no server serves them after it."""
    a, b, d = servers("a"), servers("b"), servers("d")
    keys = a.block_keys("acme", SPEC, tokens(4, SPEC))
    kv = make_kv(SPEC, 4)
    a.put("acme", SPEC, keys[:2], kv[:2])
    a.flush()
    assert b.get("acme", SPEC, keys[:2]).shape[0] == 2  # B holds the parent now
    b.put("acme", SPEC, keys[2:], kv[2:], parent=keys[1])
    b.flush()
    a.delete("acme", [keys[1]])  # A never held keys[2:]: their remote copies go too
    assert a._remote.contains_many(_refs("acme", keys[2:])) == [False, False]
    assert d.get("acme", SPEC, keys[2:], parent=keys[1]).shape[0] == 0  # was 2


# -- 3. a delete that cannot reach Redis fails ---------------------------------------------------
def test_delete_during_a_redis_fault_fails_and_deletes_nothing(tmp_path: Path,
                                                               private_redis: PrivateRedis) -> None:
    """The delete said it succeeded while Redis was paused; when it came back the blocks were
    served again. Now it raises Unavailable, keeps everything, and a retry deletes it all."""
    clock = FakeClock()
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=16 * N, dram_bytes=0, nvme_bytes=0,
                      master_key=MASTER, remote_write="through",
                      remote=RemoteConfig(urls=[private_redis.url], op_timeout_s=0.2, retries=0))
    s = Store.open(cfg, clock=clock)
    try:
        keys = s.block_keys("acme", SPEC, tokens(3, SPEC))
        s.put("acme", SPEC, keys, make_kv(SPEC, 3))
        s.flush()
        private_redis.pause()
        try:
            with pytest.raises(Unavailable, match="retry the delete"):
                s.delete("acme", [keys[1]])
        finally:
            private_redis.resume()
        # nothing deleted here (Redis may have run the UNLINK it got before it paused: a
        # timed-out command's outcome is unknown, which is why the caller must retry)
        assert s.lookup("acme", SPEC, keys).tiers == ["hbm"] * 3
        s._remote._breakers.clear()  # the open period is over
        assert s.delete("acme", [keys[1]]) >= 2
        assert s.lookup("acme", SPEC, keys).tiers == ["hbm"]
        assert s._remote.contains_many(_refs("acme", keys)) == [True, False, False]
    finally:
        s.close()


def test_delete_cancels_queued_and_in_flight_demotions(servers) -> None:
    """A block deleted while its demotion waited in the queue (or was being written) was
    written after the delete: back in Redis."""
    a = servers("a")
    t = a._remote
    entered, release = threading.Event(), threading.Event()
    real = t._put_with

    def slow(scratch, ref, *args):
        if ref.key == b"\x01" * 32:
            entered.set()
            release.wait(10)
        return real(scratch, ref, *args)

    t._put_with = slow  # type: ignore[method-assign]
    busy, queued = BlockRef("acme", b"\x01" * 32, SPEC), BlockRef("acme", b"\x02" * 32, SPEC)
    assert t.submit(busy, np.ones(N, np.uint8)) and t.submit(queued, np.ones(N, np.uint8))
    assert entered.wait(10)
    t.delete_many([queued])  # still queued: taken out
    done = threading.Thread(target=t.delete_many, args=([busy],))
    done.start()  # being written: waits for it, then deletes it
    release.set()
    done.join(10)
    assert t.flush(10)
    assert t.contains_many([busy, queued]) == [False, False]
    assert t.metrics()["queue_cancelled"] >= 2


# -- 4. a deleted tenant stays deleted on every server ---------------------------------------------
def test_a_dropped_tenant_is_not_brought_back_by_another_server(servers) -> None:
    """B held the tenant's blocks (promoted); after A dropped the tenant, B re-created its key
    in the shared keyring once its cached copy expired and wrote the blocks back for all. B does
    not read the deletions stream: it missed the deletion (with it, B drops its copies at once)."""
    a, b, c = servers("a"), servers("b", hbm=4, remote={"share_deletions": False}), servers("c")
    keys = a.block_keys("acme", SPEC, tokens(4, SPEC))
    a.put("acme", SPEC, keys, make_kv(SPEC, 4))
    a.flush()
    assert b.get("acme", SPEC, keys).shape[0] == 4  # B holds them now
    a.drop_tenant("acme")
    # B's cached copies of the key (and of the tombstone) expire: key_cache_ttl_s
    b._remote._keyring._cache.clear()
    getattr(b._remote, "_marks", {}).clear()
    # B makes room: acme's blocks leave its HBM for the remote tier
    other = b.block_keys("other", SPEC, tokens(4, SPEC, start=10_000))
    b.put("other", SPEC, other, make_kv(SPEC, 4, seed=1))
    b.flush()
    assert b._index.get("acme", keys[0]) is None  # evicted from B
    assert b.stats()["counters"].get("remote_put_tenant_deleted", 0) >= 1
    assert c.lookup("acme", SPEC, keys).num_blocks == 0
    assert c.get("acme", SPEC, keys).shape[0] == 0
    raw = redis.Redis.from_url(servers.url)
    try:
        assert not raw.exists(f"{servers.ns}:keyring:{b'acme'.hex()}")  # not re-created
    finally:
        raw.close()
    # a tenant created again under the name: its new blocks are stored as usual
    servers.clock.advance(1.0)
    fresh = a.block_keys("acme", SPEC, tokens(2, SPEC, start=50_000))
    kv = make_kv(SPEC, 2, seed=2)
    a.put("acme", SPEC, fresh, kv)
    a.flush()
    assert torch.equal(c.get("acme", SPEC, fresh), kv)


def test_a_stale_copy_written_after_the_drop_is_a_miss(servers) -> None:
    """A copy of a block made before its tenant's deletion, written by a server that had not
    seen the deletion yet (unencrypted tier: no key to shred), is a miss and is deleted."""
    a, b = servers("a", remote={"encrypt": False}), servers("b", remote={"encrypt": False})
    clock = servers.clock
    ref = BlockRef("acme", b"\x07" * 32, SPEC)
    made = clock()
    clock.advance(1.0)
    a.drop_tenant("acme")
    # B wrote it with a stale view (simulated: the tombstone check is skipped)
    b._remote._marks["acme"] = (None, b._remote._monotonic())
    assert b._remote.put(ref, np.ones(N, np.uint8), created=made)
    b._remote._marks.clear()
    assert not a._remote.get_into(ref, np.zeros(N, np.uint8))
    assert a._remote.metrics()["misses_tenant_deleted"] == 1
    assert a._remote.contains_many([ref]) == [False]
    # and no server writes it once it knows
    assert not b._remote.put(ref, np.ones(N, np.uint8), created=made)
    assert b._remote.put(ref, np.ones(N, np.uint8), created=clock() + 1.0)


# -- 5. remote accounting recovers -----------------------------------------------------------------
def test_remote_accounting_follows_purge_and_a_flushall(tmp_path: Path,
                                                        private_redis: PrivateRedis) -> None:
    """After purge_model, or a FLUSHALL of the Redis, the blocks still counted against the
    tenant's remote quota refused every new block."""
    clock = FakeClock()
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=16 * N, dram_bytes=0, nvme_bytes=0,
                      master_key=MASTER, remote_write="through",
                      remote=RemoteConfig(urls=[private_redis.url], accounting_resync_s=0))
    s = Store.open(cfg, clock=clock)
    t = s._remote
    try:
        s.set_tenant_policy("acme", quota_bytes={"remote": 2 * N})

        def put(start: int) -> list[bool]:
            keys = s.block_keys("acme", SPEC, tokens(2, SPEC, start=start))
            s.put("acme", SPEC, keys, make_kv(SPEC, 2, seed=start))
            s.flush()
            return t.contains_many(_refs("acme", keys))

        put(0)
        assert t.tenant_bytes("acme") == 2 * N
        s.purge_model(SPEC.fingerprint)
        assert t.tenant_bytes("acme") == 0 and t.usage().blocks == 0  # was 2 blocks
        put(1000)
        assert t.tenant_bytes("acme") == 2 * N
        raw = private_redis.raw()
        try:
            raw.flushall()
        finally:
            raw.close()
        rejected = t.metrics().get("quota_rejected", 0)
        # the first is refused (the stale count), which has the writer re-count; the second
        # may come after the re-count, and be stored
        put(2000)
        assert t.metrics()["quota_rejected"] > rejected
        assert t.metrics()["resync_forgotten"] == 2
        assert t.tenant_bytes("acme") < 2 * N
        stored = put(3000)  # every block was refused before
        assert any(stored) and t.tenant_bytes("acme") == 2 * N
    finally:
        s.close()


# -- 7. keyring reads go through the breaker -----------------------------------------------------
def test_a_hung_redis_opens_the_breaker_on_keyring_reads(private_redis: PrivateRedis) -> None:
    """A keyring read for a tenant whose key was not cached ran outside the breaker: with Redis
    hung, every put waited for the timeout and the breaker never opened."""
    mono = FakeClock(0.0)
    cfg = RemoteConfig(urls=[private_redis.url], namespace=f"t-{uuid.uuid4().hex[:8]}",
                       op_timeout_s=0.2, retries=0, breaker_failures=2, breaker_base_s=30.0,
                       breaker_cap_s=60.0)
    t = RemoteTier.open(cfg, MASTER, monotonic=mono)
    try:
        private_redis.pause()
        try:
            for i in range(5):
                assert not t.put(BlockRef(f"tenant{i}", bytes([i]) * 32, SPEC), np.ones(N, np.uint8))
        finally:
            private_redis.resume()
        m = t.metrics()
        assert m["faults"] == 2 and m["breaker_trips"] == 1 and m["breaker_skips"] == 3
        mono.advance(61.0)  # the open period is over: the probe succeeds
        assert t.put(BlockRef("tenant0", bytes(32), SPEC), np.ones(N, np.uint8))
        assert t.metrics()["breakers_open"] == 0
    finally:
        t.close()


def test_a_cached_key_is_served_while_another_tenants_read_hangs() -> None:
    """The keyring held one lock over its cache and the backend read: a hung read of one
    tenant's key held every other tenant's cached key."""
    entered, release = threading.Event(), threading.Event()

    class Slow(dict):
        def get(self, name, default=None):  # the keyring reads through .get
            if name == "slow":
                entered.set()
                release.wait(30)
            return super().get(name, default)

    ring = Keyring(MASTER, Slow())
    fast = ring.data_key("fast")
    hung = threading.Thread(target=ring.data_key, args=("slow",))
    hung.start()
    try:
        assert entered.wait(10)
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(ring.data_key("fast")))
        reader.start()
        reader.join(10)  # NOTE: a liveness check, not a timing one: it blocked until release
        assert got == [fast]
        assert ring.cached("fast") == fast and ring.cached("slow") is None
    finally:
        release.set()
        hung.join(10)
    assert ring.cached("slow") is not None
