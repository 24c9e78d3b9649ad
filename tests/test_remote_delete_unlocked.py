"""Store.delete runs its remote part (one pipelined round trip per level of the remote
subtree) without the Store's lock, and keeps the remote writer's filter until its local part
is done.

Before, the whole delete held the Store's one lock: deleting a 2,048-block chain written
through to Redis took 310 ms, and every other call of every tenant (a local HBM get of
another tenant too) waited as long (a script timed it). Without the lock, what the lock used
to exclude may happen in the window: a put under a block being deleted, a demotion of one.
Neither may leave a copy behind the deletion. Two deletions of one tenant may now also run at
once: the first to end must not lift the writer's filter of the other. A block put two
levels under a deleted one in the window and demoted before the local part (its parent never
demoted, so the writer's filter, which knows a block by its parent, could not tell) reached
Redis behind the deletion, and was served again once the prefix was put again (found in review).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MASTER, make_kv, tokens

from kvstore.block import Tier
from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef
from tiers.remote_config import RemoteConfig
from tiers.remote_writer import Job

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)


def _during_remote_delete(s: Store, action: Callable[[], None], after: bool = False) -> list[bool]:
    """Run ``action`` at the start (or, ``after``, at the end) of the remote part of the
    Store's next delete; returns a list that records whether the deleting thread held the
    Store's lock then."""
    real = s._remote.delete_subtrees
    held: list[bool] = []

    def hooked(tenant: str, roots: Any, doom: Any = None) -> set[bytes]:
        held.append(s._lock._is_owned())
        if not after and len(held) == 1:
            action()
        gone = real(tenant, roots, *([] if doom is None else [doom]))
        if after and len(held) == 1:
            action()
        return gone

    s._remote.delete_subtrees = hooked  # type: ignore[method-assign]
    return held


def test_other_calls_go_on_while_a_delete_talks_to_redis(servers) -> None:
    s = servers("a")
    keys_a = s.block_keys("acme", SPEC, tokens(8, SPEC))
    s.put("acme", SPEC, keys_a, make_kv(SPEC, 8))
    keys_b = s.block_keys("globex", SPEC, tokens(2, SPEC, start=500))
    kv_b = make_kv(SPEC, 2, seed=2)
    s.put("globex", SPEC, keys_b, kv_b)
    s.flush()
    got: list[torch.Tensor] = []

    def other_tenant_reads() -> None:
        t = threading.Thread(target=lambda: got.append(s.get("globex", SPEC, keys_b)), daemon=True)
        t.start()
        t.join(5)  # on the old code it waited for the lock this thread held

    held = _during_remote_delete(s, other_tenant_reads)
    assert s.delete("acme", [keys_a[0]]) == 8
    assert held == [False]
    assert len(got) == 1 and torch.equal(got[0], kv_b)
    assert s.lookup("acme", SPEC, keys_a).num_blocks == 0


@pytest.mark.parametrize("after", [False, True], ids=["during", "after-remote-part"])
def test_a_block_put_under_a_deleted_one_meanwhile_is_deleted_everywhere(servers, after) -> None:
    """After the remote part, before the local one: its write (queued) landed in Redis behind
    the deletion on the old code, an orphan whose parent was gone."""
    a, b = servers("a"), servers("b")
    keys = a.block_keys("acme", SPEC, tokens(4, SPEC))
    a.put("acme", SPEC, keys[:3], make_kv(SPEC, 3))
    a.flush()
    # in the window: the fourth block is put under the third (written through: queued to Redis)
    _during_remote_delete(a, lambda: a.put("acme", SPEC, keys[3:], make_kv(SPEC, 1, seed=9),
                                            parent=keys[2]), after)
    assert a.delete("acme", [keys[0]]) == 4
    a.flush()
    assert a.lookup("acme", SPEC, keys).num_blocks == 0
    raw = a._remote._client
    ref = BlockRef("acme", keys[3], SPEC)
    assert not raw.exists(a._remote.redis_key(ref)), "the block put meanwhile reached Redis"
    assert b.lookup("acme", SPEC, keys).num_blocks == 0


def _job(key: bytes, parent: bytes | None = None) -> Job:
    ref = BlockRef("acme", key, SPEC)
    return Job(ref, np.zeros(SPEC.block_nbytes, np.uint8), None, 0, None, None, parent)


def test_two_deletions_of_one_tenant_keep_their_own_filters(servers) -> None:
    t = servers("a")._remote
    one, two = b"1" * 32, b"2" * 32
    with t.deleting("acme", [one]):
        with t.deleting("acme", [two]), t._cond:
            assert t._is_doomed(_job(one)) and t._is_doomed(_job(two))
        with t._cond:  # the second ended: the first still filters its blocks and their children
            assert t._is_doomed(_job(one)) and t._is_doomed(_job(b"c" * 32, parent=one))
            assert not t._is_doomed(_job(two))
    with t._cond:
        assert not t._is_doomed(_job(one))


