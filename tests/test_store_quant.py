"""Opt-in quantization of blocks written to NVMe, per tenant and per model."""

import pytest
import torch
from conftest import make_kv, tokens

from kernels.quant import QuantScheme, error_bound, quantize
from kvstore.errors import InvalidArgument


def _nvme_only(open_store, spec, **kw):
    return open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16, **kw)


def test_int8_tenant_within_bounds_lossless_tenant_bit_exact(open_store, spec):
    s = _nvme_only(open_store, spec)
    s.set_tenant_policy("lossy", quantization="int8")
    kv = make_kv(spec, 3)
    for tenant in ("lossy", "exact"):
        keys = s.block_keys(tenant, spec, tokens(3, spec))
        s.put(tenant, spec, keys, kv)
    exact = s.get("exact", spec, s.block_keys("exact", spec, tokens(3, spec)))
    assert torch.equal(exact, kv)
    lossy = s.get("lossy", spec, s.block_keys("lossy", spec, tokens(3, spec)))
    assert lossy.shape == kv.shape and not torch.equal(lossy, kv)
    bound = error_bound(kv.float(), quantize(kv.float(), QuantScheme.INT8))
    # dequantized to fp16: allow the fp16 rounding on top of the documented bound
    assert torch.all((lossy.float() - kv.float()).abs() <= bound + kv.float().abs() * 2**-10 + 1e-6)


def test_bad_quantization_names_are_refused(tmp_path, spec):
    from pydantic import ValidationError

    from kvstore.config import StoreConfig
    with pytest.raises(ValidationError):
        StoreConfig(path=tmp_path, nvme_quantization="int4")


def test_model_default_and_overrides(open_store, spec):
    s = _nvme_only(open_store, spec, nvme_quantization="fp8_e4m3/head")
    kv = make_kv(spec, 2)
    s.set_model_quantization(spec.fingerprint, "none")  # the model rule beats the default
    keys = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, keys, kv)
    assert torch.equal(s.get("a", spec, keys), kv)
    s.set_model_quantization(spec.fingerprint, None)  # back to the store default: fp8
    keys_b = s.block_keys("b", spec, tokens(2, spec))
    s.put("b", spec, keys_b, kv)
    assert not torch.equal(s.get("b", spec, keys_b), kv)
    with pytest.raises(InvalidArgument):
        s.set_tenant_policy("a", quantization="int3")
