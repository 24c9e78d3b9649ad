"""A tenant's TTL set (or lowered) applies to the blocks it holds already, in every tier.

* ``policy set T --ttl 2`` applied only to blocks put afterwards: blocks put before without a TTL
  were still there 30 days later, after re-puts and a restart (the README calls the tenant's TTL
  the operator's retention, which a tenant cannot outlast). Now every block of the tenant is
  capped at now + TTL at once: in the index, in its NVMe record (a restart keeps the cap) and
  its copies in Redis, whichever server wrote them; a block expiring sooner keeps its deadline;
  raising or removing the TTL extends nothing.
* A re-put kept the later of the old and new deadlines, None meaning never: a block without a
  deadline (one promoted from a remote copy written without a TTL) kept none when put again
  under the tenant's TTL. A re-put now leaves no deadline past now + TTL.
* A quota on a tier the server does not have (NVMe with nvme_bytes 0, the remote tier without
  ``[store.remote]``) was accepted and saved, binding nothing: ``absent_tiers="refuse"`` refuses
  it, and ``"skip"`` (a stored policy re-applied at a start) warns and goes on.
"""

from __future__ import annotations

import logging
import math
import struct
import tempfile
from pathlib import Path

import pytest
import redis
from conftest import MASTER, FakeClock, make_kv, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument
from kvstore.spec import ModelSpec
from kvstore.store import Store

DAY = 86400.0


def _present(s: Store, tenant: str, spec: ModelSpec, keys: list[bytes]) -> int:
    return s.lookup(tenant, spec, keys).num_blocks


@pytest.mark.parametrize("hbm_blocks", [0, 2, 8])
def test_a_ttl_set_after_the_blocks_were_put_expires_them(open_store, spec, clock, tmp_path, hbm_blocks):
    """The prober's case: 3 blocks put without a TTL, then ``policy set --ttl 2``; re-put, restart,
    30 days later: all were still there. Blocks in HBM, DRAM and NVMe alike."""
    path = tmp_path / "s"
    s = open_store(spec, hbm_blocks=hbm_blocks, dram_blocks=1, nvme_blocks=16, path=path, durable=True)
    keys = s.block_keys("a", spec, tokens(6, spec))
    kv = make_kv(spec, 6)
    s.put("a", spec, keys, kv)  # no TTL: kept for ever
    other = s.block_keys("b", spec, tokens(2, spec))
    s.put("b", spec, other, make_kv(spec, 2))
    s.set_tenant_policy("a", ttl_s=2.0)
    s.put("a", spec, keys, kv)  # a re-put under the policy: now + 2 at most
    s.close()
    s = open_store(spec, hbm_blocks=hbm_blocks, dram_blocks=1, nvme_blocks=16, path=path, durable=True)
    s.set_tenant_policy("a", ttl_s=2.0)  # as the server's start re-applies it
    clock.advance(1.0)
    assert _present(s, "a", spec, keys) == 6  # not before its time
    clock.advance(1.0)
    assert _present(s, "a", spec, keys) == 0  # was 6, 30 days later too
    clock.advance(30 * DAY)
    assert _present(s, "b", spec, other) == 2  # another tenant's blocks keep theirs


def test_the_cap_survives_a_restart_that_sets_no_policy(open_store, spec, clock, tmp_path):
    """The capped deadline is in the NVMe record: a Store opened without the policy reads it."""
    path = tmp_path / "s"
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16, path=path, durable=True)
    keys = s.block_keys("a", spec, tokens(3, spec))
    s.put("a", spec, keys, make_kv(spec, 3))
    s.set_tenant_policy("a", ttl_s=5.0)
    s.close()
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16, path=path, durable=True)
    clock.advance(5.0)
    assert _present(s, "a", spec, keys) == 0
    assert s.expire() == 0  # the lookup dropped them already


def test_a_block_expiring_sooner_keeps_its_deadline_and_raising_extends_nothing(open_store, spec, clock):
    s = open_store(spec)
    soon = s.block_keys("a", spec, tokens(1, spec))
    late = s.block_keys("a", spec, tokens(1, spec, start=100))
    s.put("a", spec, soon, make_kv(spec, 1), ttl_s=1.0)
    s.put("a", spec, late, make_kv(spec, 1), ttl_s=100.0)
    s.set_tenant_policy("a", ttl_s=10.0)
    s.set_tenant_policy("a", ttl_s=50.0)  # raised: the cap of 10 stays
    s.set_tenant_policy("a")  # removed: still no extension
    clock.advance(1.0)
    assert _present(s, "a", spec, soon) == 0
    assert _present(s, "a", spec, late) == 1
    clock.advance(9.0)
    assert _present(s, "a", spec, late) == 0  # at 10, not 100


