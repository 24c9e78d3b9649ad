"""What the last local tier evicts first, whatever the policy: the NVMe copies of blocks that
live above it (dropping one loses no block), then ordinary blocks, and a paused session's
blocks last (pause promises to keep them). Each test failed on the code before under lru."""

from __future__ import annotations

import pytest
import torch
from conftest import make_kv, tokens

POLICIES = ["lru", "gdsf", "cost"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_paused_sessions_blocks_outlive_other_traffic(open_store, spec, clock, policy):
    s = open_store(spec, hbm_blocks=10, dram_blocks=10, nvme_blocks=30, policy=policy)
    keys = s.block_keys("a", spec, tokens(4, spec))
    kv = make_kv(spec, 4, seed=1)
    s.open_session("a", "chat")
    s.put("a", spec, keys, kv, session="chat")
    s.pause_session("a", "chat")
    for i in range(40):  # three times the store's room in other blocks of the same tenant
        clock.advance(1)
        s.put("a", spec, s.block_keys("a", spec, tokens(3, spec, start=10_000 * (i + 1))),
              make_kv(spec, 3, seed=10 + i))
    assert s.lookup("a", spec, keys).num_blocks == 4
    assert s.stats()["counters"].get("paused_evictions", 0) == 0
    s.resume_session("a", "chat")
    assert s.lookup("a", spec, keys).tiers == ["hbm"] * 4
    assert torch.equal(s.get("a", spec, keys), kv)


def test_paused_blocks_go_when_nothing_else_can_and_are_counted(open_store, spec, clock):
    """A last tier holding nothing but paused blocks still makes room, and says it did."""
    s = open_store(spec, hbm_blocks=2, dram_blocks=2, nvme_blocks=6, policy="lru")
    for n in range(5):
        sid = f"s{n}"
        s.open_session("a", sid)
        s.put("a", spec, s.block_keys("a", spec, tokens(2, spec, start=1_000 * (n + 1))),
              make_kv(spec, 2, seed=n), session=sid)
        s.pause_session("a", sid)
    clock.advance(1)
    s.put("a", spec, s.block_keys("a", spec, tokens(2, spec, start=99_000)), make_kv(spec, 2, seed=9))
    assert s.stats()["counters"].get("paused_evictions", 0) > 0


def test_nvme_copies_of_blocks_above_go_before_nvme_only_blocks(open_store, spec, clock):
    """Under lru the least recently used NVMe entry went first: blocks living only on NVMe
    (two of them here), though the NVMe copies of blocks read since could go, losing nothing."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=0, nvme_blocks=6, policy="lru")
    keys = [s.block_keys("a", spec, tokens(1, spec, start=100 * (i + 1))) for i in range(8)]

    def put(i: int) -> None:
        clock.advance(1)
        s.put("a", spec, keys[i], make_kv(spec, 1, seed=i))
    for i in range(7):
        put(i)
    s.flush()  # the HBM blocks get NVMe copies while there is room: NVMe is full
    assert s.stats()["tiers"]["nvme"]["used_bytes"] == s.stats()["tiers"]["nvme"]["capacity_bytes"]
    living_only_on_nvme = [i for i in range(7) if s.lookup("a", spec, keys[i]).tiers == ["nvme"]]
    assert living_only_on_nvme
    copies = [i for i in range(7) if i not in living_only_on_nvme and s._index.get("a", keys[i][0]).persisted]
    assert copies
    for i in copies:  # read: their NVMe copies become the most recent NVMe entries
        clock.advance(1)
        s.get("a", spec, keys[i])
    put(7)  # a block without an NVMe copy is demoted into the full NVMe tier
    assert all(s.lookup("a", spec, keys[i]).num_blocks == 1 for i in range(8))
    assert torch.equal(s.get("a", spec, keys[0]), make_kv(spec, 1, seed=0))


@pytest.mark.parametrize("policy", POLICIES)
def test_reading_blocks_under_an_nvme_quota_loses_few(open_store, spec, clock, policy):
    """Reads promote blocks and their NVMe copies stay, counted against the NVMe quota: a block
    demoted into a full quota dropped NVMe-only blocks instead of those copies (12 held -> 8
    under lru and gdsf). A block moving up out of NVMe still needs its own copy while it
    moves, so a wave of promotions can cost a block or two."""
    n = spec.block_nbytes
    s = open_store(spec, hbm_blocks=64, dram_blocks=64, nvme_blocks=256, policy=policy)
    s.set_tenant_policy("a", quota_bytes={"hbm": 2 * n, "dram": 2 * n, "nvme": 8 * n})
    chains = []
    for i in range(12):
        clock.advance(1)
        k = s.block_keys("a", spec, tokens(1, spec, start=100 * (i + 1)))
        s.put("a", spec, k, make_kv(spec, 1, seed=i))
        chains.append(k)
    assert sum(s.lookup("a", spec, k).num_blocks for k in chains) == 12
    for _ in range(3):
        for k in chains:
            clock.advance(1)
            s.get("a", spec, k)
    assert sum(s.lookup("a", spec, k).num_blocks for k in chains) >= 10


def test_hits_are_counted_in_the_tier_each_block_was_found_in(open_store, spec, clock):
    """Counted after the promotion, every hit was an HBM hit."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=64, policy="lru")
    keys = s.block_keys("a", spec, tokens(3, spec))
    s.put("a", spec, keys, make_kv(spec, 3))
    for i in range(6):
        clock.advance(1)
        s.put("a", spec, s.block_keys("a", spec, tokens(2, spec, start=10_000 * (i + 1))), make_kv(spec, 2))
    tiers = s.lookup("a", spec, keys).tiers
    assert tiers != ["hbm"] * 3
    before = s.stats()["counters"]
    s.get("a", spec, keys)
    after = s.stats()["counters"]
    for t in ("hbm", "dram", "nvme"):
        assert after.get(f"hits_{t}", 0) - before.get(f"hits_{t}", 0) == tiers.count(t), t


@pytest.mark.parametrize("how", ["get", "lease"])
def test_a_block_that_fails_its_check_is_no_hit_in_its_tier(open_store, spec, how):
    """bring_up counted the tier's hit before the copy that found the NVMe value damaged: the
    block was an nvme hit and a miss (the tiers' hits summed to more than ``hits``)."""
    from tiers.nvme import tenant_prefix

    s = open_store(spec, hbm_blocks=2, dram_blocks=0, nvme_blocks=64)
    s.open_session("t", "pins")  # HBM full of pinned blocks: nothing is promoted
    s.put("t", spec, s.block_keys("t", spec, tokens(2, spec, start=5000)), make_kv(spec, 2), session="pins")
    keys = s.block_keys("t", spec, tokens(3, spec))
    s.put("t", spec, keys, make_kv(spec, 3))
    assert s.lookup("t", spec, keys).tiers == ["nvme"] * 3
    nv = s._nvme
    with nv._env.begin(db=nv._blocks, write=True) as txn:  # damage block 1's value
        k = tenant_prefix("t") + keys[1]
        v = bytes(txn.get(k))
        txn.put(k, v[:-40] + bytes(40))
    before = s.stats()["counters"]
    if how == "get":
        assert s.get("t", spec, keys).shape[0] == 1
    else:
        import numpy as np

        lease = s.lease_prefix("t", spec, keys, lambda i: np.empty(spec.block_nbytes, np.uint8))
        assert len(lease.views) == 1
        lease.release()
    after = s.stats()["counters"]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("hits", "hits_hbm", "hits_dram", "hits_nvme")}
    assert delta == {"hits": 1, "hits_hbm": 0, "hits_dram": 0, "hits_nvme": 1}
