"""Operator TTL policy: checked before it is saved, and an upper bound on a put's own TTL.

* ``policy set --ttl nan`` was refused by the Store after the principals file had saved it: the
  policy showed NaN, and the next ``kvstore serve`` failed on it.
* A put's ``ttl_s`` replaced the tenant's TTL policy, so any tenant could keep its blocks for
  ever; the policy is now the most a put gets.
"""

from __future__ import annotations

import math

import pytest
from conftest import make_kv, tokens
from service_harness import restart

from kvstore.errors import InvalidArgument


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0])
def test_a_bad_ttl_policy_is_refused_and_not_saved(sidecar, bad):
    admin = sidecar.admin()
    admin.create_tenant("bob")
    admin.set_policy("bob", ttl_s=30.0)
    with pytest.raises(InvalidArgument, match="finite number of seconds > 0"):
        admin.set_policy("bob", ttl_s=bad)
    assert admin.get_policy("bob")["ttl_s"] == 30.0
    sc = restart(sidecar)  # starts: nothing unusable was saved
    try:
        assert sc.admin().get_policy("bob")["ttl_s"] == 30.0
    finally:
        sc.stop()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -3, True])
def test_a_put_ttl_must_be_finite_and_positive(open_store, spec, bad):
    s = open_store(spec)
    with pytest.raises(InvalidArgument, match="ttl_s must be a finite number"):
        s.put("a", spec, s.block_keys("a", spec, tokens(1, spec)), make_kv(spec, 1), ttl_s=bad)


def test_the_tenant_ttl_policy_bounds_a_puts_own_ttl(open_store, spec, clock):
    s = open_store(spec)
    s.set_tenant_policy("a", ttl_s=2.0)
    long = s.block_keys("a", spec, tokens(1, spec))
    short = s.block_keys("a", spec, tokens(1, spec, start=40))
    s.put("a", spec, long, make_kv(spec, 1), ttl_s=100.0)  # asks for more than the policy allows
    s.put("a", spec, short, make_kv(spec, 1), ttl_s=1.0)  # less is kept
    clock.advance(1.5)
    assert s.lookup("a", spec, short).num_blocks == 0
    assert s.lookup("a", spec, long).num_blocks == 1
    clock.advance(1.0)
    assert s.lookup("a", spec, long).num_blocks == 0
    s.put("b", spec, s.block_keys("b", spec, tokens(1, spec)), make_kv(spec, 1), ttl_s=100.0)
    clock.advance(50)  # another tenant's policy does not apply
    assert s.lookup("b", spec, s.block_keys("b", spec, tokens(1, spec))).num_blocks == 1


@pytest.mark.parametrize("hbm_blocks", [0, 4])
def test_a_ttl_extended_by_a_later_put_survives_a_restart(open_store, spec, clock, tmp_path, hbm_blocks):
    """Putting stored blocks again with a longer TTL moves their deadline later. For a block
    with an NVMe copy, only the index learned of it: a restart read the old deadline from
    the NVMe record and dropped the blocks before the deadline they had been given."""
    path = tmp_path / "ext"
    s = open_store(spec, hbm_blocks=hbm_blocks, dram_blocks=0, nvme_blocks=16, path=path, durable=True)
    keys = s.block_keys("a", spec, tokens(3, spec))
    kv = make_kv(spec, 3)
    s.put("a", spec, keys, kv, ttl_s=10.0)
    s.put("a", spec, keys, kv, ttl_s=100.0)
    clock.advance(50)
    assert s.lookup("a", spec, keys).num_blocks == 3
    s.close()
    s = open_store(spec, hbm_blocks=hbm_blocks, dram_blocks=0, nvme_blocks=16, path=path, durable=True)
    assert s.lookup("a", spec, keys).num_blocks == 3  # was 0
    clock.advance(60)
    assert s.lookup("a", spec, keys).num_blocks == 0  # the new deadline holds


def test_a_put_past_the_tenants_quota_names_the_quota(open_store, spec):
    """It said "(capacity, and its quota where set): give the store more room" either way."""
    from kvstore.errors import ResourceExhausted

    s = open_store(spec, hbm_blocks=8, dram_blocks=0, nvme_blocks=0)
    s.set_tenant_policy("a", quota_bytes={"hbm": 2 * spec.block_nbytes})
    with pytest.raises(ResourceExhausted, match=r"its quota hbm=.*raise its quota") as err:
        s.put("a", spec, s.block_keys("a", spec, tokens(3, spec)), make_kv(spec, 3))
    assert err.value.resource == "quota:a:hbm"
    with pytest.raises(ResourceExhausted, match="give the store more room") as err:
        s.put("b", spec, s.block_keys("b", spec, tokens(9, spec)), make_kv(spec, 9))
    assert err.value.resource == "hbm"


def test_a_quota_lowered_below_what_a_tenant_holds_takes_effect_at_once(open_store, spec):
    """The tenant stayed over its new quota until its next put; its own blocks are now
    demoted (not lost: they go down a tier) when the quota is set, and no other tenant's."""
    n = spec.block_nbytes
    s = open_store(spec, hbm_blocks=8, dram_blocks=8, nvme_blocks=16)
    keys = {t: s.block_keys(t, spec, tokens(3, spec)) for t in ("a", "b")}
    for t, k in keys.items():
        s.put(t, spec, k, make_kv(spec, 3))
    assert s.stats()["tenants"]["a"]["hbm"] == 3 * n
    s.set_tenant_policy("a", quota_bytes={"hbm": n})
    usage = s.stats()["tenants"]
    assert usage["a"]["hbm"] <= n  # was 3 * n until a's next put
    assert usage["b"]["hbm"] == 3 * n
    assert s.lookup("a", spec, keys["a"]).num_blocks == 3  # demoted, still there
