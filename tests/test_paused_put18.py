"""A put naming a PAUSED session is placed as any put (not pinned, not held to HBM) and its blocks
wait in DRAM with the session's others (DESIGN §5); a session put that names a stored block
whose NVMe value fails its check on the way up stores that block anew from the put's bytes.

Before: a paused session's put was placed as pinned (HBM only): refused with DRAM free when
other sessions' pins filled HBM, its new blocks left in HBM, a re-put of its parked blocks
pulled them back up; the damaged block made a session put fail "cannot make room"."""

from __future__ import annotations

import pytest
import service_harness
import torch
from conftest import make_kv, tokens
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.errors import ResourceExhausted
from kvstore.spec import ModelSpec
from tiers.nvme import tenant_prefix

SPEC_S = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                   block_tokens=4)
N = SPEC_S.block_nbytes


def test_a_paused_sessions_put_is_not_refused_when_only_hbm_is_full(open_store):
    s = open_store(SPEC_S, hbm_blocks=4, dram_blocks=8, durable=False)
    a = s.block_keys("A", SPEC_S, tokens(4, SPEC_S))
    b = s.block_keys("B", SPEC_S, tokens(2, SPEC_S, start=100))
    s.open_session("B", "sb")
    s.pause_session("B", "sb")
    s.open_session("A", "sa")
    s.put("A", SPEC_S, a, make_kv(SPEC_S, 4))  # HBM full of A's pins
    s.put("A", SPEC_S, a, make_kv(SPEC_S, 4), session="sa")
    kv = make_kv(SPEC_S, 2, seed=1)
    s.put("B", SPEC_S, b, kv, session="sb")  # was ResourceExhausted "no room ... in hbm"
    assert s.lookup("B", SPEC_S, b).tiers == ["dram", "dram"]
    assert torch.equal(s.get("B", SPEC_S, b), kv)
    assert all(s._index.get("B", k).pins == 0 and s._index.get("B", k).paused == 1 for k in b)


def test_a_paused_sessions_blocks_wait_in_dram_and_a_re_put_leaves_them_there(open_store):
    s = open_store(SPEC_S, hbm_blocks=4, dram_blocks=8, durable=False)
    s.open_session("B", "sb")
    s.pause_session("B", "sb")
    c = s.block_keys("B", SPEC_S, tokens(2, SPEC_S, start=200))
    s.put("B", SPEC_S, c, make_kv(SPEC_S, 2, seed=2), session="sb")
    assert s.lookup("B", SPEC_S, c).tiers == ["dram", "dram"]  # was hbm: where pause puts none
    s.open_session("B", "sd")
    d = s.block_keys("B", SPEC_S, tokens(3, SPEC_S, start=300))
    kv = make_kv(SPEC_S, 3, seed=4)
    s.put("B", SPEC_S, d, kv, session="sd")
    s.pause_session("B", "sd")
    assert s.lookup("B", SPEC_S, d).tiers == ["dram"] * 3
    s.put("B", SPEC_S, d, kv, session="sd")  # idempotent re-put naming the paused session
    assert s.lookup("B", SPEC_S, d).tiers == ["dram"] * 3  # was pulled back up to hbm
    assert s.session_state("B", "sd").value == "paused"
    s.resume_session("B", "sd")
    assert s.lookup("B", SPEC_S, d).tiers == ["hbm"] * 3
    assert all(s._index.get("B", k).pins == 1 for k in d)