def test_a_lowered_ttl_drops_a_chain_at_once_when_its_time_has_come(open_store, spec, clock):
    """Capped at now + TTL: blocks put long ago under no TTL go TTL seconds after the policy,
    not at once, and the sweep (``expire``) finds them without a lookup."""
    s = open_store(spec, hbm_blocks=2, dram_blocks=2, nvme_blocks=16)
    keys = s.block_keys("a", spec, tokens(5, spec))
    s.put("a", spec, keys, make_kv(spec, 5))
    clock.advance(10 * DAY)
    s.set_tenant_policy("a", ttl_s=60.0)
    clock.advance(59.0)
    assert s.expire() == 0
    clock.advance(1.0)
    assert s.expire() == 5


# -- the remote tier -------------------------------------------------------------------------------
def _deadlines(url: str, ns: str, th_prefix: str = "") -> dict[bytes, tuple[float | None, int]]:
    """(envelope deadline, PTTL ms) of every block copy in the namespace."""
    r = redis.Redis.from_url(url)
    try:
        out = {}
        for k in r.scan_iter(match=f"{ns}:*", count=1000):
            parts = k.split(b":")
            if len(parts) != 4 or b"keyring" in k or b"dropped" in k:
                continue
            head = r.getrange(k, 0, 15)
            if head[:4] != b"KVRE":
                continue
            (d,) = struct.unpack_from("<d", head, 8)
            out[k] = (None if math.isnan(d) else d, r.pttl(k))
        return out
    finally:
        r.close()


def test_remote_copies_of_any_server_are_capped(servers, spec):
    """Server A sets the tenant's TTL: every copy in Redis gets the cap, A's own write-through
    copies and those server B wrote (A never held them); a copy written for a sooner deadline
    keeps it; another tenant's copies are untouched. A third server then misses the tenant's
    copies once the cap has passed. (B's own local copies follow B's policy: a policy is set
    per server.)"""
    a, b = servers("a"), servers("b")
    clock = servers.clock
    mine = a.block_keys("t", spec, tokens(3, spec))
    a.put("t", spec, mine, make_kv(spec, 3))
    theirs = b.block_keys("t", spec, tokens(2, spec, start=500))
    b.put("t", spec, theirs, make_kv(spec, 2))
    short = b.block_keys("t", spec, tokens(1, spec, start=900))
    b.put("t", spec, short, make_kv(spec, 1), ttl_s=3.0)
    other = b.block_keys("u", spec, tokens(2, spec))
    b.put("u", spec, other, make_kv(spec, 2))
    a.flush()
    b.flush()
    before = _deadlines(servers.url, servers.ns)
    assert len(before) == 8 and sum(d is None for d, _ in before.values()) == 7
    a.set_tenant_policy("t", ttl_s=10.0)
    a.flush()  # the writer capped them
    now = clock()
    after = _deadlines(servers.url, servers.ns)
    u_keys = {k for k, (d, _) in before.items() if d is None} - {k for k, (d, _) in after.items() if d is not None}
    assert len(u_keys) == 2  # tenant u's two copies: no deadline still
    capped = [v for k, v in after.items() if k not in u_keys]
    assert sorted(d for d, _ in capped) == [now + 3.0] + [now + 10.0] * 5
    assert all(0 < pttl <= 10_000 for _, pttl in capped)
    assert a._remote.metrics()["ttl_capped"] == 5
    c = servers("c")
    clock.advance(9.0)
    assert c.lookup("t", spec, theirs).num_blocks == 2  # not before its time
    clock.advance(1.0)
    assert c.lookup("t", spec, theirs).num_blocks == 0
    assert c.lookup("t", spec, mine).num_blocks == 0
    assert c.lookup("u", spec, other).num_blocks == 2


