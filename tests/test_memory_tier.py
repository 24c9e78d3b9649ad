"""MemoryTier.put: every accepted buffer kind lands bit-exact, and a failed copy leaves no slot
behind (capacity and block count as before)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.block import Tier
from kvstore.spec import ModelSpec
from tiers.base import BlockRef
from tiers.memory import MemoryTier

SPEC = ModelSpec(model="m", revision="r", num_layers=1, num_kv_heads=1, head_dim=64,
                 dtype="float16", block_tokens=4)


def _ref(i: int) -> BlockRef:
    return BlockRef("t", bytes([i]) * 32, SPEC)


def _bytes(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SPEC.block_nbytes, dtype=np.uint8)


@pytest.mark.parametrize("kind", ["numpy_row", "numpy_strided_parent", "torch", "bytes",
                                  "torch_fp16"])
def test_put_then_get_is_bit_exact(kind):
    tier = MemoryTier(Tier.DRAM, 4 * SPEC.block_nbytes)
    want = _bytes(1)
    data = {"numpy_row": np.stack([want, want])[1],
            "numpy_strided_parent": np.ascontiguousarray(want),
            "torch": torch.from_numpy(want.copy()),
            "bytes": want.tobytes(),
            "torch_fp16": torch.from_numpy(want.copy()).view(torch.float16)}[kind]
    assert tier.put(_ref(0), data)
    out = np.empty(SPEC.block_nbytes, np.uint8)
    assert tier.get_into(_ref(0), out)
    assert np.array_equal(out, want)
    assert tier.usage().blocks == 1


def test_a_failed_copy_leaves_no_slot_behind():
    tier = MemoryTier(Tier.DRAM, 2 * SPEC.block_nbytes)
    before = tier.usage()
    with pytest.raises(ValueError):
        tier.put(_ref(0), np.zeros(SPEC.block_nbytes - 2, np.uint8))  # wrong length
    assert tier.usage() == before and not tier.contains(_ref(0))
    assert tier.put(_ref(0), _bytes(2)) and tier.put(_ref(1), _bytes(3))  # full room is back


def test_put_refuses_when_full_and_frees_on_delete():
    tier = MemoryTier(Tier.DRAM, SPEC.block_nbytes)
    assert tier.put(_ref(0), _bytes(4))
    assert not tier.put(_ref(1), _bytes(5))
    assert tier.used_bytes == tier.usage().used_bytes == SPEC.block_nbytes
    assert tier.delete(_ref(0)) and tier.used_bytes == 0
    assert tier.put(_ref(1), _bytes(5))