@pytest.mark.parametrize("evict", ["direct", "pressure"])
def test_a_grandchild_demoted_in_the_window_does_not_reach_redis(servers, evict) -> None:
    a = servers("a", hbm=8, remote_write="demote")
    b = servers("b", remote_write="demote")
    keys = a.block_keys("acme", SPEC, tokens(5, SPEC))
    a.put("acme", SPEC, keys[:3], make_kv(SPEC, 3))

    def window() -> None:  # two blocks put under the chain; the deeper one demoted to Redis
        a.put("acme", SPEC, keys[3:5], make_kv(SPEC, 2, seed=9), parent=keys[2])
        if evict == "direct":
            with a._lock:
                assert a._place.evict(a._index.get("acme", keys[4]), Tier.HBM, a._clock())
        else:
            for i in range(12):  # another tenant fills HBM: the LRU leaf goes
                k = a.block_keys("other", SPEC, tokens(1, SPEC, start=1000 + 10 * i))
                a.put("other", SPEC, k, make_kv(SPEC, 1, seed=i))
                a.get("acme", SPEC, keys[:4])  # the chain stays hot: its leaf is the LRU
        a._remote.flush(5)  # the writer had its turn before the local part

    _during_remote_delete(a, window, after=True)
    a.delete("acme", [keys[0]])
    a.flush()
    assert a.lookup("acme", SPEC, keys).num_blocks == 0
    leaf = a._remote.redis_key(BlockRef("acme", keys[4], SPEC))
    assert not a._remote._client.exists(leaf), "a block under a deleted one reached Redis"
    assert a.stats()["counters"]["remote_skipped_deleted"] >= 1
    b.put("acme", SPEC, keys[:4], make_kv(SPEC, 4, seed=1))  # the prefix again: no fifth block
    assert b.lookup("acme", SPEC, keys).num_blocks == 4


def test_close_waits_for_a_delete_in_its_remote_part(redis_ns, tmp_path) -> None:
    """close() ran in the middle of a delete's remote part: the delete went on talking to
    Redis after close returned, then raised 'store is closed' with its local part undone (the
    blocks came back from NVMe at the next open while their remote copies were gone)."""
    url, ns = redis_ns
    n = SPEC.block_nbytes
    s = Store.open(StoreConfig(path=tmp_path / "a", hbm_bytes=16 * n, dram_bytes=0, nvme_bytes=64 * n,
                               master_key=MASTER, persist_on_close=True, remote_write="through",
                               remote=RemoteConfig(urls=[url], namespace=ns)))
    keys = s.block_keys("acme", SPEC, tokens(3, SPEC))
    s.put("acme", SPEC, keys, make_kv(SPEC, 3))
    s.flush()
    closer = threading.Thread(target=s.close, daemon=True)

    def close_meanwhile() -> None:
        closer.start()
        closer.join(1)  # on the old code close ended here; now it waits for the delete
        assert closer.is_alive(), "close did not wait for the delete"

    _during_remote_delete(s, close_meanwhile)
    assert s.delete("acme", [keys[0]]) == 3
    closer.join(30)
    assert not closer.is_alive()
    again = Store.open(s.config)
    try:
        assert again.lookup("acme", SPEC, keys).num_blocks == 0
    finally:
        again.close()


def test_purge_model_cancels_this_servers_queued_demotions(servers) -> None:
    """purge_model cancelled nothing in its own server's write queue: blocks queued to Redis
    before the purge were written after it and served again (by every server: found by a
    prober, 279-300 of 300 write-through blocks back). Now the writer's filter for the model
    is held over the purge: queued ones are dropped, the one being written unlinked again."""
    a, b = servers("a", hbm=400), servers("b", hbm=400)
    keys = a.block_keys("acme", SPEC, tokens(40, SPEC))
    real = a._remote._put_with
    release = threading.Event()

    def stalled(*args: Any) -> Any:  # the first write waits: the rest stay queued
        release.wait(10)
        return real(*args)

    a._remote._put_with = stalled  # type: ignore[method-assign]
    a.put("acme", SPEC, keys, make_kv(SPEC, 40))  # write-through: 40 demotions queued
    threading.Timer(0.3, release.set).start()
    assert a.purge_model(SPEC.fingerprint) == 40
    a.flush()
    left = [k for k in keys if a._remote._client.exists(a._remote.redis_key(BlockRef("acme", k, SPEC)))]
    assert not left, f"{len(left)} purged blocks written to Redis after the purge"
    assert b.lookup("acme", SPEC, keys).num_blocks == 0
