"""Read paths and the tier order (prober round 16). Each test failed on the code before.

A. ``get(keys, parent=P)`` and ``lease_prefix(keys, parent=P)`` protected only the keys' blocks:
   promoting the first of them into HBM evicted ``P`` (a leaf in HBM, its only child below) to
   make room, and the block then sat in HBM under a parent in DRAM (lookups of the chain
   stopped at ``P``). The parent's lineage is held now, as ``Placement.promote`` holds it.
B. a tenant's quota lowered under its session-pinned blocks (kept while pinned) was never
   applied once the session ended: after close_session / end_session the tenant held 3x its
   quota until it put again (and a pause that could not park every block in DRAM, its DRAM
   quota binding, left it over its HBM quota). The quota is fitted when the pins go, as
   set_tenant_policy does.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.block import Tier
from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store

SPEC = ModelSpec(model="sm", revision="r", num_layers=2, num_kv_heads=2, head_dim=16,
                 dtype="float16", block_tokens=2)
N = SPEC.block_nbytes


def _store(path: Path) -> Store:
    return Store.open(StoreConfig(path=path, hbm_bytes=1 * N, dram_bytes=3 * N, nvme_bytes=0,
                                  policy="lru"))


def _tiers_ordered(s: Store, keys: list[bytes]) -> list[Tier]:
    tiers = [s._index.get("a", k).tier for k in keys]
    assert all(a <= b for a, b in pairwise(tiers)), tiers
    return tiers


@pytest.mark.parametrize("how", ["get", "get_into", "lease_prefix"])
def test_read_under_parent_keeps_parent_above_child(tmp_path: Path, how: str) -> None:
    s = _store(tmp_path)
    try:
        keys = s.block_keys("a", SPEC, [1, 2, 3, 4])  # R, C
        kv = torch.randn(2, *SPEC.block_shape).to(SPEC.torch_dtype)
        s.put("a", SPEC, keys, kv)
        assert _tiers_ordered(s, keys) == [Tier.HBM, Tier.DRAM]
        want = kv[1].contiguous().view(torch.uint8).flatten().numpy()
        if how == "get":
            out = s.get("a", SPEC, keys[1:], parent=keys[0])
            assert out.shape[0] == 1
            got = out[0].contiguous().view(torch.uint8).flatten().cpu().numpy()
        elif how == "get_into":
            buf = np.empty(N, np.uint8)
            assert s.get_into("a", SPEC, keys[1:], [buf], parent=keys[0]) == 1
            got = buf
        else:
            with s.lease_prefix("a", SPEC, keys[1:], lambda i: np.empty(N, np.uint8),
                                parent=keys[0]) as lease:
                assert len(lease.views) == 1
                got = np.array(lease.views[0], copy=True)
        assert np.array_equal(got, want)  # served (from DRAM: no room above its parent)
        assert _tiers_ordered(s, keys) == [Tier.HBM, Tier.DRAM]
        assert s.lookup("a", SPEC, keys).tiers == ["hbm", "dram"]
    finally:
        s.close()



@pytest.mark.parametrize("how", ["close_session", "end_session"])
def test_quota_lowered_under_pins_applies_once_session_ends(tmp_path: Path, how: str) -> None:
    s = Store.open(StoreConfig(path=tmp_path, hbm_bytes=3 * N, dram_bytes=1 * N, nvme_bytes=6 * N,
                               master_key=bytes(range(32)), policy="lru"))
    try:
        s.open_session("b", "s1")
        keys = s.block_keys("b", SPEC, list(range(6)))
        s.put("b", SPEC, keys, torch.zeros(3, *SPEC.block_shape, dtype=SPEC.torch_dtype), session="s1")
        s.set_tenant_policy("b", quota_bytes={"hbm": N})
        assert s.stats()["tenants"]["b"]["hbm"] == 3 * N  # pinned: kept, as documented
        getattr(s, how)("b", "s1")
        assert s.stats()["tenants"]["b"]["hbm"] <= N
        # demoted, not lost: the whole chain is still there, in tier order
        assert len(s.lookup("b", SPEC, keys).tiers) == 3
        assert all(a <= b for a, b in pairwise(s._index.get("b", k).tier for k in keys))
    finally:
        s.close()


def test_quota_applies_after_pause(tmp_path: Path) -> None:
    """Pause parks the blocks in DRAM; what its DRAM quota left in HBM was over the HBM quota."""
    s = Store.open(StoreConfig(path=tmp_path, hbm_bytes=3 * N, dram_bytes=4 * N, nvme_bytes=6 * N,
                               master_key=bytes(range(32)), policy="lru"))
    try:
        s.open_session("b", "s1")
        keys = s.block_keys("b", SPEC, list(range(6)))
        s.put("b", SPEC, keys, torch.zeros(3, *SPEC.block_shape, dtype=SPEC.torch_dtype), session="s1")
        s.set_tenant_policy("b", quota_bytes={"hbm": N, "dram": N})
        s.pause_session("b", "s1")
        held = s.stats()["tenants"]["b"]
        assert held.get("hbm", 0) <= N and held.get("dram", 0) <= N, held
        assert len(s.lookup("b", SPEC, keys).tiers) == 3  # kept: pushed down to NVMe
        assert all(a <= b for a, b in pairwise(s._index.get("b", k).tier for k in keys))
    finally:
        s.close()
