"""Read paths and the tier order (prober round 16). Each test failed on the code before.

A. ``get(keys, parent=P)`` and ``lease_prefix(keys, parent=P)`` protected only the keys' blocks:
   promoting the first of them into HBM evicted ``P`` (a leaf in HBM, its only child below) to
   make room, and the block then sat in HBM under a parent in DRAM (lookups of the chain
   stopped at ``P``). The parent's lineage is held now, as ``Placement.promote`` holds it.
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

