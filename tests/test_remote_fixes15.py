"""Remote (Redis/Valkey) tier fixes, round 15: a full Redis, a tenant deletion of a name this
server has no principal of, the keyring's check entry lost by Redis, and eviction policies that
evict the tier's bookkeeping keys.

Tests that change the Redis' configuration (maxmemory, policy, ACL users) start their own
``redis-server`` (``private_redis``); the others share one through the ``servers`` fixture (own
namespace). Nothing is flushed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import redis
from conftest import MASTER, make_kv, tokens
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoPermissionError,
    OutOfMemoryError,
    ResponseError,
    TryAgainError,
)

from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef
from tiers.remote_config import RemoteConfig

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
N = SPEC.block_nbytes
OTHER_MASTER = bytes([7]) * 32


def _store(tmp: Path, name: str, url: str, ns: str, master: bytes = MASTER, **remote: object) -> Store:
    return Store.open(StoreConfig(path=tmp / name, hbm_bytes=64 * N, dram_bytes=0, nvme_bytes=0,
                                  master_key=master, remote_write="through",
                                  remote=RemoteConfig(urls=[url], namespace=ns, **remote)))


def _refs(tenant: str, keys: list[bytes]) -> list[BlockRef]:
    return [BlockRef(tenant, k, SPEC) for k in keys]


# -- 1: a full Redis (maxmemory, noeviction) ------------------------------------------------------
def test_error_replies_are_not_node_faults() -> None:
    """Which errors count toward a node's breaker: the node not serving, not a refused command."""
    from tiers.remote_calls import error_reply

    assert error_reply(OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")) == "oom"
    assert error_reply(NoPermissionError("this user has no permissions")) == "error_replies"
    assert error_reply(ResponseError("WRONGTYPE Operation against a key")) == "error_replies"
    for fault in (redis.ConnectionError("refused"), redis.TimeoutError("timed out"),
                  MovedError("3999 127.0.0.1:6381"), AskError("3999 127.0.0.1:6381"),
                  TryAgainError("TRYAGAIN"), ClusterDownError("CLUSTERDOWN"),
                  ResponseError("BUSY Redis is busy running a script")):
        assert error_reply(fault) is None, fault


def test_a_full_redis_fails_writes_but_keeps_serving_reads(private_redis, tmp_path: Path, caplog) -> None:
    """OOM replies counted as node faults opened the breaker: the blocks Redis held (a full
    Redis serves GET) were misses while it was open, and the OOM showed nowhere."""
    a = _store(tmp_path, "a", private_redis.url, "f1")
    try:
        held = a.block_keys("acme", SPEC, tokens(4, SPEC))
        a.put("acme", SPEC, held, make_kv(SPEC, 4))
        a.flush()
        refs = _refs("acme", held)
        assert a._remote.prefix_len(refs) == 4
        raw = private_redis.raw()
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", "1")  # full: every write is refused with OOM, GET still served
        try:
            with caplog.at_level(logging.WARNING, logger="tiers.remote_calls"):
                for c in range(6):  # new prompts, written through: each refused
                    keys = a.block_keys("acme", SPEC, tokens(2, SPEC, start=1000 * (c + 1)))
                    a.put("acme", SPEC, keys, make_kv(SPEC, 2, seed=c))
                    a.flush()
            m = a._remote.metrics()
            assert m["breakers_open"] == 0 and m.get("breaker_trips", 0) == 0
            assert m.get("oom", 0) > 0 and m.get("faults", 0) == 0
            assert a.stats()["counters"]["remote_oom"] == m["oom"]
            assert a._remote.prefix_len(refs) == 4  # were skipped: the breaker was open
            assert any("maxmemory" in r.getMessage() for r in caplog.records)
        finally:
            raw.config_set("maxmemory", "0")
            raw.close()
    finally:
        a.close()
