"""Bad input to the HF and SGLang adapters: typed errors, never another prompt's KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgument
from kvstore.integrations.hf import _token_list
from kvstore.spec import ModelSpec

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)


@pytest.mark.parametrize("ids", [
    [1, 2, 3], [[1, 2, 3]], np.array([[1, 2, 3]]), torch.tensor([[1, 2, 3]]), torch.tensor([1, 2, 3]),
])
def test_one_sequence_or_a_batch_of_one(ids):
    assert _token_list(ids) == [1, 2, 3]


@pytest.mark.parametrize("ids", [
    torch.tensor([1.5, 2.5]),  # truncated by int(): another prompt's KV
    ["1", "2"],  # parsed by int()
    [[1, 2], [3, 4]],  # a batch of two
    torch.zeros(1, 1, 4, dtype=torch.long),  # 3-D
    [[1, 2], [3]],  # ragged
    [-1, 2],
])
def test_token_ids_that_are_not_integer_ids_are_refused(ids):
    with pytest.raises(InvalidArgument):
        _token_list(ids)


def test_save_without_a_cache_object_is_refused(tmp_path):
    from conftest import MASTER

    from kvstore.config import StoreConfig
    from kvstore.integrations.hf import PrefixCache, TenantStore
    from kvstore.store import Store

    with Store.open(StoreConfig(path=tmp_path / "s", hbm_bytes=1 << 20, dram_bytes=0, nvme_bytes=0,
                                master_key=MASTER)) as store:
        pc = PrefixCache(TenantStore(store, "a"), SPEC)
        with pytest.raises(InvalidArgument, match="Cache"):  # an AttributeError before
            pc.save(list(range(8)), None)


@pytest.mark.parametrize("key", [b"abc", None, 7])
def test_an_sglang_page_key_must_be_a_str(key):
    from kvstore.integrations.sglang import page_key

    with pytest.raises(InvalidArgument, match="page key"):
        page_key(SPEC, key)
    assert page_key(SPEC, "abc") == page_key(SPEC, "abc")
