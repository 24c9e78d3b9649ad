"""Remote (Redis/Valkey) tier fixes, round 15: a full Redis, a tenant deletion of a name this
server has no principal of, the keyring's check entry lost by Redis, and eviction policies that
evict the tier's bookkeeping keys.

Tests that change the Redis' configuration (maxmemory, policy, ACL users) start their own
``redis-server`` (``private_redis``); the others share one through the ``servers`` fixture (own
namespace). Nothing is flushed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
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

from kvstore.audit import AuditLog
from kvstore.auth import AuthRegistry, Role
from kvstore.config import StoreConfig
from kvstore.errors import FailedPrecondition, NotFound
from kvstore.keyring import Keyring
from kvstore.service_admin import AdminPlane
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


# -- 2: deleting a name with no principal here -------------------------------------------------------
def _admin(tmp: Path, store: Store) -> AdminPlane:
    return AdminPlane(store, AuthRegistry(tmp / "principals.json", clock=time.time),
                      AuditLog(tmp / "audit.log", clock=time.time, fsync=False))


def test_deleting_a_name_without_a_principal_here_leaves_the_remote_tier_alone(servers, tmp_path: Path) -> None:
    """Sidecar A's admin deleting a name whose principal lives on sidecar B only (same Redis):
    A answered NotFound (or OK) but had written the tenant's tombstone, destroyed its shared
    data key and blocks in Redis and published the drop: B's tenant lost every block."""
    a, b = servers("a"), servers("b")
    adm_a = _admin(tmp_path / "adm-a", a)
    adm_b = _admin(tmp_path / "adm-b", b)
    adm_b.create_tenant("acme", Role.TENANT, [])
    keys = b.block_keys("acme", SPEC, tokens(4, SPEC))
    b.put("acme", SPEC, keys, make_kv(SPEC, 4))
    b.flush()
    raw = redis.Redis.from_url(servers.url)
    try:
        with pytest.raises(NotFound):
            adm_a.delete_tenant("acme")
        assert not raw.exists(f"{servers.ns}:dropped:" + b"acme".hex())
        assert raw.exists(f"{servers.ns}:keyring:" + b"acme".hex())
        assert [raw.exists(b._remote.redis_key(r)) for r in _refs("acme", keys)] == [1] * 4
        assert b._remote.metrics().get("deletions_applied", 0) == 0
        assert b.lookup("acme", SPEC, keys).num_blocks == 4
        assert b.get("acme", SPEC, keys).shape[0] == 4
    finally:
        raw.close()


def test_local_leftovers_of_a_name_without_principal_are_dropped_here_only(servers, tmp_path: Path) -> None:
    """The clean-up of a name with no principal drops this server's blocks; the Redis copies
    (another server's tenant of the name) stay."""
    a, b = servers("a"), servers("b")
    adm_a = _admin(tmp_path / "adm-a", a)
    keys = a.block_keys("acme", SPEC, tokens(3, SPEC))
    a.put("acme", SPEC, keys, make_kv(SPEC, 3))  # leftovers here: no principal of acme on A
    a.flush()
    adm_a.delete_tenant("acme")  # something was left: cleaned up, OK
    assert a.lookup("acme", SPEC, keys).tiers == ["remote"] * 3  # no local copy left
    assert b.get("acme", SPEC, keys).shape[0] == 3


# -- 3: the keyring's check entry lost by Redis ----------------------------------------------------
def test_a_lost_check_entry_is_written_again_when_a_key_is_read(private_redis, tmp_path: Path) -> None:
    """Written only when the keyring opened: once Redis lost it (restarted empty, evicted), a
    server with another master key opened the namespace, and the first servers then could
    neither read its blocks nor restart."""
    a = _store(tmp_path, "a", private_redis.url, "k1")
    raw = private_redis.raw()
    try:
        for k in raw.scan_iter(match="k1:*"):  # what a restart of a Redis without persistence does
            raw.unlink(k)
        keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
        a.put("acme", SPEC, keys, make_kv(SPEC, 2))  # a data key made: the check entry with it
        a.flush()
        assert raw.exists("k1:keyring:")
        with pytest.raises(FailedPrecondition, match="'k1'"):
            _store(tmp_path, "c", private_redis.url, "k1", master=OTHER_MASTER)
    finally:
        raw.close()
        a.close()


def test_a_check_entry_of_another_master_key_refuses_key_reads() -> None:
    """A backend that lost the check entry, then got another master key's: this keyring refuses
    every key it reads or creates there, naming where."""
    backend: dict[str, bytes] = {}
    mine = Keyring(MASTER, backend, recheck=True, where="the Redis namespace 'ns'")
    mine.data_key("acme")
    backend.clear()  # lost
    Keyring(OTHER_MASTER, backend)  # another deployment's keyring writes its check entry
    with pytest.raises(FailedPrecondition, match="the Redis namespace 'ns'"):
        mine.data_key("beta")
    mine.forget("acme")
    with pytest.raises(FailedPrecondition, match="the Redis namespace 'ns'"):
        mine.data_key("acme", create=False)


