"""Remote (Redis) I/O of the read path runs without the Store's lock.

A get or lookup stuck on a hung Redis held the Store's one lock for the remote timeouts and
retries: a local HBM get of another tenant waited behind it (3.96 s with the defaults). Now the
local part is done under the lock, the remote fetch outside it, and the promotion of what came
back under it again, after checking what the first part saw: the store may have been closed,
the local parent evicted or deleted, the tenant dropped, a key put meanwhile.

Also here: ``lookup(parent=)`` counted a remote continuation whose parent is held neither here
nor remotely (``get`` serves none of it).

Tests that pause Redis (SIGSTOP) start their own ``redis-server`` on a loopback port; the rest
use the ``redis_ns`` fixture (own namespace). Nothing sleeps; the one wait with a timeout is a
join of 5 s against a remote op timeout of 30 s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MASTER, FakeClock, make_kv, tokens
from remote_harness import PrivateRedis

from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef
from tiers.remote_config import RemoteConfig

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
N = SPEC.block_nbytes


def _during_fetch(s: Store, action: Callable[[], None]) -> list[bool]:
    """Run ``action`` right after the remote tier served a get's fetch (before the get goes
    on); returns a list that records, per fetch, whether the Store's lock was held then."""
    real = s._remote.get_prefix_into
    held: list[bool] = []

    def hooked(refs: Any, outs: Any, **kw: Any) -> int:
        n = real(refs, outs, **kw)
        held.append(s._lock._is_owned())
        action()
        return n

    s._remote.get_prefix_into = hooked  # type: ignore[method-assign]
    return held


def _lease(s: Store, tenant: str, keys: list[bytes], **kw: Any) -> Any:
    return s.lease_prefix(tenant, SPEC, keys, lambda i: np.empty(N, np.uint8), **kw)


# -- 1. a hung Redis does not stall local reads ----------------------------------------------------
@pytest.mark.parametrize("call", ["get", "get_into", "get_parent", "lookup", "lookup_parent", "lease"])
def test_a_local_get_is_not_blocked_while_redis_hangs(tmp_path: Path, private_redis: PrivateRedis,
                                                      call: str) -> None:
    """Tenant b's read waits on a paused Redis (remote op timeout 30 s); tenant a's HBM get
    from another thread completes meanwhile. It waited out b's remote timeouts before."""
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=16 * N, dram_bytes=0, nvme_bytes=0,
                      master_key=MASTER,
                      remote=RemoteConfig(urls=[private_redis.url], op_timeout_s=30.0, retries=0))
    s = Store.open(cfg, clock=FakeClock())
    try:
        keys_a = s.block_keys("a", SPEC, tokens(3, SPEC))
        kv_a = make_kv(SPEC, 3, seed=1)
        s.put("a", SPEC, keys_a, kv_a)
        keys_b = s.block_keys("b", SPEC, tokens(3, SPEC))  # held nowhere: the read goes remote
        entered = threading.Event()
        real = s._remote._batch

        def batch(*args: Any) -> Any:  # every pipelined GET / EXISTS of the remote tier
            entered.set()
            return real(*args)

        s._remote._batch = batch  # type: ignore[method-assign]
        reads: dict[str, Callable[[], object]] = {
            "get": lambda: s.get("b", SPEC, keys_b),
            "get_into": lambda: s.get_into("b", SPEC, keys_b,
                                           [np.empty(N, np.uint8) for _ in keys_b]),
            "get_parent": lambda: s.get("b", SPEC, keys_b[1:], parent=keys_b[0]),
            "lookup": lambda: s.lookup("b", SPEC, keys_b),
            "lookup_parent": lambda: s.lookup("b", SPEC, keys_b[1:], parent=keys_b[0]),
            "lease": lambda: _lease(s, "b", keys_b).release(),  # the service's in-band Get
        }
        remote = threading.Thread(target=reads[call], daemon=True)
        got: list[torch.Tensor] = []
        local = threading.Thread(target=lambda: got.append(s.get("a", SPEC, keys_a)), daemon=True)
        private_redis.pause()
        try:
            remote.start()
            assert entered.wait(10), "the remote read never reached Redis"
            local.start()
            local.join(5)  # the remote op timeout is 30 s
            assert not local.is_alive(), "a local get waited on another tenant's remote read"
        finally:
            private_redis.resume()
            local.join(60)
            remote.join(60)
        assert not remote.is_alive()
        assert len(got) == 1 and torch.equal(got[0], kv_a)
    finally:
        s.close()


