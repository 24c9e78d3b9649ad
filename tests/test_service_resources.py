"""Per-call resources of the service: the staging pool reuses buffers within its cache bound."""

from __future__ import annotations

from kvstore.service_resources import StagingPool


def test_staging_buffers_are_reused_by_size():
    pool = StagingPool(cache_bytes=1 << 20)
    a = pool.take(4096)
    pool.give(a)
    assert pool.take(4096) is a
    assert pool.take(4096) is not a  # handed out once only


def test_staging_cache_stays_within_its_bound_and_makes_room_for_new_sizes():
    pool = StagingPool(cache_bytes=3 * 4096)
    small = [pool.take(4096) for _ in range(4)]
    for buf in small:
        pool.give(buf)
    assert pool.cached_bytes == 3 * 4096
    big = pool.take(2 * 4096)
    pool.give(big)
    assert pool.cached_bytes <= 3 * 4096
    assert pool.take(2 * 4096) is big
    pool.give(pool.take(1 << 20))  # larger than the whole cache: not kept
    assert pool.cached_bytes <= 3 * 4096
