"""Session defects a prober found (each test failed before its fix).

* A refused resume of a session holding blocks of two block sizes (a target model's and its
  draft model's) evicted other tenants' blocks first: the up-front room check sized every block
  as the smallest, passed, and the promotion found out the rest.
* A resume that found one of the session's blocks damaged on NVMe (dropped, counted as an
  integrity failure) was refused as ResourceExhausted "hbm cannot make room ... pinned", HBM
  nearly empty, the session left paused: the dropped block counted as one that did not fit.
* An admin drop of a shared namespace's blocks (the namespace, its publishers and grants kept)
  forgot its sessions: a publisher's next verb was told its session did not survive a restart
  of the store, though none happened.
"""

from __future__ import annotations

import pytest
from conftest import make_kv, tokens

from kvstore.errors import NotFound, ResourceExhausted
from kvstore.spec import ModelSpec
from tiers.nvme import tenant_prefix

MOVES = ("evictions", "demotions", "promotions", "moved_hbm_to_dram", "moved_dram_to_hbm",
         "moved_nvme_to_hbm", "moved_nvme_to_dram", "moved_dram_to_nvme")


def _moves(s):
    c = s.stats()["counters"]
    return {k: c.get(k, 0) for k in MOVES}


# -- 1. a resume is checked with each block at its own size -------------------------------------

@pytest.fixture
def draft(spec):
    """A model whose blocks are 4x the ``spec``'s (2048 B against 512 B)."""
    big = ModelSpec(model="draft", revision="r1", num_layers=2, num_kv_heads=2, head_dim=32,
                    dtype="float16", block_tokens=4)
    assert big.block_nbytes == 4 * spec.block_nbytes
    return big


def _paused_two_models(s, spec, draft):
    """Session a/x: two blocks of ``spec`` and one of ``draft`` (3072 B), paused in DRAM."""
    ks = s.block_keys("a", spec, tokens(2, spec))
    kd = s.block_keys("a", draft, tokens(1, draft))
    s.open_session("a", "x")
    s.put("a", spec, ks, make_kv(spec, 2), session="x")
    s.put("a", draft, kd, make_kv(draft, 1, seed=1), session="x")
    s.pause_session("a", "x")
    assert s.lookup("a", spec, ks).tiers == ["dram", "dram"] and s.lookup("a", draft, kd).tiers == ["dram"]
    return ks, kd


def test_a_refused_resume_of_two_block_sizes_evicts_nothing(open_store, spec, draft):
    """The prober's case: HBM 4096 B, b pins 1536 B and holds 1024 B unpinned; a's session needs
    3072 B, of which at most 2560 B can be made: refused, b's blocks still in HBM, nothing moved,
    and a retry the same."""
    s = open_store(spec, hbm_blocks=8, dram_blocks=16)
    _paused_two_models(s, spec, draft)
    s.open_session("b", "y")
    s.put("b", spec, s.block_keys("b", spec, tokens(3, spec, start=400)), make_kv(spec, 3, seed=2), session="y")
    kb = s.block_keys("b", spec, tokens(2, spec, start=800))
    s.put("b", spec, kb, make_kv(spec, 2, seed=3))
    assert s.lookup("b", spec, kb).tiers == ["hbm", "hbm"]
    moves = _moves(s)
    for _ in range(2):
        with pytest.raises(ResourceExhausted) as err:
            s.resume_session("a", "x")
        assert "nothing was moved" in str(err.value)
        assert s.session_state("a", "x").value == "paused"
        assert s.lookup("b", spec, kb).tiers == ["hbm", "hbm"] and _moves(s) == moves


def test_a_resume_of_two_block_sizes_over_the_quota_names_it_and_moves_nothing(open_store, spec, draft):
    """a's HBM quota of 2560 B takes five blocks of the small size but not the session's 3072 B:
    refused by the quota, up front (the promotion moved the small blocks up and back first)."""
    s = open_store(spec, hbm_blocks=8, dram_blocks=16)
    ks, _ = _paused_two_models(s, spec, draft)
    s.set_tenant_policy("a", quota_bytes={"hbm": 5 * spec.block_nbytes})
    moves = _moves(s)
    with pytest.raises(ResourceExhausted) as err:
        s.resume_session("a", "x")
    assert err.value.resource == "quota:a:hbm" and "nothing was moved" in str(err.value)
    assert _moves(s) == moves and s.lookup("a", spec, ks).tiers == ["dram", "dram"]


def test_a_resume_of_two_block_sizes_that_fits_goes_through(open_store, spec, draft):
    """The byte check lets through what fits: 3072 B into HBM of 4096 B, b's unpinned blocks
    making room."""
    s = open_store(spec, hbm_blocks=8, dram_blocks=16)
    ks, kd = _paused_two_models(s, spec, draft)
    kb = s.block_keys("b", spec, tokens(4, spec, start=800))
    s.put("b", spec, kb, make_kv(spec, 4, seed=3))
    assert s.resume_session("a", "x") == 3
    assert s.lookup("a", spec, ks).tiers == ["hbm", "hbm"] and s.lookup("a", draft, kd).tiers == ["hbm"]


# -- 2. a block lost to an integrity failure on the way up is a miss, not a refusal -------------

