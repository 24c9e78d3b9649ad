"""AMD's fp8 formats (``float8_e4m3fnuz``, ``float8_e5m2fnuz``: vLLM's "fp8" KV cache on MI300)
are dtypes of their own: the same byte is another number than in e4m3fn/e5m2, so a spec of
either must neither share a fingerprint (and so keys) with the OCP format nor be refused."""

from __future__ import annotations

import pytest
import torch

from kvstore.spec import ModelSpec
from tests.conftest import tokens

FORMATS = [("float8_e4m3fn", "float8_e4m3fnuz"), ("float8_e5m2", "float8_e5m2fnuz")]


def _spec(dtype: str) -> ModelSpec:
    return ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype,
                     block_tokens=4)


@pytest.mark.parametrize(("ocp", "fnuz"), FORMATS)
def test_fnuz_is_its_own_dtype(ocp, fnuz):
    a, b = _spec(ocp), _spec(fnuz)
    assert b.torch_dtype == getattr(torch, fnuz) and b.itemsize == 1
    assert a.fingerprint != b.fingerprint
    # one value, two encodings: why they must not share a key
    one = torch.ones(1)
    assert one.to(a.torch_dtype).view(torch.uint8).item() != one.to(b.torch_dtype).view(torch.uint8).item()


@pytest.mark.parametrize(("ocp", "fnuz"), FORMATS)
def test_fnuz_blocks_round_trip_through_nvme_and_never_serve_the_ocp_key(open_store, tmp_path, ocp, fnuz):
    a, b = _spec(ocp), _spec(fnuz)
    store = open_store(b, hbm_blocks=2, dram_blocks=2, nvme_blocks=32)
    toks = tokens(3, b)
    kb = store.block_keys("t", b, toks)
    ka = store.block_keys("t", a, toks)
    assert set(ka).isdisjoint(kb)
    raw = torch.randint(0, 256, (3, *b.block_shape), dtype=torch.uint8)
    raw[raw == 0x80] = 0  # fnuz's NaN byte: compare bytes, not values
    kv = raw.view(b.torch_dtype)
    store.put("t", b, kb, kv)
    assert store.flush() >= 0
    store.close()
    reopened = open_store(b, hbm_blocks=2, dram_blocks=2, nvme_blocks=32, path=tmp_path / "store")
    got = reopened.get("t", b, kb)
    assert got.shape[0] == 3 and torch.equal(got.view(torch.uint8), raw)
    assert reopened.lookup("t", a, ka).num_blocks == 0
