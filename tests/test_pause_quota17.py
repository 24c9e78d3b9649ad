"""Pause when DRAM has no room for the session (round 17).

DESIGN.md §5: PAUSED demotes a session's blocks from HBM to DRAM and keeps them. What the
store did when DRAM could not take them all, found with the Store API:

* the tenant's DRAM quota binding (its other, unpinned blocks there): its own blocks made room
  (dropped with no NVMe, demoted with one), never another tenant's; what still did not fit
  stayed in HBM, unpinned and kept; right, but nothing said so (now ``pause_left_in_hbm``);
* DRAM full of other tenants' unpinned blocks: they made room (capacity, by policy); right;
* DRAM full of pinned (leased) blocks: the blocks stayed in HBM, unpinned and kept; right, not
  reported;
* DRAM, the last local tier, held by another PAUSED session (another tenant's, or the same
  tenant's within its quota): the pause dropped those kept blocks (``paused_evictions``) to
  park its own, which could as well have stayed in HBM unpinned: one session lost to move
  another one tier down. Failed before: a pause now never evicts a paused block out of the
  last local tier to park its own (with NVMe, those go down to NVMe, kept, as before).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import MASTER, FakeClock, make_kv, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block import SessionState, Tier
from kvstore.config import StoreConfig
from kvstore.errors import ResourceExhausted
from kvstore.spec import ModelSpec
from kvstore.store import Store

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
N = SPEC.block_nbytes


def _store(path: Path, hbm: int, dram: int, nvme: int) -> Store:
    return Store.open(StoreConfig(path=path, hbm_bytes=hbm * N, dram_bytes=dram * N, nvme_bytes=nvme * N,
                                  master_key=MASTER, device="cpu", policy="lru"), clock=FakeClock())


def _session(s: Store, tenant: str, sid: str, n: int, start: int) -> list[bytes]:
    s.open_session(tenant, sid)
    keys = s.block_keys(tenant, SPEC, tokens(n, SPEC, start))
    s.put(tenant, SPEC, keys, make_kv(SPEC, n, seed=start), session=sid)
    return keys


def _where(s: Store, tenant: str, keys: list[bytes]) -> list[tuple[str, int] | None]:
    """(tier, pins) of each block; None when it is gone."""
    out = []
    for k in keys:
        m = s._index.get(tenant, k)
        out.append(None if m is None else (m.tier.label, m.pins))
    return out


def _counter(s: Store, name: str) -> int:
    return s.stats()["counters"].get(name, 0)


@pytest.mark.parametrize("nvme", [0, 16])
@pytest.mark.parametrize("same_tenant", [False, True])
def test_pause_keeps_another_paused_session(tmp_path: Path, nvme: int, same_tenant: bool) -> None:
    """DRAM (2 blocks) holds session s1's paused blocks: of another tenant (capacity binds) or
    of the same one (its DRAM quota of 2 blocks binds). Pausing s2 dropped s1 (no NVMe)."""
    s = _store(tmp_path, 4, 8 if same_tenant else 2, nvme)
    try:
        first = "b" if same_tenant else "c"
        if same_tenant:
            s.set_tenant_policy("b", quota_bytes={"dram": 2 * N})
        k1 = _session(s, first, "s1", 2, 0)
        s.pause_session(first, "s1")
        assert _where(s, first, k1) == [("dram", 0)] * 2
        k2 = _session(s, "b", "s2", 2, 700)
        s.pause_session("b", "s2")
        # both sessions kept, none pinned
        assert None not in _where(s, first, k1), _where(s, first, k1)
        assert None not in _where(s, "b", k2)
        assert all(pins == 0 for _, pins in _where(s, "b", k2))
        assert _counter(s, "paused_evictions") == 0
        if nvme:  # s1 went down to NVMe to make room: s2 parked in DRAM
            assert _where(s, "b", k2) == [("dram", 0)] * 2
            assert _counter(s, "pause_left_in_hbm") == 0
        else:  # s2 stays in HBM, unpinned, and the store says so
            assert _where(s, first, k1) == [("dram", 0)] * 2
            assert _where(s, "b", k2) == [("hbm", 0)] * 2
            assert _counter(s, "pause_left_in_hbm") == 2
        s.resume_session(first, "s1")
        s.resume_session("b", "s2")
        assert s.lookup(first, SPEC, k1).tiers == ["hbm"] * 2
        assert s.lookup("b", SPEC, k2).tiers == ["hbm"] * 2
    finally:
        s.close()


@pytest.mark.parametrize("nvme", [0, 16])
def test_pause_with_dram_quota_binding_evicts_own_blocks_only(tmp_path: Path, nvme: int) -> None:
    """(a) The tenant holds its DRAM quota (2 blocks) in unpinned blocks; another tenant's are
    in DRAM too. The pause makes room from the tenant's own blocks (dropped with no NVMe),
    never the other tenant's; the block that still does not fit stays in HBM, unpinned."""
    s = _store(tmp_path, 3, 8, nvme)
    try:
        s.set_tenant_policy("b", quota_bytes={"dram": 2 * N})
        theirs = s.block_keys("c", SPEC, tokens(2, SPEC, 5_000))
        s.put("c", SPEC, theirs, make_kv(SPEC, 2))
        own = s.block_keys("b", SPEC, tokens(2, SPEC, 9_000))
        s.put("b", SPEC, own, make_kv(SPEC, 2))
        keys = _session(s, "b", "s1", 3, 0)  # HBM full of pinned blocks: the others went to DRAM
        assert _where(s, "c", theirs) == _where(s, "b", own) == [("dram", 0)] * 2
        assert s.pause_session("b", "s1") == 2
        assert _where(s, "b", keys) == [("hbm", 0), ("dram", 0), ("dram", 0)]
        assert _where(s, "c", theirs) == [("dram", 0)] * 2  # never another tenant's
        assert _where(s, "b", own) == ([None, None] if not nvme else [("nvme", 0)] * 2)
        assert s.stats()["tenants"]["b"]["dram"] <= 2 * N
        assert _counter(s, "pause_left_in_hbm") == 1
    finally:
        s.close()