def test_a_session_put_over_a_damaged_stored_block_stores_it_anew(open_store):
    s = open_store(SPEC_S, hbm_blocks=4, dram_blocks=0, durable=False)
    k = s.block_keys("A", SPEC_S, tokens(3, SPEC_S))
    kv = make_kv(SPEC_S, 3)
    s.put("A", SPEC_S, k, kv)
    s.put("A", SPEC_S, s.block_keys("B", SPEC_S, tokens(5, SPEC_S, start=500)), make_kv(SPEC_S, 5, seed=1))
    assert s.lookup("A", SPEC_S, k).tiers[1:] == ["nvme", "nvme"]
    nv = s._nvme
    with nv._env.begin(db=nv._blocks, write=True) as txn:  # damage block 1's value in place
        dbkey = tenant_prefix("A") + k[1]
        v = txn.get(dbkey)
        txn.put(dbkey, v[:-40] + bytes(40))
    s.open_session("A", "y")
    s.put("A", SPEC_S, k, kv, session="y")  # was ResourceExhausted "hbm cannot make room"
    assert s.stats()["integrity_failures"] == 1
    assert s.lookup("A", SPEC_S, k).tiers == ["hbm"] * 3
    assert torch.equal(s.get("A", SPEC_S, k), kv)
    assert all(s._index.get("A", x).pins == 1 for x in k)


def test_a_paused_sessions_put_stream_is_not_refused(tmp_path):
    nb = SPEC.block_nbytes
    sc = service_harness.start(tmp_path / "g", store={"hbm_bytes": 4 * nb, "dram_bytes": 8 * nb,
                                                      "nvme_bytes": 64 * nb, "durable": False})
    try:
        adm = sc.admin()
        a = sc.client(adm.create_tenant("ta"), local=False)
        b = sc.client(adm.create_tenant("tb"), local=False)
        b.open_session("sb")
        b.pause_session("sb")
        ka = a.block_keys(SPEC, fresh_tokens(4))
        a.open_session("sa")
        a.put(SPEC, ka, random_kv(4), session="sa")
        kb = b.block_keys(SPEC, fresh_tokens(2))
        kv = random_kv(2, seed=3)
        b.put(SPEC, kb, kv, session="sb")  # was RESOURCE_EXHAUSTED
        assert b.lookup(SPEC, kb).tiers == ["dram", "dram"]
        assert torch.equal(b.get(SPEC, kb), kv)
    finally:
        sc.stop()


def test_a_put_cannot_make_a_paused_session_larger_than_hbm(open_store):
    """A paused session's put is placed as any put; one that took the session past HBM left it
    for ever unresumable, each resume blaming other sessions' pins (there were none)."""
    s = open_store(SPEC_S, hbm_blocks=4, dram_blocks=8, durable=False)
    s.open_session("A", "x")
    a = s.block_keys("A", SPEC_S, tokens(3, SPEC_S))
    s.put("A", SPEC_S, a, make_kv(SPEC_S, 3), session="x")
    s.pause_session("A", "x")
    more = s.block_keys("A", SPEC_S, tokens(2, SPEC_S, start=100))
    with pytest.raises(ResourceExhausted, match="could never be resumed"):
        s.put("A", SPEC_S, more, make_kv(SPEC_S, 2, seed=1), session="x")
    assert s.lookup("A", SPEC_S, more).num_blocks == 0  # nothing stored
    s.put("A", SPEC_S, more[:1], make_kv(SPEC_S, 1, seed=1), session="x")  # 4 blocks: fits hbm
    s.put("A", SPEC_S, a, make_kv(SPEC_S, 3), session="x")  # a re-put of its own blocks adds nothing
    s.resume_session("A", "x")
    assert s.lookup("A", SPEC_S, a).tiers == ["hbm"] * 3
    assert s.lookup("A", SPEC_S, more[:1]).tiers == ["hbm"]


def test_a_resume_refused_for_a_session_past_the_tenants_hbm_quota_says_so(open_store):
    s = open_store(SPEC_S, hbm_blocks=8, dram_blocks=8, durable=False)
    s.open_session("A", "x")
    a = s.block_keys("A", SPEC_S, tokens(3, SPEC_S))
    s.put("A", SPEC_S, a, make_kv(SPEC_S, 3), session="x")
    s.pause_session("A", "x")
    s.set_tenant_policy("A", quota_bytes={"hbm": 2 * N})
    with pytest.raises(ResourceExhausted, match="close it") as err:
        s.resume_session("A", "x")
    assert "pinned by sessions" not in str(err.value) and "other sessions" not in str(err.value)
    assert "raise its quota" in str(err.value)
