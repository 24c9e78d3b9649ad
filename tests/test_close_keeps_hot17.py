"""A graceful close with NVMe near capacity kept the cold cache and lost the hot one.

With ``persist_on_close`` (the default) a close commits HBM/DRAM blocks to NVMe "as room allows":
with NVMe full of older blocks it committed the first memory blocks that fitted and dropped
the rest (a prober saw 13-18 lost, "could not be committed ... they are lost"), while NVMe
stayed full of colder blocks. Now a memory block short of room evicts NVMe blocks the policy
values less (leaves first, never pinned or in flight, never a memory block's copy), and only
when nothing colder can go is it lost, as before.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_kv, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block import Tier
from kvstore.errors import ParentNotStored, ResourceExhausted

HOT = 8


def _fill(open_store, spec, clock, path, policy="lru"):
    """A store (HBM 4, DRAM 4, NVMe 16 blocks) where 40 old single-block prompts went by (15
    of them, the latest, left in NVMe) and then, 1000 s later, ``HOT`` hot ones, 6 of them still
    in HBM/DRAM. Returns (store, old, hot): lists of (keys, seed)."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=16, path=path, policy=policy)
    old, hot = [], []
    for i in range(40 + HOT):
        if i == 40:
            clock.advance(1000)
        keys = s.block_keys("t", spec, tokens(1, spec, start=1000 * i))
        s.put("t", spec, keys, make_kv(spec, 1, seed=i))
        (old if i < 40 else hot).append((keys, i))
        clock.advance(1)
    return s, old, hot


def _served(s, spec, blocks):
    """How many of ``blocks`` the store serves; each one served must hold its own bytes."""
    n = 0
    for keys, seed in blocks:
        got = s.get("t", spec, keys)
        if len(got):
            assert torch.equal(got.view(torch.uint8), make_kv(spec, 1, seed=seed).view(torch.uint8))
            n += 1
    return n


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_close_near_nvme_capacity_keeps_the_hot_blocks(open_store, spec, clock, tmp_path, policy):
    s, old, hot = _fill(open_store, spec, clock, tmp_path / "st", policy)
    in_memory = [m for m in s._index.of_tenant("t") if m.tier < Tier.NVME and not m.persisted]
    assert len(in_memory) == 6
    assert s._index.get("t", hot[-1][0][0]).tier < Tier.NVME
    s.close()
    assert s.uncommitted_at_close == 0  # it was 5 (of 6): NVMe stayed full of the old blocks
    assert s.stats()["counters"].get("evicted_at_close", 0) == 5
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=16, path=tmp_path / "st", policy=policy)
    assert _served(s, spec, hot) == HOT  # it was 3
    assert _served(s, spec, old) == 16 - HOT  # the newest of the old ones, intact


def test_close_with_nothing_colder_commits_as_room_allows(open_store, spec, clock, tmp_path):
    """Memory blocks older than every NVMe block (read long ago, NVMe's blocks since): nothing
    is evicted for them; they are committed as room allows and the rest are lost, as before."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=8, path=tmp_path / "st", policy="lru")
    blocks = []
    for i in range(16):
        keys = s.block_keys("t", spec, tokens(1, spec, start=1000 * i))
        s.put("t", spec, keys, make_kv(spec, 1, seed=i))
        blocks.append((keys, i))
        clock.advance(1)
    nvme = [m for m in s._index.of_tenant("t") if m.tier == Tier.NVME]
    for m in nvme:  # NVMe's blocks read last (without bringing them up: set as a read would)
        m.last_access = clock() + 100
    s.close()
    assert s.stats()["counters"].get("evicted_at_close", 0) == 0
    assert s.uncommitted_at_close > 0
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=8, path=tmp_path / "st", policy="lru")
    found = {m.key for m in s._index.of_tenant("t")}
    assert {m.key for m in nvme} <= found
    assert _served(s, spec, blocks) == len(found)


def test_close_never_evicts_a_pinned_nvme_block(open_store, spec, clock, tmp_path):
    s, _, _ = _fill(open_store, spec, clock, tmp_path / "st")
    nvme = [m for m in s._index.of_tenant("t") if m.tier == Tier.NVME]
    for m in nvme:
        m.pins += 1  # as a read lease pins the blocks it serves
    s.close()
    assert s.stats()["counters"].get("evicted_at_close", 0) == 0
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=16, path=tmp_path / "st")
    assert {m.key for m in nvme} <= {m.key for m in s._index.of_tenant("t")}


def test_close_keeps_an_active_sessions_blocks_and_a_paused_sessions(open_store, spec, clock, tmp_path):
    """An ACTIVE session's pinned HBM blocks are committed as ordinary blocks, as before; a
    paused session's blocks are never given up for others' (the pause promised to keep them),
    even when older."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=16, path=tmp_path / "st", policy="lru")
    s.open_session("t", "paused")
    pk = s.block_keys("t", spec, tokens(3, spec, start=500_000))
    s.put("t", spec, pk, make_kv(spec, 3, seed=99), session="paused")
    s.pause_session("t", "paused")
    clock.advance(1)
    for i in range(40):  # old traffic pushes the paused blocks down
        keys = s.block_keys("t", spec, tokens(1, spec, start=1000 * i))
        s.put("t", spec, keys, make_kv(spec, 1, seed=i))
        clock.advance(1)
    clock.advance(1000)
    s.open_session("t", "active")
    ak = s.block_keys("t", spec, tokens(2, spec, start=600_000))
    s.put("t", spec, ak, make_kv(spec, 2, seed=98), session="active")
    assert all(s._index.get("t", k).pins for k in ak)
    paused_kept = [k for k in pk if s._index.get("t", k) is not None]
    assert paused_kept
    s.close()
    assert s.uncommitted_at_close == 0
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=16, path=tmp_path / "st", policy="lru")
    assert s.lookup("t", spec, ak).num_blocks == 2
    assert torch.equal(s.get("t", spec, ak).view(torch.uint8), make_kv(spec, 2, seed=98).view(torch.uint8))
    assert s.lookup("t", spec, pk).num_blocks == len(paused_kept)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 3), st.booleans(), st.integers(0, 50)),
                    min_size=4, max_size=16),
       policy=st.sampled_from(["lru", "cost"]), nvme_blocks=st.integers(2, 12))
