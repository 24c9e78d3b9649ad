"""Session and prefetch defects a prober found (each test failed before its fix).

* A session put refused over gRPC (Put stream, PutLocal) made room first: ``reserve_put`` took
  no session, so other tenants' unpinned blocks were evicted, demoted or dropped before the
  commit found the session unknown (NOT_FOUND) or HBM held by other sessions' pins
  (RESOURCE_EXHAUSTED "... nothing was evicted").
* A refused resume (all or nothing, the session stays paused) promoted blocks into HBM first,
  evicting other tenants' blocks, then parked its own back; every retry churned again.
* The refused resume's message said how many blocks did not fit, which told a tenant how much
  of HBM other tenants pinned.
* A resume refused by the tenant's own HBM quota (HBM empty) was reported as HBM "full of pinned
  blocks" (resource "hbm"), not ``quota:TENANT:hbm``, and not counted in quota_rejections.
* Prefetch of a chain continued with ``parent=`` whose parent lies below the target tier moved
  nothing (0), though the tier had room.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from conftest import make_kv, tokens

from kvstore.block import SessionState
from kvstore.errors import InvalidArgument, KVStoreError, NotFound, ResourceExhausted

MOVES = ("evictions", "demotions", "promotions", "moved_hbm_to_dram", "moved_dram_to_nvme",
         "moved_dram_to_hbm", "moved_nvme_to_dram", "moved_nvme_to_hbm")


def _tiers(s, tenant, keys):
    return [(m.tier.label if (m := s._index.get(tenant, k)) is not None else None) for k in keys]


def _moves(s):
    c = s.stats()["counters"]
    return {k: c.get(k, 0) for k in MOVES}


def _others(s, spec, n=6):
    """Tenant "c": ``n`` unpinned one-block chains, the last ones in HBM, the first in DRAM."""
    keys = [s.block_keys("c", spec, tokens(1, spec, start=10_000 * (i + 1))) for i in range(n)]
    for i, k in enumerate(keys):
        s.put("c", spec, k, make_kv(spec, 1, seed=i))
    return [k[0] for k in keys]


# -- 1. a session put is refused by reserve_put before any room is made ------------------------

@pytest.mark.parametrize("nvme", [0, 64])
def test_reserve_put_refuses_an_unknown_session_before_making_room(open_store, spec, nvme):
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=nvme)
    kc = _others(s, spec)
    before, moves = _tiers(s, "c", kc), _moves(s)
    assert "hbm" in before
    keys = s.block_keys("a", spec, tokens(2, spec))
    with pytest.raises(NotFound):
        s.reserve_put("a", spec, keys, session="nope")
    assert _tiers(s, "c", kc) == before and _moves(s) == moves


@pytest.mark.parametrize("nvme", [0, 64])
def test_reserve_put_refuses_a_session_put_hbm_cannot_take_before_making_room(open_store, spec, nvme):
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=nvme)
    kc = _others(s, spec)
    s.open_session("b", "y")
    s.put("b", spec, s.block_keys("b", spec, tokens(3, spec)), make_kv(spec, 3), session="y")
    s.open_session("a", "x")
    before, moves = _tiers(s, "c", kc), _moves(s)
    assert "dram" in before  # HBM: 3 pinned blocks and 1 free, no room for a put of 2
    keys = s.block_keys("a", spec, tokens(2, spec))
    with pytest.raises(ResourceExhausted) as err:
        s.reserve_put("a", spec, keys, session="x")
    assert err.value.resource == "hbm"
    assert _tiers(s, "c", kc) == before and _moves(s) == moves


def test_a_session_reservation_lands_in_hbm_pinned_and_commits_its_session(open_store, spec):
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=64)
    s.open_session("a", "x")
    keys = s.block_keys("a", spec, tokens(2, spec))
    res = s.reserve_put("a", spec, keys, session="x")
    assert [slot[0].label for slot in res.slots] == ["hbm", "hbm"]
    s.commit_put(res, lambda i: None)  # the session is the reservation's
    assert [(m.tier.label, m.pins) for m in (s._index.get("a", k) for k in keys)] == [("hbm", 1)] * 2
    res = s.reserve_put("a", spec, s.block_keys("a", spec, tokens(3, spec))[2:], parent=keys[1], session="x")
    with pytest.raises(InvalidArgument, match="session 'x'"):
        s.commit_put(res, lambda i: None, session="other")
    assert res.done and s.lookup("a", spec, s.block_keys("a", spec, tokens(3, spec))).num_blocks == 2


def _service_case(tmp: Path, local: bool, case: str, nvme: int):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from service_harness import SPEC, fresh_tokens, random_kv, start

    B = SPEC.block_nbytes
    sc = start(tmp, store={"hbm_bytes": 4 * B, "dram_bytes": 4 * B, "nvme_bytes": nvme * B})
    try:
        a = sc.tenant("a", local=True) if local else sc.tenant("a")
        b, c = sc.tenant("b"), sc.tenant("c")
        kc = [c.block_keys(SPEC, fresh_tokens(1)) for _ in range(6)]
        for k in kc:
            c.put(SPEC, k, random_kv(1))
        session = "nope"
        if case == "pinned":
            b.open_session("y")
            b.put(SPEC, b.block_keys(SPEC, fresh_tokens(3)), random_kv(3), session="y")
            a.open_session("x")
            session = "x"
        before = [tuple(c.lookup(SPEC, k).tiers) for k in kc]
        ka = a.block_keys(SPEC, fresh_tokens(2))
        with pytest.raises(KVStoreError) as err:
            a.put(SPEC, ka, random_kv(2), session=session)
        after = [tuple(c.lookup(SPEC, k).tiers) for k in kc]
        return type(err.value).__name__, before, after
    finally:
        sc.stop()


@pytest.mark.parametrize("local", [False, True], ids=["stream", "local"])
@pytest.mark.parametrize("case", ["unknown", "pinned"])
def test_a_refused_session_put_over_grpc_evicts_nothing(local, case):
    with tempfile.TemporaryDirectory() as d:
        kind, before, after = _service_case(Path(d), local, case, nvme=0)
    assert kind == ("NotFound" if case == "unknown" else "ResourceExhausted")
    assert after == before


# -- 2. a refused resume moves nothing ---------------------------------------------------------

@pytest.mark.parametrize("nvme", [0, 64])
def test_a_refused_resume_moves_nothing(open_store, spec, nvme):
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=nvme)
    s.open_session("a", "x")
    kx = s.block_keys("a", spec, tokens(3, spec))
    s.put("a", spec, kx, make_kv(spec, 3), session="x")
    s.pause_session("a", "x")
    s.open_session("b", "y")
    s.put("b", spec, s.block_keys("b", spec, tokens(2, spec, start=500)), make_kv(spec, 2), session="y")
    kz = s.block_keys("c", spec, tokens(1, spec, start=900))
    s.put("c", spec, kz, make_kv(spec, 1))
    assert _tiers(s, "c", kz) == ["hbm"] and _tiers(s, "a", kx) == ["dram"] * 3
    moves = _moves(s)
    for _ in range(2):
        with pytest.raises(ResourceExhausted):
            s.resume_session("a", "x")
        assert _tiers(s, "c", kz) == ["hbm"] and _tiers(s, "a", kx) == ["dram"] * 3
        assert _moves(s) == moves
        assert s.session_state("a", "x") == SessionState.PAUSED
        assert [(m.pins, m.paused) for m in (s._index.get("a", k) for k in kx)] == [(0, 1)] * 3


# -- 3/4. what a refused resume says --------------------------------------------------------------

def _refused_resume(open_store, spec, path, pinned):
    s = open_store(spec, hbm_blocks=10, dram_blocks=10, nvme_blocks=64, path=path,
                   high_watermark=1.0, low_watermark=1.0)
    s.open_session("bob", "chat")
    kb = s.block_keys("bob", spec, tokens(6, spec))
    s.put("bob", spec, kb, make_kv(spec, 6), session="chat")
    s.pause_session("bob", "chat")
    s.open_session("alice", "s")
    ka = s.block_keys("alice", spec, tokens(pinned, spec, start=10_000))
    s.put("alice", spec, ka, make_kv(spec, pinned, 1), session="s")
    with pytest.raises(ResourceExhausted) as err:
        s.resume_session("bob", "chat")
    s.close()
    return err.value


def test_a_refused_resume_does_not_tell_how_much_others_pin(open_store, spec, tmp_path):
    five = _refused_resume(open_store, spec, tmp_path / "5", 5)
    eight = _refused_resume(open_store, spec, tmp_path / "8", 8)
    assert str(five) == str(eight)
    assert "stays paused" in str(five) and five.resource == "hbm"


def _at_hbm_quota(open_store, spec):
    s = open_store(spec, hbm_blocks=10, dram_blocks=10, nvme_blocks=64)
    s.open_session("bob", "chat")
    kb = s.block_keys("bob", spec, tokens(4, spec))
    s.put("bob", spec, kb, make_kv(spec, 4), session="chat")
    s.pause_session("bob", "chat")
    s.set_tenant_policy("bob", quota_bytes={"hbm": 2 * spec.block_nbytes})
    assert s.stats()["tiers"]["hbm"]["blocks"] == 0
    return s, kb


def test_a_resume_refused_by_the_quota_names_it(open_store, spec):
    s, kb = _at_hbm_quota(open_store, spec)
    with pytest.raises(ResourceExhausted) as err:
        s.resume_session("bob", "chat")
    assert "quota hbm=" in str(err.value) and "pinned" not in str(err.value)
    assert _tiers(s, "bob", kb) == ["dram"] * 4
    assert s.session_state("bob", "chat") == SessionState.PAUSED


def test_a_resume_refused_by_the_quota_is_a_quota_rejection(open_store, spec):
    s, _ = _at_hbm_quota(open_store, spec)
    with pytest.raises(ResourceExhausted) as err:
        s.resume_session("bob", "chat")
    assert err.value.resource == "quota:bob:hbm"
    assert s.stats()["counters"].get("quota_rejections") == 1


# -- 5. prefetch under a parent below the target tier ----------------------------------------------

def test_prefetch_with_a_parent_below_the_tier_brings_the_ancestors(open_store, spec, tmp_path):
    s = open_store(spec, hbm_blocks=8, dram_blocks=8, nvme_blocks=64, path=tmp_path / "s")
    keys = s.block_keys("a", spec, tokens(4, spec))
    s.put("a", spec, keys, make_kv(spec, 4))
    s.close()  # committed to NVMe: after the open every block is there
    s = open_store(spec, hbm_blocks=8, dram_blocks=8, nvme_blocks=64, path=tmp_path / "s")
    assert _tiers(s, "a", keys) == ["nvme"] * 4
    assert s.prefetch("a", spec, keys[2:], "hbm", parent=keys[1]) == 4
    assert _tiers(s, "a", keys) == ["hbm"] * 4
    assert s.prefetch("a", spec, keys, "hbm") == 0


def test_store_put_of_a_session_under_a_demoted_parent_refused_moves_nothing(open_store, spec):
    """Store.put brought a session put's demoted parent (and its ancestors) up into HBM before
    its up-front check, evicting other tenants' blocks for a put then refused."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64)
    base = s.block_keys("a", spec, tokens(3, spec))
    s.put("a", spec, base, make_kv(spec, 3))
    kc = _others(s, spec, n=4)  # push the chain down to DRAM
    s.open_session("b", "y")
    s.put("b", spec, s.block_keys("b", spec, tokens(2, spec, start=500_000)), make_kv(spec, 2), session="y")
    s.open_session("a", "x")
    before, moves = _tiers(s, "c", kc), _moves(s)
    parent_tiers = _tiers(s, "a", base)
    assert parent_tiers[-1] != "hbm", parent_tiers
    more = s.block_keys("a", spec, tokens(5, spec))[3:]  # 3 ancestors to lift + 2 new > 2 free of 4
    with pytest.raises(ResourceExhausted):
        s.put("a", spec, more, make_kv(spec, 2), session="x", parent=base[-1])
    assert _tiers(s, "c", kc) == before and _moves(s) == moves
    assert _tiers(s, "a", base) == parent_tiers
