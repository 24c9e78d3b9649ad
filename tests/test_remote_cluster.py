"""Remote tier on a real 3-master Redis Cluster started by the test (loopback ports, temp dir).

Covers: keys spread over every node, pipelined lookups/gets across nodes, tenant deletion on
every primary, a slot migrated mid-run (ASK then MOVED, followed by redis-py's cluster client),
and a node killed mid-run (misses counted, no exception, no wrong bytes, recovery on restart).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
from remote_harness import LocalCluster

from kvstore.spec import ModelSpec
from tiers.base import BlockRef
from tiers.remote import RemoteTier
from tiers.remote_config import RemoteConfig

MASTER = bytes(range(32))
SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=16,
                 dtype="bfloat16", block_tokens=8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("cluster")).start()
    yield c
    c.stop()


@pytest.fixture
def tier(cluster: LocalCluster) -> Iterator[RemoteTier]:
    cfg = RemoteConfig(urls=cluster.urls, cluster=True, namespace=f"c-{uuid.uuid4().hex[:8]}",
                       retries=0, connect_timeout_s=0.5, op_timeout_s=1.0, breaker_failures=2,
                       breaker_base_s=0.1, breaker_cap_s=0.5)
    t = RemoteTier.open(cfg, MASTER)
    yield t
    t.close()


def ref(i: int, tenant: str = "a") -> BlockRef:
    return BlockRef(tenant, i.to_bytes(4, "little") * 8, SPEC)


def block(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SPEC.block_nbytes, dtype=np.uint8)


def out() -> np.ndarray:
    return np.zeros(SPEC.block_nbytes, dtype=np.uint8)


def owner(cluster: LocalCluster, key: bytes) -> int:
    """Port of the node that owns ``key``'s slot (asked to the cluster, not the client)."""
    c = cluster.node(cluster.ports[0])
    try:
        slot = c.execute_command("CLUSTER", "KEYSLOT", key)
        for start, end, (_, port, *_), *_ in c.execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return int(port)
    finally:
        c.close()
    raise AssertionError("slot not covered")


def test_blocks_spread_over_nodes_and_round_trip(cluster: LocalCluster, tier: RemoteTier) -> None:
    refs = [ref(i) for i in range(30)]
    for i, r in enumerate(refs):
        assert tier.put(r, block(i))
    assert len({owner(cluster, tier.redis_key(r)) for r in refs}) == 3
    assert tier.contains_many(refs) == [True] * 30
    outs = [out() for _ in refs]
    assert tier.get_prefix_into(refs, outs) == 30
    assert all(np.array_equal(outs[i], block(i)) for i in range(30))
    for i in range(5):
        assert tier.put(ref(i, "b"), block(i))
    assert tier.delete_tenant("a") == 30  # SCAN on every primary
    assert tier.contains_many(refs) == [False] * 30
    assert tier.contains_many([ref(i, "b") for i in range(5)]) == [True] * 5


def test_slot_migration_ask_then_moved(cluster: LocalCluster, tier: RemoteTier) -> None:
    r1, r2 = ref(1000), ref(1001)
    assert tier.put(r1, block(1000))
    k1 = tier.redis_key(r1)
    src = owner(cluster, k1)
    dst = next(p for p in cluster.ports if p != src)
    s, d = cluster.node(src), cluster.node(dst)
    try:
        slot = s.execute_command("CLUSTER", "KEYSLOT", k1)
        src_id, dst_id = cluster.node_id(src), cluster.node_id(dst)
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        s.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
        # mid-migration: the source answers ASK for keys it no longer has
        o = out()
        assert tier.get_into(r1, o) and np.array_equal(o, block(1000))
        outs = [out()]
        assert tier.get_prefix_into([r1], outs) == 1 and np.array_equal(outs[0], block(1000))
        for p in cluster.ports:
            n = cluster.node(p)
            n.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            n.close()
        # after: the client's cached slot map is stale, the old owner answers MOVED
        o = out()
        assert tier.get_into(r1, o) and np.array_equal(o, block(1000))
        assert tier.contains_many([r1, r2]) == [True, False]
        assert owner(cluster, k1) == dst
        assert tier.metrics().get("integrity_failures", 0) == 0
    finally:
        s.close()
        d.close()


def test_node_killed_mid_run(cluster: LocalCluster, tier: RemoteTier) -> None:
    refs = [ref(i, "k") for i in range(2000, 2030)]
    for i, r in enumerate(refs):
        assert tier.put(r, block(i))
    victim = owner(cluster, tier.redis_key(refs[0]))
    on_victim = [owner(cluster, tier.redis_key(r)) == victim for r in refs]
    assert 0 < sum(on_victim) < len(refs)
    cluster.kill(victim)
    try:
        before = tier.metrics()
        for _ in range(3):  # repeated reads: the breaker opens, reads stay misses, no raise
            for i, r in enumerate(refs):
                o = out()
                hit = tier.get_into(r, o)
                if hit:
                    assert np.array_equal(o, block(i))
                else:
                    assert not o.any()
                assert hit == (not on_victim[i])
            got = tier.get_many_into(refs, [out() for _ in refs])
            assert got == [not v for v in on_victim]
            assert tier.contains_many(refs) == [not v for v in on_victim]
        after = tier.metrics()
        assert after["misses"] - before.get("misses", 0) == 6 * sum(on_victim)
        assert after["faults"] > before.get("faults", 0)
        assert after.get("breaker_skips", 0) > 0
        assert not tier.put(refs[0], block(0))  # writes to the dead node fail, quietly
    finally:
        cluster.restart(victim)
    cluster.wait_ok()
    # recovery: the node is back (empty), the breaker's probe succeeds, writes land again
    deadline = time.monotonic() + 30
    while not tier.put(refs[0], block(2000)):
        assert time.monotonic() < deadline, "remote tier did not recover"
        time.sleep(0.2)
    for i, r in enumerate(refs):
        if on_victim[i]:
            assert tier.put(r, block(2000 + i))
    outs = [out() for _ in refs]
    assert tier.get_prefix_into(refs, outs) == len(refs)
    for i in range(len(refs)):
        assert np.array_equal(outs[i], block(2000 + i) if on_victim[i] else block(i))
    assert tier.metrics()["breakers_open"] == 0