# -- 4: eviction policies that evict the bookkeeping keys ----------------------------------------------
@pytest.mark.parametrize(("policy", "flag"), [("allkeys-lru", 1), ("volatile-lru", 0), ("noeviction", 0)])
def test_an_allkeys_eviction_policy_is_warned_of(private_redis, tmp_path: Path, caplog, policy: str,
                                                 flag: int) -> None:
    raw = private_redis.raw()
    raw.config_set("maxmemory-policy", policy)
    raw.close()
    with caplog.at_level(logging.WARNING, logger="tiers.remote"):
        a = _store(tmp_path, "a", private_redis.url, "e1")
    try:
        assert a.stats()["counters"]["remote_allkeys_eviction"] == flag
        assert any("allkeys-lru" in r.getMessage() for r in caplog.records) == bool(flag)
    finally:
        a.close()


def test_a_refused_config_get_is_skipped_silently(private_redis, tmp_path: Path) -> None:
    """ACLs (or a managed Redis) refuse CONFIG GET: the tier opens, nothing is counted."""
    raw = private_redis.raw()
    raw.config_set("maxmemory-policy", "allkeys-lru")
    raw.acl_setuser("kv", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                    commands=["+@all", "-config"])
    raw.close()
    a = _store(tmp_path, "a", private_redis.url, "e2", username="kv", password="pw")
    try:
        keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
        a.put("acme", SPEC, keys, make_kv(SPEC, 2))
        a.flush()
        m = a._remote.metrics()
        assert m["allkeys_eviction"] == 0 and m.get("error_replies", 0) == 0 and m["puts"] == 2
    finally:
        a.close()


def test_a_lost_models_set_is_made_again_by_the_next_write(servers) -> None:
    """The models set was added to once per model per process: evicted (or lost with a
    restarted Redis), it was never made again, and a delete on a server that never saw the
    model (restarted, another replica) removed nothing while answering as if done."""
    a, b = servers("a"), servers("b")
    x = a.block_keys("acme", SPEC, tokens(4, SPEC))
    a.put("acme", SPEC, x, make_kv(SPEC, 4))
    a.flush()
    raw = redis.Redis.from_url(servers.url)
    try:
        raw.unlink(f"{servers.ns}:models")  # what an allkeys-* eviction did
        more = a.block_keys("acme", SPEC, tokens(4, SPEC, start=500))
        a.put("acme", SPEC, more, make_kv(SPEC, 4, seed=1))
        a.flush()
        assert raw.smembers(f"{servers.ns}:models") == {SPEC.fingerprint}
    finally:
        raw.close()
    c = servers("c")  # never saw the model
    assert c.delete("acme", x) == 4
    assert b.get("acme", SPEC, x).shape[0] == 0


# -- stats: a tenant whose blocks all went down to the remote tier ---------------------------------
def test_a_tenant_held_only_by_the_remote_tier_has_its_stats_row(servers) -> None:
    """stats()["tenants"] (and the kvstore_store_tenants gauges) showed a tenant's remote bytes
    only next to local ones: once every block of it was demoted to Redis, it had no row."""
    s = servers("a", hbm=4, remote_write="demote", high_watermark=1.0, low_watermark=1.0)
    ka = s.block_keys("acme", SPEC, tokens(4, SPEC))
    s.put("acme", SPEC, ka, make_kv(SPEC, 4))
    s.put("globex", SPEC, s.block_keys("globex", SPEC, tokens(4, SPEC, start=500)), make_kv(SPEC, 4))
    s.flush()
    assert set(s.lookup("acme", SPEC, ka).tiers) == {"remote"}
    row = s.stats()["tenants"]["acme"]
    assert row == {"remote": 4 * N}


# -- a stop that closes the deletions reader's client under its read logs no error ---------------
def test_the_deletions_reader_stopped_under_a_read_logs_no_error(servers, caplog) -> None:
    """stop_deletions closes the reader's client from another thread; a read between two
    XREADs then raised redis-py's TypeError, logged at ERROR with a traceback at every close."""
    s = servers("a", remote={"deletions_block_s": 0.05})
    tier = s._remote
    assert tier._reader is not None and tier._reader.is_alive()

    def closed_under_the_read(*args, **kwargs):
        tier._reader_stop.set()  # what the stop does, then closes the client the read uses
        raise TypeError("argument must be an int, or have a fileno() method.")

    tier._reader_client.xread = closed_under_the_read
    with caplog.at_level(logging.WARNING, logger="tiers.remote_invalidate"):
        tier._reader.join(timeout=10)
    assert not tier._reader.is_alive()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
