"""Write-through and eviction, round 17: the copy a server kept at eviction on its own word.

8de389e kept, at eviction from the last local tier, a block whose write-through copy the server
accounted in Redis (``RemoteTier.holds``), writing nothing. ``holds`` knows only this server's
last write: server A put a prefix for an hour, server B put the same prefix for 1 s (its
``SET ... PX 1000`` replaced the value and its expiry), A evicted the blocks and 1.5 s later
found 0 of the 4 it was told to keep for an hour, in any tier. Redis' eviction of the copy, or
another server's deadline move, did the same.

Now such a spill is queued and the writer checks the copy with one ``PTTL`` first: there,
expiring no sooner than this server wrote it, it is not encoded nor written (counted
``remote_copy_verified``); else it is written as any demotion (``remote_copy_not_verified``).

On a real Redis (``servers`` of conftest.py: one FakeClock, so a deadline is ``clock() + ttl``
while Redis counts its expiry in real milliseconds); the writes are the tier's ``puts`` counter
(one per ``SET`` of a block that landed).
"""

from __future__ import annotations

import torch
from conftest import make_kv, tokens

from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
HOUR = 3600.0


def _writes(s: Store) -> int:
    return s._remote.metrics().get("puts", 0)


def _prompt(s: Store, c: int, n: int = 4) -> list[bytes]:
    return s.block_keys("acme", SPEC, tokens(n, SPEC, start=1000 * c))


def _pttl_s(s: Store, keys: list[bytes]) -> list[float]:
    """Redis' remaining expiry of each block's copy, in seconds (-1: none, -2: no copy)."""
    tier = s._remote
    out = []
    for k in keys:
        ms = tier._client.pttl(tier.redis_key(BlockRef("acme", k, SPEC)))
        out.append(ms / 1000 if ms >= 0 else float(ms))
    return out


def test_a_copy_another_server_shortened_is_written_again_at_eviction(servers) -> None:
    """A puts a prefix for an hour (written through), B the same prefix for 1 s: B's write
    replaced the copy and its expiry. A's eviction of the 4 blocks from its only local tier
    writes them again with A's deadline (it wrote nothing: the copies expired a second later,
    the blocks lost from every tier)."""
    a, b = servers("a", hbm=4), servers("b", hbm=16)
    first, kv = _prompt(a, 0), make_kv(SPEC, 4)
    a.put("acme", SPEC, first, kv, ttl_s=HOUR)
    a.flush()
    b.put("acme", SPEC, first, kv, ttl_s=1)
    b.flush()
    assert all(0 <= t <= 1 for t in _pttl_s(a, first))  # B's expiry now
    a.put("acme", SPEC, _prompt(a, 1), make_kv(SPEC, 4, seed=1), ttl_s=HOUR)  # evicts the first 4
    a.flush()
    assert a.stats()["counters"]["evictions"] == 4
    assert all(t > HOUR - 60 for t in _pttl_s(a, first)), "A's copies still expire with B's TTL"
    c = a.stats()["counters"]
    assert c["remote_copy_kept"] == 4 and c["remote_copy_not_verified"] == 4
    assert _writes(a) == 4 + 4 + 4
    assert torch.equal(a.get("acme", SPEC, first), kv)


def test_a_copy_redis_dropped_or_shortened_behind_the_server_is_written_again(servers) -> None:
    """Redis lost one copy (an eviction under ``maxmemory``, here ``UNLINK``) and another one's
    expiry was cut (another server's deadline move, here ``PEXPIRE``), without this server's
    knowledge (no re-count): the eviction writes those two again and keeps the other two."""
    a = servers("a", hbm=4)
    first, kv = _prompt(a, 0), make_kv(SPEC, 4)
    a.put("acme", SPEC, first, kv, ttl_s=HOUR)
    a.flush()
    tier = a._remote
    raw = tier._client
    raw.unlink(tier.redis_key(BlockRef("acme", first[0], SPEC)))
    raw.pexpire(tier.redis_key(BlockRef("acme", first[1], SPEC)), 2000)
    a.put("acme", SPEC, _prompt(a, 1), make_kv(SPEC, 4, seed=1), ttl_s=HOUR)  # evicts the first 4
    a.flush()
    assert all(t > HOUR - 60 for t in _pttl_s(a, first))
    assert _writes(a) == 4 + 4 + 2
    m = tier.metrics()
    assert m["copy_verified"] == 2 and m["copy_not_verified"] == 2
    assert m["queue_skipped_held"] == 2
    assert torch.equal(a.get("acme", SPEC, first), kv)


def test_one_server_writes_each_block_once(servers) -> None:
    """One server, nothing touched behind it: blocks with a TTL and without one (Redis expiry
    ``ttl_cap_s``) are written through once; their eviction checks each copy (one ``PTTL``)
    and neither encodes nor writes it again."""
    a = servers("a", hbm=4)
    tier = a._remote
    encodes = []
    inner = tier.codec.encode_into

    def counted(*args, **kw):
        encodes.append(args[1])
        return inner(*args, **kw)

    tier.codec.encode_into = counted
    timed, kv = _prompt(a, 0, 2), make_kv(SPEC, 2)
    a.put("acme", SPEC, timed, kv, ttl_s=HOUR)
    a.flush()  # NOTE: the next put may evict one of these already (HBM watermarks)
    untimed, kv2 = _prompt(a, 2, 2), make_kv(SPEC, 2, seed=2)
    a.put("acme", SPEC, untimed, kv2)
    a.flush()
    assert _writes(a) == 4 and len(encodes) == 4
    a.put("acme", SPEC, _prompt(a, 1), make_kv(SPEC, 4, seed=1))  # evicts the (rest of the) first 4
    a.flush()
    assert a.stats()["counters"]["evictions"] == 4
    assert _writes(a) == 8 and len(encodes) == 8 and len(set(encodes)) == 8  # each block once
    m = tier.metrics()
    assert m["copy_verified"] == 4 and m.get("copy_not_verified", 0) == 0
    c = a.stats()["counters"]
    assert c["remote_copy_kept"] == 4 and c["demotions_remote"] == 8
    assert torch.equal(a.get("acme", SPEC, timed), kv)
    assert torch.equal(a.get("acme", SPEC, untimed), kv2)