def test_a_reput_caps_a_block_promoted_without_a_deadline(servers, spec):
    """B wrote a copy without a TTL after A's policy was set (A's cap never saw it); A promotes
    it (no deadline: the copy says none) and puts it again: it kept no deadline (the later of
    none and now + TTL was none); now now + TTL."""
    a, b = servers("a"), servers("b")
    clock = servers.clock
    a.set_tenant_policy("t", ttl_s=10.0)
    a.flush()
    keys = b.block_keys("t", spec, tokens(2, spec))
    kv = make_kv(spec, 2)
    b.put("t", spec, keys, kv)
    b.flush()
    assert a.get("t", spec, keys).shape[0] == 2  # promoted into A's HBM
    a.put("t", spec, keys, kv)
    a.flush()  # the move of the remote copy's deadline (one Redis key for both servers) landed
    clock.advance(9.0)
    assert a.lookup("t", spec, keys).num_blocks == 2
    clock.advance(1.0)
    assert a.lookup("t", spec, keys).num_blocks == 0  # here, and no remote copy either


# -- quotas on a tier this server does not have ---------------------------------------------------
def test_a_quota_on_an_absent_tier_is_refused_or_skipped(open_store, spec, caplog):
    s = open_store(spec, nvme_blocks=0)
    for tier in ("nvme", "remote"):
        with pytest.raises(InvalidArgument, match=f"this server has no {tier} tier"):
            s.set_tenant_policy("a", quota_bytes={tier: 1 << 20}, absent_tiers="refuse")
    s.set_tenant_policy("a", quota_bytes={"hbm": 1 << 20}, absent_tiers="refuse")  # a tier it has
    with caplog.at_level(logging.WARNING, logger="kvstore.store_admin"):
        s.set_tenant_policy("a", quota_bytes={"nvme": 1 << 20})  # a stored policy, re-applied
    assert "quota on nvme" in caplog.text


# -- the property ---------------------------------------------------------------------------------
_SPEC = ModelSpec(model="m", revision="r1", num_layers=1, num_kv_heads=1, head_dim=8,
                  dtype="float16", block_tokens=4)
_TTLS = st.one_of(st.none(), st.sampled_from([1.0, 5.0, 20.0, 100.0]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(st.tuples(st.sampled_from("ab"), _TTLS, st.sampled_from([0.0, 3.0])), min_size=1, max_size=10),
       ttl=st.sampled_from([2.0, 10.0, 50.0]), restart=st.booleans())
def test_property_no_block_of_the_tenant_outlives_now_plus_ttl(blocks, ttl, restart):
    """After ``set_tenant_policy("a", ttl)`` at t, no block of ``a`` (in any local tier, and
    after a restart) is there at t + ttl; each is there until min(its own deadline, t + ttl);
    ``b``'s blocks keep their own deadlines."""
    with tempfile.TemporaryDirectory() as d:
        clock = FakeClock()
        n = _SPEC.block_nbytes
        cfg = StoreConfig(path=Path(d) / "s", hbm_bytes=2 * n, dram_bytes=2 * n, nvme_bytes=32 * n,
                          master_key=MASTER, durable=True)
        s = Store.open(cfg, clock=clock)
        try:
            stored = []  # (tenant, keys, deadline or None)
            for i, (tenant, own, wait) in enumerate(blocks):
                clock.advance(wait)
                keys = s.block_keys(tenant, _SPEC, tokens(1, _SPEC, start=10 * i))
                s.put(tenant, _SPEC, keys, make_kv(_SPEC, 1, seed=i), ttl_s=own)
                stored.append((tenant, keys, None if own is None else clock() + own))
            t = clock()
            s.set_tenant_policy("a", ttl_s=ttl)
            if restart:
                s.close()
                s = Store.open(cfg, clock=clock)

            def bound(tenant: str, deadline: float | None) -> float:
                if tenant == "a":
                    return min(math.inf if deadline is None else deadline, t + ttl)
                return math.inf if deadline is None else deadline

            # NOTE: every time is a whole second: each check lies after the last one
            for at in sorted({t + ttl, *(b for tn, _, dl in stored if t < (b := bound(tn, dl)) < math.inf)}):
                clock.t = at - 0.5
                for tenant, keys, deadline in stored:
                    assert _present(s, tenant, _SPEC, keys) == (bound(tenant, deadline) > clock())
                clock.t = at
                for tenant, keys, deadline in stored:
                    assert _present(s, tenant, _SPEC, keys) == (bound(tenant, deadline) > clock())
        finally:
            s.close()
