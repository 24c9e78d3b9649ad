"""The deletions stream against what a second prober found (each fails on the code before):

* a get on B that fetched a chain from Redis just before A's delete unlinked it promoted the
  chain after B had applied the deletion, when B held no other block of the tenant (the entry
  bumped nothing a get checks), and B served it from then on and wrote it back when evicted;
* a delete on a server that knew no model, before any was written to Redis, published nothing:
  the servers holding the blocks kept serving them;
* a restarted server served blocks deleted while it was down until its reader got to them;
* a server whose first open found no stream counted a missed deletion at its next open.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from conftest import MASTER, make_kv, tokens, wait_until

from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef
from tiers.remote_config import RemoteConfig

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)


def _open(tmp: Path, name: str, url_ns: tuple[str, str], **kw: Any) -> Store:
    url, ns = url_ns
    n = SPEC.block_nbytes
    kw.setdefault("remote_write", "through")
    cfg = StoreConfig(path=tmp / name, hbm_bytes=kw.pop("hbm", 16) * n, dram_bytes=0,
                      nvme_bytes=kw.pop("nvme", 0) * n, master_key=MASTER,
                      remote=RemoteConfig(urls=[url], namespace=ns), **kw)
    return Store.open(cfg)


def _count(s: Store, name: str) -> int:
    return s.stats()["counters"].get(f"remote_{name}", 0)


def test_a_get_in_flight_does_not_promote_a_chain_deleted_elsewhere(tmp_path, redis_ns) -> None:
    a, b = _open(tmp_path, "a", redis_ns), _open(tmp_path, "b", redis_ns)
    try:
        keys = a.block_keys("acme", SPEC, tokens(3, SPEC))
        kv = make_kv(SPEC, 3)
        a.put("acme", SPEC, keys, kv)
        a.flush()
        fetched = threading.Event()
        decode = b._remote.codec.decode

        def held_decode(*args: Any, **kw: Any) -> Any:  # the fetch came back before the delete
            if not fetched.is_set():
                fetched.set()
                assert wait_until(lambda: _count(b, "deletions_applied") >= 1), "B never applied the entry"
            return decode(*args, **kw)

        b._remote.codec.decode = held_decode  # type: ignore[method-assign]
        got: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: got.append(b.get("acme", SPEC, keys)), daemon=True)
        reader.start()
        assert fetched.wait(10)
        assert a.delete("acme", [keys[0]]) == 3
        reader.join(30)
        assert got and got[0].shape[0] in (0, 3)  # served before or not: either is allowed
        assert b.lookup("acme", SPEC, keys).num_blocks == 0, "B promoted the deleted chain"
    finally:
        a.close()
        b.close()


def test_a_delete_on_a_server_that_knows_no_model_still_reaches_the_others(tmp_path, redis_ns) -> None:
    a = _open(tmp_path, "a", redis_ns, remote_write="demote")
    b = _open(tmp_path, "b", redis_ns, remote_write="demote")
    try:
        keys = b.block_keys("acme", SPEC, tokens(3, SPEC))
        b.put("acme", SPEC, keys, make_kv(SPEC, 3))  # local only: nothing in Redis, no model there
        assert a.delete("acme", [keys[0]]) == 0
        assert _count(a, "deletions_published") == 1
        assert wait_until(lambda: b.lookup("acme", SPEC, keys).num_blocks == 0), "B kept serving them"
    finally:
        a.close()
        b.close()


def test_a_restarted_server_applies_the_backlog_before_open_returns(tmp_path, redis_ns) -> None:
    a = _open(tmp_path, "a", redis_ns, hbm=32)
    b = _open(tmp_path, "b", redis_ns, nvme=64, persist_on_close=True)
    keys = a.block_keys("acme", SPEC, tokens(3, SPEC))
    try:
        a.put("acme", SPEC, keys, make_kv(SPEC, 3))
        a.flush()
        assert b.get("acme", SPEC, keys).shape[0] == 3  # promoted: B holds the chain
        b.close()  # ... and keeps it in NVMe
        for i in range(150):  # a backlog of others' deletions, then the chain's
            k = a.block_keys("acme", SPEC, tokens(1, SPEC, start=10_000 + 4 * i))
            a.put("acme", SPEC, k, make_kv(SPEC, 1))
            a.delete("acme", k)
        a.delete("acme", [keys[0]])
        b = _open(tmp_path, "b", redis_ns, nvme=64, persist_on_close=True)
        assert b.lookup("acme", SPEC, keys).num_blocks == 0, "served before its reader caught up"
        assert _count(b, "deletions_applied") >= 151
        assert _count(b, "deletions_missed") == 0
    finally:
        a.close()
        b.close()


def test_a_position_saved_on_an_empty_stream_is_not_a_missed_deletion(tmp_path, redis_ns) -> None:
    b = _open(tmp_path, "b", redis_ns)
    b.close()  # saved its position while the stream did not exist yet
    a = _open(tmp_path, "a", redis_ns)
    try:
        keys = a.block_keys("acme", SPEC, tokens(1, SPEC))
        a.put("acme", SPEC, keys, make_kv(SPEC, 1))
        a.delete("acme", keys)
        b = _open(tmp_path, "b", redis_ns)
        assert _count(b, "deletions_missed") == 0
        assert _count(b, "deletions_applied") == 1
    finally:
        a.close()
        b.close()


def test_purge_model_waits_for_a_write_in_flight_without_the_store_lock(tmp_path, redis_ns) -> None:
    """purge_model entered the writer's filter under the Store's lock, and entering waited for
    a write of the model in flight (up to one write's timeouts, 7 s by default): every call of
    every tenant waited too (a reviewer saw a lookup of another model take 2.8 s)."""
    a = _open(tmp_path, "a", redis_ns)
    try:
        waiting = threading.Event()
        held: list[bool] = []
        wait_writing, put_with = a._remote._wait_writing, a._remote._put_with

        def watched_wait(*args: Any) -> Any:
            waiting.set()
            return wait_writing(*args)

        def stalled_put(*args: Any) -> Any:  # the write in flight while the purge starts
            if not held:
                waiting.wait(10)
                free = a._lock.acquire(timeout=2)
                held.append(not free)
                if free:
                    a._lock.release()
            return put_with(*args)

        a._remote._wait_writing = watched_wait  # type: ignore[method-assign]
        a._remote._put_with = stalled_put  # type: ignore[method-assign]
        keys = a.block_keys("acme", SPEC, tokens(2, SPEC))
        a.put("acme", SPEC, keys, make_kv(SPEC, 2))  # write-through: the writer takes the first
        assert wait_until(lambda: a._remote._writing is not None)
        assert a.purge_model(SPEC.fingerprint) == 2
        assert held == [False], "the purge held the Store's lock while it waited for the write"
    finally:
        a.close()


def test_a_tenant_drop_elsewhere_forgets_the_cached_key_after_the_name_cache_was_cleared(
        tmp_path, redis_ns) -> None:
    """The tenant names came from the tier's name-to-hash cache, cleared past 4,096 names: a
    data key cached before was kept after another server dropped the tenant."""
    a, b = _open(tmp_path, "a", redis_ns), _open(tmp_path, "b", redis_ns)
    try:
        keys = b.block_keys("acme", SPEC, tokens(1, SPEC))
        b.put("acme", SPEC, keys, make_kv(SPEC, 1))
        b.flush()  # written through: B's remote tier caches acme's shared data key
        assert "acme" in b._remote._keyring.cached_tenants()
        b._remote._th.clear()  # as past 4,096 tenant names
        a.drop_tenant("acme")
        assert wait_until(lambda: _count(b, "deletions_applied") >= 1)
        assert "acme" not in b._remote._keyring.cached_tenants()
    finally:
        a.close()
        b.close()


def test_drop_tenant_talks_to_redis_without_the_store_lock(tmp_path, redis_ns) -> None:
    """drop_tenant held the Store's lock over its remote part (a SCAN of the whole keyspace:
    seconds on a large shared Redis, every call of every tenant waiting). Now a get of another
    tenant goes on meanwhile, and a block the dropped tenant puts meanwhile is dropped by the
    local part and never reaches Redis."""
    s = _open(tmp_path, "a", redis_ns)
    try:
        keys = s.block_keys("acme", SPEC, tokens(2, SPEC))
        s.put("acme", SPEC, keys, make_kv(SPEC, 2))
        other = s.block_keys("globex", SPEC, tokens(1, SPEC, start=50))
        s.put("globex", SPEC, other, make_kv(SPEC, 1, seed=3))
        s.flush()
        late = s.block_keys("acme", SPEC, tokens(1, SPEC, start=900))
        seen: list[Any] = []
        purge = s._remote.purge_tenant

        def hooked(tenant: str) -> set[bytes]:
            seen.append(s._lock._is_owned())
            t = threading.Thread(target=lambda: seen.append(s.get("globex", SPEC, other).shape[0]),
                                 daemon=True)
            t.start()
            t.join(5)  # on the old code it waited for the lock this thread held
            s.put("acme", SPEC, late, make_kv(SPEC, 1, seed=4))  # the tenant puts meanwhile
            return purge(tenant)

        s._remote.purge_tenant = hooked  # type: ignore[method-assign]
        assert s.drop_tenant("acme") == 3
        s.flush()
        assert seen == [False, 1]
        assert s.lookup("acme", SPEC, late).num_blocks == 0
        ref = BlockRef("acme", late[0], SPEC)
        assert not s._remote._client.exists(s._remote.redis_key(ref)), "a block put meanwhile reached Redis"
    finally:
        s.close()