# -- 2. what the promotion checks again --------------------------------------------------------------
def _two_servers(servers: Callable[..., Store], n: int = 4
                 ) -> tuple[Store, list[bytes], torch.Tensor]:
    """A wrote ``n`` blocks through to Redis; B holds the first two (promoted by a get)."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(n, SPEC))
    kv = make_kv(SPEC, n)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    assert torch.equal(b.get("acme", SPEC, keys[:2]), kv[:2])
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm", "hbm", "remote", "remote"]
    return b, keys, kv


def test_the_remote_fetch_runs_without_the_lock_and_promotes_after(servers) -> None:
    b, keys, kv = _two_servers(servers)
    held = _during_fetch(b, lambda: None)
    assert torch.equal(b.get("acme", SPEC, keys), kv)
    assert held == [False]  # was True: the lock was held during the fetch
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm"] * 4  # promoted as before
    assert b.counters.get("promotions_remote") == 4 and b.counters.get("hits_remote") == 4
    assert not b._place.protected  # nothing left protected


def test_a_read_lease_fetches_without_the_lock_and_promotes_after(servers) -> None:
    b, keys, kv = _two_servers(servers)
    held = _during_fetch(b, lambda: None)
    with _lease(b, "acme", keys) as lease:
        assert held == [False]  # was True: the service's Get fetched under the Store's lock
        flat = kv.view(torch.uint8).reshape(len(keys), -1).numpy()
        assert len(lease.views) == 4
        assert all(np.array_equal(v, flat[i]) for i, v in enumerate(lease.views))
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm"] * 4
    assert not b._place.protected


def test_a_read_lease_racing_a_delete_promotes_nothing(servers) -> None:
    b, keys, kv = _two_servers(servers)
    _during_fetch(b, lambda: b.delete("acme", [keys[1]]))
    with _lease(b, "acme", keys) as lease:
        flat = kv.view(torch.uint8).reshape(len(keys), -1).numpy()
        assert all(np.array_equal(v, flat[i]) for i, v in enumerate(lease.views))
    assert [b._index.get("acme", k) for k in keys[1:]] == [None, None, None]
    assert not b._place.protected


def test_a_parent_deleted_during_the_fetch_gets_no_promoted_children(servers) -> None:
    """The get may return the blocks (it raced the delete), but never puts them back under a
    parent that is gone: they were inserted as orphans, usable by nothing, never evicted."""
    b, keys, kv = _two_servers(servers)
    _during_fetch(b, lambda: b.delete("acme", [keys[1]]))
    got = b.get("acme", SPEC, keys)
    assert torch.equal(got, kv[:got.shape[0]])  # either result, never other bytes
    assert [b._index.get("acme", k) for k in keys[1:]] == [None, None, None]
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm"]  # keys[0]; keys[1]'s copy is gone
    assert b.get("acme", SPEC, keys).shape[0] == 1


def test_a_parent_evicted_during_the_fetch_gets_no_promoted_children(servers) -> None:
    b, keys, kv = _two_servers(servers)

    def evict() -> None:
        with b._lock:
            b._place.drop(b._index.get("acme", keys[1]), reason="evictions")

    _during_fetch(b, evict)
    assert torch.equal(b.get("acme", SPEC, keys), kv)  # served from Redis
    assert [b._index.get("acme", k) for k in keys[1:]] == [None, None, None]
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm", "remote", "remote", "remote"]


def test_blocks_deleted_during_the_fetch_are_not_brought_back(servers) -> None:
    """A root block deleted (remote copy and all) while a get fetched it: the promotion put it
    back into this server's HBM after the delete had returned."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(3, SPEC))
    kv = make_kv(SPEC, 3)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    _during_fetch(b, lambda: b.delete("acme", [keys[0]]))
    got = b.get("acme", SPEC, keys)
    assert torch.equal(got, kv[:got.shape[0]])
    assert b.lookup("acme", SPEC, keys).num_blocks == 0  # was 3, in hbm
    assert b.get("acme", SPEC, keys).shape[0] == 0


