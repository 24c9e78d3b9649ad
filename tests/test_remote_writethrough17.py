"""Write-through (``remote_write="through"``) and eviction, round 17: every put is queued to the
remote tier when it is published, and the last local tier's eviction of the block queued it
again (``Placement.evict`` offers the remote tier, ``spill_remote``): re-encoded and written
over the copy Redis already held (40 blocks put through an 8-block HBM: 74 writes, not 40).

Now a copy the tier knows to be there (``RemoteTier.holds``) is kept; a write-through that was
refused or failed, a copy deleted or expired since, or one written for an earlier deadline is
written at eviction as before, and a copy still queued is written once.

On a real Redis (``servers`` / ``private_redis`` of conftest.py); the writes are the tier's
``puts`` counter (one per ``SET`` of a block that landed).
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import torch
from conftest import MASTER, make_kv, tokens

from kernels.quant import QuantScheme
from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef
from tiers.remote_config import RemoteConfig

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
N = SPEC.block_nbytes


def _writes(s: Store) -> int:
    return s._remote.metrics().get("puts", 0)


def _prompt(s: Store, c: int, n: int = 4) -> list[bytes]:
    return s.block_keys("acme", SPEC, tokens(n, SPEC, start=1000 * c))


def _served(s: Store, keys: list[bytes], kv: torch.Tensor) -> bool:
    return torch.equal(s.get("acme", SPEC, keys), kv)


def test_eviction_keeps_the_written_through_copy(servers) -> None:
    """4 blocks written through, then evicted from the only local tier by 4 others: 8 writes
    (12 before), the evicted 4 counted ``remote_copy_kept``, not ``demotions_remote``, and
    still served from Redis."""
    a = servers("a", hbm=4)
    first, kv = _prompt(a, 0), make_kv(SPEC, 4)
    a.put("acme", SPEC, first, kv)
    a.flush()
    assert _writes(a) == 4
    a.put("acme", SPEC, _prompt(a, 1), make_kv(SPEC, 4, seed=1))  # evicts the first 4
    a.flush()
    c = a.stats()["counters"]
    assert c["evictions"] == 4
    assert _writes(a) == 8
    assert c["remote_copy_kept"] == 4 and c["demotions_remote"] == 8
    assert _served(a, first, kv)


def test_a_copy_still_queued_is_written_once(servers) -> None:
    """Evicted while its write-through is still queued (the writer is held in the first
    write): the eviction queues it again, and the writer skips that second write once the
    first landed."""
    a = servers("a", hbm=4)
    tier = a._remote
    inner, gate, entered = tier._put_with, threading.Event(), threading.Event()

    def held_put(*args, **kw):
        entered.set()
        assert gate.wait(30)
        return inner(*args, **kw)

    tier._put_with = held_put
    try:
        first, kv = _prompt(a, 0), make_kv(SPEC, 4)
        a.put("acme", SPEC, first, kv)
        assert entered.wait(30)
        a.put("acme", SPEC, _prompt(a, 1), make_kv(SPEC, 4, seed=1))  # evicts the first 4
        assert a.stats()["counters"]["evictions"] == 4
    finally:
        gate.set()
    a.flush()
    m = tier.metrics()
    assert m["puts"] == 8 and m["queue_skipped_held"] == 4
    assert _served(a, first, kv)


def test_a_refused_write_through_is_written_at_eviction(servers) -> None:
    """Refused by the tenant's remote quota when put (nothing queued): written when evicted,
    once the quota lets it."""
    a = servers("a", hbm=4)
    a.set_tenant_policy("acme", quota_bytes={"remote": 0})
    first, kv = _prompt(a, 0), make_kv(SPEC, 4)
    a.put("acme", SPEC, first, kv)
    a.flush()
    assert _writes(a) == 0 and a._remote.metrics()["quota_rejected"] == 4
    a.set_tenant_policy("acme", quota_bytes={"remote": 64 * N})
    a.put("acme", SPEC, _prompt(a, 1), make_kv(SPEC, 4, seed=1))  # evicts the first 4
    a.flush()
    assert _writes(a) == 8
    assert a.stats()["counters"].get("remote_copy_kept", 0) == 0
    assert _served(a, first, kv)


def test_a_failed_write_through_is_written_at_eviction(private_redis, tmp_path: Path) -> None:
    """Queued, but refused by a full Redis (OOM) when the writer wrote it: written when
    evicted, once Redis has room."""
    a = Store.open(StoreConfig(path=tmp_path / "a", hbm_bytes=4 * N, dram_bytes=0, nvme_bytes=0,
                               master_key=MASTER, remote_write="through",
                               remote=RemoteConfig(urls=[private_redis.url], namespace="wt17")))
    raw = private_redis.raw()
    try:
        a.put("acme", SPEC, _prompt(a, 9, 1), make_kv(SPEC, 1, seed=9))  # the tenant's key made
        a.flush()
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", "1")
        first, kv = _prompt(a, 0), make_kv(SPEC, 4)
        a.put("acme", SPEC, first, kv)
        a.flush()
        assert _writes(a) == 1 and a._remote.metrics()["queue_failed"] == 4
        raw.config_set("maxmemory", "0")
        a.put("acme", SPEC, _prompt(a, 1), make_kv(SPEC, 4, seed=1))  # evicts the first 4
        a.flush()
        assert _writes(a) == 1 + 4 + 4
        assert _served(a, first, kv)
    finally:
        raw.config_set("maxmemory", "0")
        raw.close()
        a.close()


def test_a_copy_gone_since_is_written_again(servers) -> None:
    """A copy Redis lost without this server deleting it (found by a re-count), or deleted
    through the tier, is not a copy any more: the eviction writes the block again."""
    a = servers("a", hbm=4)
    first, kv = _prompt(a, 0), make_kv(SPEC, 4)
    a.put("acme", SPEC, first, kv)
    a.flush()
    refs = [BlockRef("acme", k, SPEC) for k in first]
    raw = a._remote._client
    raw.unlink(a._remote.redis_key(refs[0]))  # lost behind this server's back
    assert a._remote.resync() == 1
    a._remote.delete(refs[1])
    a.put("acme", SPEC, _prompt(a, 1), make_kv(SPEC, 4, seed=1))  # evicts the first 4
    a.flush()
    assert _writes(a) == 4 + 4 + 2
    assert a.stats()["counters"]["remote_copy_kept"] == 2
    assert _served(a, first, kv)


def test_holds_follows_deadlines_expiry_and_purges(servers) -> None:
    """``holds(ref, deadline)``: a copy written for that deadline or a later one (or none), not
    expired; a purge of its model or tenant forgets it; a quantized copy is a copy."""
    a = servers("a", hbm=4)
    tier, clock = a._remote, servers.clock
    keys = _prompt(a, 0, 3)
    kv = make_kv(SPEC, 3).contiguous().view(torch.uint8).reshape(3, -1)
    refs = [BlockRef("acme", k, SPEC) for k in keys]
    now = clock()
    assert not tier.holds(refs[0], None)
    assert tier.put(refs[0], kv[0], ttl_deadline=now + 100, parent=b"")
    assert tier.put(refs[1], kv[1], ttl_deadline=None, quant=QuantScheme.INT8, parent=keys[0])
    assert tier.holds(refs[0], now + 100) and tier.holds(refs[0], now + 50)
    assert not tier.holds(refs[0], now + 200) and not tier.holds(refs[0], None)
    assert tier.update_ttl(refs[0], now + 200, parent=b"")
    assert tier.holds(refs[0], now + 200)
    assert tier.holds(refs[1], None) and tier.holds(refs[1], now + 10)  # quantized: a copy
    other = BlockRef("acme", keys[1], dataclasses.replace(SPEC, revision="r2"))
    assert not tier.holds(other, None)  # another model's block of that key
    clock.advance(201)
    assert not tier.holds(refs[0], now + 200)  # expired
    assert tier.put(refs[2], kv[2], parent=keys[1])
    assert tier.holds(refs[2], None)
    tier.purge_model(SPEC.fingerprint)
    assert not tier.holds(refs[1], None) and not tier.holds(refs[2], None)
    assert tier.put(refs[2], kv[2], parent=keys[1])
    tier.purge_tenant("acme")
    assert not tier.holds(refs[2], None)
