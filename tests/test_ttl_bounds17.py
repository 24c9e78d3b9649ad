"""A TTL past MAX_TTL_S (about 31 years) is refused wherever a TTL is taken: any finite TTL was,
and 1e306 s overflowed the remote tier's milliseconds (an OverflowError out of a policy set,
half applied) while 1e20 s was refused by Redis, after which the tenant's remote writes failed."""

from __future__ import annotations

import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument
from kvstore.expiry import MAX_TTL_S, check_ttl
from kvstore.spec import ModelSpec
from kvstore.store import Store

SPEC = ModelSpec(model="m", revision="r", num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4, dtype="float16")


@pytest.mark.parametrize("ttl", [1e20, 1e306, MAX_TTL_S * 1.0001, float("nan"), float("inf"), 0.0, -1.0])
def test_a_ttl_out_of_range_is_refused_naming_the_bound(ttl):
    with pytest.raises(InvalidArgument, match="at most"):
        check_ttl(ttl)


def test_the_longest_ttl_is_taken():
    assert check_ttl(MAX_TTL_S) == MAX_TTL_S


def test_the_store_refuses_a_huge_ttl_before_changing_anything(tmp_path):
    with Store.open(StoreConfig(path=tmp_path, hbm_bytes=1 << 20, dram_bytes=0, nvme_bytes=1 << 20)) as store:
        keys = store.block_keys("t", SPEC, list(range(8)))
        store.put("t", SPEC, keys, torch.zeros((2, *SPEC.block_shape), dtype=torch.float16))
        with pytest.raises(InvalidArgument, match="at most"):
            store.set_tenant_policy("t", ttl_s=1e306)
        with pytest.raises(InvalidArgument, match="at most"):
            store.put("t", SPEC, store.block_keys("t", SPEC, list(range(100, 108))),
                      torch.zeros((2, *SPEC.block_shape), dtype=torch.float16), ttl_s=1e20)
        assert store.lookup("t", SPEC, keys).num_blocks == 2