def test_a_tenant_dropped_during_the_fetch_is_not_promoted(servers) -> None:
    _, keys, kv = _two_servers(servers)
    b2 = servers("b2")
    _during_fetch(b2, lambda: b2.drop_tenant("acme"))
    got = b2.get("acme", SPEC, keys)
    assert torch.equal(got, kv[:got.shape[0]])
    assert not list(b2._index.of_tenant("acme"))  # was 4 blocks, after the drop
    assert b2.lookup("acme", SPEC, keys).num_blocks == 0


def test_a_model_purged_during_the_fetch_is_not_promoted(servers) -> None:
    b, keys, kv = _two_servers(servers)
    _during_fetch(b, lambda: b.purge_model(SPEC.fingerprint))
    got = b.get("acme", SPEC, keys)
    assert torch.equal(got, kv[:got.shape[0]])
    assert not list(b._index.of_tenant("acme"))
    assert b.lookup("acme", SPEC, keys).num_blocks == 0


def test_a_store_closed_during_the_fetch_returns_what_was_served(servers) -> None:
    b, keys, kv = _two_servers(servers)
    _during_fetch(b, b.close)
    assert torch.equal(b.get("acme", SPEC, keys), kv)  # no error, nothing promoted
    assert b.counters.get("promotions_remote") == 2  # those of _two_servers only


def test_a_store_closed_before_the_fetch_serves_its_local_prefix(servers) -> None:
    """The remote tier (client, codec) closed under a fetch: a miss (or the blocks), no error."""
    b, keys, kv = _two_servers(servers)
    real = b._remote.get_prefix_into

    def closed_first(refs: Any, outs: Any, **kw: Any) -> int:
        b.close()
        return real(refs, outs, **kw)

    b._remote.get_prefix_into = closed_first  # type: ignore[method-assign]
    got = b.get("acme", SPEC, keys)
    assert got.shape[0] >= 2 and torch.equal(got, kv[:got.shape[0]])


def test_a_block_put_during_the_fetch_stops_the_promotion(servers) -> None:
    b, keys, kv = _two_servers(servers)
    put = b.put  # B's own copy of keys[2] (under keys[1]) lands while the get fetches it
    _during_fetch(b, lambda: put("acme", SPEC, keys[2:3], kv[2:3], parent=keys[1]))
    assert torch.equal(b.get("acme", SPEC, keys), kv)
    m2 = b._index.get("acme", keys[2])
    assert m2 is not None and m2.parent == keys[1]
    assert b._index.get("acme", keys[3]) is None  # promotion stops at the put block
    assert b.lookup("acme", SPEC, keys).tiers == ["hbm", "hbm", "hbm", "remote"]


def test_a_parent_held_only_remotely_is_promoted_under_nothing(servers) -> None:
    """A chain continued from a parent this server does not hold: served (the parent is in
    Redis), not promoted (there is no parent here to hang it under)."""
    a = servers("a")
    keys = a.block_keys("acme", SPEC, tokens(3, SPEC))
    kv = make_kv(SPEC, 3)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    d = servers("d")
    assert torch.equal(d.get("acme", SPEC, keys[1:], parent=keys[0]), kv[1:])
    assert not list(d._index.of_tenant("acme"))


# -- 3. lookup(parent=) agrees with get ------------------------------------------------------------
def test_lookup_counts_no_remote_continuation_of_a_parent_held_nowhere(servers) -> None:
    """The parent is neither held here nor in Redis: get serves nothing of its continuation
    (a deleted parent takes its descendants with it); lookup announced the whole of it. A
    server that holds the parent still continues into Redis, in both."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(4, SPEC))
    kv = make_kv(SPEC, 4)
    a.put("acme", SPEC, keys, kv)
    a.flush()
    assert torch.equal(b.get("acme", SPEC, keys[:2]), kv[:2])  # B holds the parent
    d = servers("d")  # D holds nothing
    assert d.lookup("acme", SPEC, keys[2:], parent=keys[1]).tiers == ["remote", "remote"]
    assert a._remote.delete(BlockRef("acme", keys[1], SPEC))  # the parent's remote copy goes
    assert d.get("acme", SPEC, keys[2:], parent=keys[1]).shape[0] == 0
    assert d.lookup("acme", SPEC, keys[2:], parent=keys[1]).num_blocks == 0  # was 2
    assert b.lookup("acme", SPEC, keys[2:], parent=keys[1]).tiers == ["remote", "remote"]
    assert torch.equal(b.get("acme", SPEC, keys[2:], parent=keys[1]), kv[2:])