def test_after_close_and_reopen_every_block_is_intact_and_the_tree_whole(
        open_store, spec, clock, tmp_path_factory, ops, policy, nvme_blocks):
    """Chains of 1-3 blocks under 8 prompts (extending what is stored, or new), some read
    again, with time passing: after a close (evicting what it may) and a reopen, every block
    found is served with its own bytes, and every block's parent is there too."""
    path = tmp_path_factory.mktemp("st")
    s = open_store(spec, hbm_blocks=3, dram_blocks=3, nvme_blocks=nvme_blocks, path=path, policy=policy)
    seeds: dict[bytes, int] = {}
    chains: dict[int, list[int]] = {}
    for n, (prompt, length, read, dt) in enumerate(ops):
        had = chains.setdefault(prompt, [])
        toks = had + [prompt * 100_000 + n * 10 + j for j in range(length * spec.block_tokens)]
        keys = s.block_keys("t", spec, toks)
        new = keys[len(had) // spec.block_tokens:]
        try:
            s.put("t", spec, new, torch.cat([make_kv(spec, 1, seed=seeds.setdefault(k, 10 * len(seeds)))
                                             for k in new]), parent=keys[-len(new) - 1] if had else None)
            chains[prompt] = toks
        except (ResourceExhausted, ParentNotStored):
            pass  # no room for it now, or its prefix was evicted: the chain stays as it was
        if read:
            s.get("t", spec, keys[:1])
        clock.advance(dt)
    s.close()
    s = open_store(spec, hbm_blocks=3, dram_blocks=3, nvme_blocks=nvme_blocks, path=path, policy=policy)
    found = s._index.of_tenant("t")
    keys_found = {m.key for m in found}
    for m in found:
        assert m.depth == 0 or m.parent in keys_found
    for prompt, toks in chains.items():
        keys = s.block_keys("t", spec, toks)
        got = s.get("t", spec, keys)
        assert len(got) == sum(1 for k in keys if k in keys_found)
        for i in range(len(got)):
            assert torch.equal(got[i].view(torch.uint8), make_kv(spec, 1, seed=seeds[keys[i]])[0].view(torch.uint8))


def test_close_at_a_tenants_nvme_quota_evicts_only_its_own_colder_blocks(open_store, spec, clock, tmp_path):
    """Tenant "q" at its NVMe quota: its hot memory blocks take the place of its own older NVMe
    blocks, never of another tenant's (even older) ones, which free no quota of "q"."""
    B = spec.block_nbytes
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=64, path=tmp_path / "st", policy="lru")
    s.set_tenant_policy("q", quota_bytes={"nvme": 8 * B})
    other, hot = [], []
    for i in range(10):
        keys = s.block_keys("o", spec, tokens(1, spec, start=1000 * i))
        s.put("o", spec, keys, make_kv(spec, 1, seed=i))
        other.append(keys)
        clock.advance(1)
    for i in range(20):
        s.put("q", spec, s.block_keys("q", spec, tokens(1, spec, start=1000 * i)), make_kv(spec, 1, seed=i))
        clock.advance(1)
    clock.advance(1000)
    for i in range(20, 24):
        keys = s.block_keys("q", spec, tokens(1, spec, start=1000 * i))
        s.put("q", spec, keys, make_kv(spec, 1, seed=i))
        hot.append((keys, i))
        clock.advance(1)
    assert all(s._index.get("q", k[0]).tier < Tier.NVME for k, _ in hot)
    assert all(s._index.get("o", k[0]).tier == Tier.NVME for k in other)
    s.close()
    assert s.stats()["counters"].get("evicted_at_close", 0) > 0
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=64, path=tmp_path / "st", policy="lru")
    assert all(s.lookup("o", spec, k).num_blocks == 1 for k in other)
    for keys, seed in hot:
        assert torch.equal(s.get("q", spec, keys).view(torch.uint8), make_kv(spec, 1, seed=seed).view(torch.uint8))