def _damage(s, tenant, key):
    """Overwrite the tail of ``key``'s stored NVMe value (its authentication fails)."""
    nv = s._nvme
    with nv._env.begin(db=nv._blocks, write=True) as txn:
        k = tenant_prefix(tenant) + key
        v = bytes(txn.get(k))
        txn.put(k, v[:-40] + bytes(40))


def _paused_in_nvme(s, spec, chains):
    """Session a/x holding ``chains`` (a list of block counts, one chain each), paused and
    pushed down to NVMe by tenant b's blocks."""
    keys = [s.block_keys("a", spec, tokens(n, spec, start=1000 * i)) for i, n in enumerate(chains)]
    s.open_session("a", "x")
    for i, k in enumerate(keys):
        s.put("a", spec, k, make_kv(spec, len(k), seed=i), session="x")
    s.pause_session("a", "x")
    s.put("b", spec, s.block_keys("b", spec, tokens(5, spec, start=50_000)), make_kv(spec, 5, seed=9))
    for k in keys:
        assert s.lookup("a", spec, k).tiers == ["nvme"] * len(k)
    return keys


def test_a_resume_that_loses_a_damaged_block_resumes_the_rest(open_store, spec):
    """The prober's case: three blocks in NVMe, the last damaged: the resume brings up two, the
    session is resumed (its blocks pinned in HBM), the damaged block a miss."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=1)
    (k,) = _paused_in_nvme(s, spec, [3])
    _damage(s, "a", k[2])
    assert s.resume_session("a", "x") == 2
    assert s.stats()["integrity_failures"] == 1
    assert s.session_state("a", "x").value == "resumed"
    assert s.lookup("a", spec, k).tiers == ["hbm", "hbm"]
    assert [s._index.get("a", key).pins for key in k[:2]] == [1, 1]
    assert s.get("a", spec, k).shape[0] == 2
    assert s.resume_session("a", "x") == 0  # resumed already


def test_a_resume_that_loses_a_block_brings_up_the_other_chains(open_store, spec):
    """Two chains of the session; the first one's root is damaged: it goes with its child, and
    the promotion, which stopped at it, goes on with the other chain."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=1)
    k1, k2 = _paused_in_nvme(s, spec, [2, 2])
    _damage(s, "a", k1[0])
    assert s.resume_session("a", "x") == 2
    assert s.session_state("a", "x").value == "resumed"
    assert s.lookup("a", spec, k1).tiers == [] and s.lookup("a", spec, k2).tiers == ["hbm", "hbm"]
    assert s.get("a", spec, k2).shape[0] == 2


# -- 3. an admin drop of a shared namespace's blocks says so to its sessions --------------------

def test_sessions_of_a_namespace_whose_blocks_were_dropped_are_told_so(open_store, spec):
    """drop_tenant(namespace_stays=True): the sessions end, and a later verb is told how, not
    that the store restarted; open again, the session works."""
    s = open_store(spec)
    keys = s.block_keys("shared:x", spec, tokens(2, spec))
    s.open_session("shared:x", "s")
    s.put("shared:x", spec, keys, make_kv(spec, 2), session="s")
    s.open_session("shared:x", "t")
    s.close_session("shared:x", "t")
    assert s.drop_tenant("shared:x", namespace_stays=True) == 2
    for verb in ("pause", "resume", "close"):
        with pytest.raises(NotFound) as err:
            s.session_verb("shared:x", "s", verb)
        assert "ended by an admin drop of the namespace's blocks" in str(err.value)
        assert "restart" not in str(err.value)
    with pytest.raises(NotFound, match="was closed"):  # ended before: as it ended
        s.session_state("shared:x", "t")
    assert s.stats()["sessions"] == 0
    assert s.open_session("shared:x", "s").value == "active"
    s.put("shared:x", spec, keys, make_kv(spec, 2), session="s")
    assert s.lookup("shared:x", spec, keys).tiers == ["hbm", "hbm"]


def test_a_deleted_tenants_sessions_are_forgotten(open_store, spec):
    """A tenant deleted (its name free for a new one) keeps nothing of its sessions."""
    s = open_store(spec)
    s.open_session("a", "s")
    s.drop_tenant("a")
    with pytest.raises(NotFound, match="unknown session"):
        s.session_state("a", "s")


def test_a_publisher_told_its_session_ended_by_a_namespace_wipe(sidecar):
    """The prober's case over gRPC: `kvstore tenant delete shared:x`; the publisher's next verb
    is NOT_FOUND saying the namespace's blocks were dropped, not that the store restarted."""
    from service_harness import SPEC, fresh_tokens, random_kv

    adm = sidecar.admin()
    pub = sidecar.client(adm.create_tenant("pub", role="publisher", namespaces=["shared:x"]), local=False)
    keys = pub.block_keys(SPEC, fresh_tokens(2), namespace="shared:x")
    pub.open_session("s", namespace="shared:x")
    pub.put(SPEC, keys, random_kv(2), session="s", namespace="shared:x")
    assert adm.delete_tenant("shared:x") == 2
    with pytest.raises(NotFound) as err:
        pub.pause_session("s", namespace="shared:x")
    assert "admin drop of the namespace's blocks" in str(err.value) and "restart" not in str(err.value)
    assert pub.open_session("s", namespace="shared:x").value == "active"