@pytest.mark.parametrize("nvme", [0, 16])
def test_pause_with_dram_full_of_pinned_blocks(tmp_path: Path, nvme: int) -> None:
    """(c) DRAM (2 blocks) holds one block a read lease pins and one free slot: one block of
    the session parks there; the rest stays in HBM unpinned, kept, and counted."""
    s = _store(tmp_path, 3, 2, nvme)
    try:
        theirs = s.block_keys("c", SPEC, tokens(1, SPEC, 5_000))
        s.put("c", SPEC, theirs, make_kv(SPEC, 1))
        keys = _session(s, "b", "s1", 3, 0)  # HBM full of pinned blocks: c's went to DRAM
        with s.lease_prefix("c", SPEC, theirs, lambda i: np.empty(N, np.uint8)) as lease:
            assert len(lease.views) == 1
            assert _where(s, "c", theirs) == [("dram", 1)]
            assert s.pause_session("b", "s1") == 1
            assert _where(s, "b", keys) == [("hbm", 0), ("hbm", 0), ("dram", 0)]
            assert _where(s, "c", theirs) == [("dram", 1)]
        assert _counter(s, "pause_left_in_hbm") == 2
        assert s.lookup("b", SPEC, keys).num_blocks == 3
    finally:
        s.close()


# -- invariants under random traffic -------------------------------------------------------

_TENANTS = ["a", "b"]
_op = st.one_of(
    st.tuples(st.just("session"), st.sampled_from(_TENANTS), st.integers(1, 3)),
    st.tuples(st.just("put"), st.sampled_from(_TENANTS), st.integers(1, 3)),
    st.tuples(st.just("pause"), st.sampled_from(_TENANTS), st.integers(0, 5)),
    st.tuples(st.just("resume"), st.sampled_from(_TENANTS), st.integers(0, 5)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nvme=st.sampled_from([0, 6]), dram=st.integers(1, 4), quota=st.none() | st.integers(0, 3),
       ops=st.lists(_op, min_size=1, max_size=14))
def test_pause_invariants(tmp_path_factory: pytest.TempPathFactory, nvme: int, dram: int,
                          quota: int | None, ops: list[tuple[str, str, int]]) -> None:
    """After every pause: no block of the session is pinned (no lease or shared block here),
    every one is kept (a pause with no HBM quota drops none of its own nor any other paused
    block), usage stays within each tier's capacity and each tenant's quota."""
    s = _store(tmp_path_factory.mktemp("p"), 4, dram, nvme)
    sessions: dict[tuple[str, str], list[bytes]] = {}
    start = 0
    try:
        if quota is not None:
            s.set_tenant_policy("b", quota_bytes={"dram": quota * N})
        for verb, tenant, n in ops:
            start += 100
            live = [sid for (t, sid) in sessions if t == tenant]
            try:
                if verb == "session":
                    sid = f"s{start}"
                    sessions[(tenant, sid)] = _session(s, tenant, sid, n, start)
                elif verb == "put":
                    s.put(tenant, SPEC, s.block_keys(tenant, SPEC, tokens(n, SPEC, start)), make_kv(SPEC, n))
                elif verb == "resume" and live:
                    s.resume_session(tenant, live[n % len(live)])
            except ResourceExhausted:  # a full HBM refuses: allowed here
                continue
            if verb != "pause" or not live:
                continue
            sid = live[n % len(live)]
            paused = {(t, k) for (t, i), keys in sessions.items()
                      if s.session_state(t, i) == SessionState.PAUSED or (t, i) == (tenant, sid) for k in keys}
            kept = {p for p in paused if s._index.get(*p) is not None}
            s.pause_session(tenant, sid)
            for k in sessions[(tenant, sid)]:
                m = s._index.get(tenant, k)
                assert m is None or m.pins == 0, "a paused block is still pinned"
            assert all(s._index.get(*p) is not None for p in kept), "a pause dropped a kept block"
            stats = s.stats()
            for tier, t in stats["tiers"].items():
                assert t["used_bytes"] <= t["capacity_bytes"], (tier, t)
            if quota is not None:
                assert stats["tenants"].get("b", {}).get("dram", 0) <= quota * N
            in_hbm = sum(1 for k in sessions[(tenant, sid)]
                         if (m := s._index.get(tenant, k)) is not None and m.tier == Tier.HBM)
            assert in_hbm <= _counter(s, "pause_left_in_hbm")
    finally:
        s.close()
