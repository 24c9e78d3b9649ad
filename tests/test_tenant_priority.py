"""Tenant priority (``set_tenant_policy(priority=)``, ``kvstore policy set --priority``): it was
saved and shown but used by nothing. When a tier makes room, a lower priority's evictable
blocks go before any of a higher one; the policy orders blocks of equal priority."""

from __future__ import annotations

import pytest
from conftest import make_kv, tokens

from kvstore.errors import InvalidArgument


@pytest.mark.parametrize("policy", ["lru", "gdsf", "cost"])
def test_a_higher_priority_tenants_blocks_stay_while_a_lower_ones_can_go(open_store, spec, clock, policy):
    s = open_store(spec, hbm_blocks=6, dram_blocks=0, nvme_blocks=0, policy=policy)
    s.set_tenant_policy("vip", priority=5)
    vip = s.block_keys("vip", spec, tokens(2, spec))
    s.put("vip", spec, vip, make_kv(spec, 2))  # the oldest: LRU alone would evict these first
    clock.advance(1)
    low = s.block_keys("low", spec, tokens(2, spec))
    s.put("low", spec, low, make_kv(spec, 2))
    clock.advance(1)
    s.put("low", spec, s.block_keys("low", spec, tokens(2, spec, start=50)), make_kv(spec, 2))
    assert s.stats()["evictions"] >= 1
    assert s.lookup("vip", spec, vip).num_blocks == 2
    assert s.lookup("low", spec, low).num_blocks < 2


def test_equal_priorities_leave_the_policys_order_and_dropping_the_tenant_forgets_it(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=6, dram_blocks=0, nvme_blocks=0, policy="lru")
    s.set_tenant_policy("a", priority=1)
    s.set_tenant_policy("b", priority=1)
    old = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, old, make_kv(spec, 2))
    clock.advance(1)
    s.put("b", spec, s.block_keys("b", spec, tokens(2, spec)), make_kv(spec, 2))
    clock.advance(1)
    s.put("b", spec, s.block_keys("b", spec, tokens(2, spec, start=50)), make_kv(spec, 2))
    assert s.lookup("a", spec, old).num_blocks < 2  # least recently used, same priority
    s.drop_tenant("a")
    assert "a" not in s._place.priorities
    with pytest.raises(InvalidArgument, match="priority must be an int"):
        s.set_tenant_policy("b", priority=1.5)


def test_priority_set_through_the_service_reaches_the_store(sidecar):
    admin = sidecar.admin()
    admin.create_tenant("prio")
    admin.set_policy("prio", priority=3)
    assert sidecar.server.store._place.priorities == {"prio": 3}
    admin.set_policy("prio", priority=0)
    assert sidecar.server.store._place.priorities == {}
