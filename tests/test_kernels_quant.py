"""kernels.quant: FP8/INT8 KV quantization round trips stay within the documented bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.quant import QuantizedKV, QuantScheme, dequantize, error_bound, quantize
from kvstore.errors import DTypeMismatch, InvalidArgument, ShapeMismatch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA not available"))]  # fmt: skip
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def kv_block(shape, dtype, seed=0, device="cpu", outlier_channel=True):
    """A KV-like block: gaussian values, keys with one large outlier channel per head."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if outlier_channel:
        x[..., 0, :, :, :, 3 % shape[-1]] *= 20.0  # keys only
    return x.to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", list(QuantScheme))
@pytest.mark.parametrize("granularity", ["channel", "head"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quant_roundtrip_within_documented_bound(device, scheme, granularity, dtype):
    x = kv_block((3, 2, 4, 2, 16, 8), dtype, device=device)
    q = quantize(x, scheme, granularity)
    assert q.data.dtype == scheme.storage_dtype and q.data.shape == x.shape
    out = dequantize(q)
    assert out.dtype == dtype and out.shape == x.shape and out.device == x.device
    err = (out.float() - x.float()).abs()
    assert bool((err <= error_bound(x, q)).all())


@pytest.mark.parametrize("scheme", list(QuantScheme))
def test_quant_scale_shapes_per_block_per_head_and_channel(scheme):
    x = kv_block((5, 2, 3, 4, 16, 8), torch.float16)
    q = quantize(x, scheme, "channel")
    assert q.k_scale.shape == (5, 3, 4, 1, 8) and q.v_scale.shape == (5, 3, 4, 1, 1)
    assert q.k_scale.dtype == torch.float32
    h = quantize(x, scheme, "head")
    assert h.k_scale.shape == (5, 3, 4, 1, 1)
    # scale = amax / qmax for each group
    amax_v = x[:, 1].float().abs().amax(dim=(-2, -1), keepdim=True)
    torch.testing.assert_close(q.v_scale, amax_v / scheme.qmax)


def test_quant_int8_error_at_most_half_step_of_group_amax():
    x = kv_block((2, 2, 2, 16, 64), torch.float32, outlier_channel=False)
    q = quantize(x, QuantScheme.INT8, "head")
    err = (dequantize(q) - x).abs()
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    assert bool((err <= amax / 254 * (1 + 1e-5)).all())
    assert float(err.max()) > 0  # it is lossy, and the check above is not vacuous


def test_quant_fp8_relative_error_at_most_one_sixteenth_for_normal_values():
    x = kv_block((2, 2, 2, 16, 64), torch.float32, outlier_channel=False)
    q = quantize(x, QuantScheme.FP8_E4M3, "head")
    err = (dequantize(q) - x).abs()
    scale = torch.stack([q.k_scale.expand_as(x[0]), q.v_scale.expand_as(x[1])])
    normal = x.abs() >= scale * 2.0**-6
    assert bool((err[normal] <= x.abs()[normal] * 2.0**-4 * (1 + 1e-5)).all())


def test_quant_per_channel_keys_beat_per_head_with_an_outlier_channel():
    x = kv_block((4, 2, 2, 2, 16, 64), torch.float32, outlier_channel=True)
    keys = x[:, 0]
    errs = {}
    for granularity in ("channel", "head"):
        out = dequantize(quantize(x, QuantScheme.INT8, granularity))
        errs[granularity] = float((out[:, 0] - keys).pow(2).mean())
    assert errs["channel"] < errs["head"] / 4


def test_quant_zero_block_roundtrips_to_zero_with_unit_scale():
    x = torch.zeros(2, 2, 1, 16, 4, dtype=torch.bfloat16)
    for scheme in QuantScheme:
        q = quantize(x, scheme)
        assert bool((q.k_scale == 1).all()) and bool((q.v_scale == 1).all())
        assert torch.equal(dequantize(q), x)


def test_quant_scales_bytes_roundtrip_rebuilds_the_same_block():
    x = kv_block((2, 3, 2, 16, 8), torch.bfloat16)
    for scheme in QuantScheme:
        for granularity in ("channel", "head"):
            q = quantize(x, scheme, granularity)
            blob = q.scales_bytes()
            assert len(blob) == 4 * (q.k_scale.numel() + q.v_scale.numel())
            assert q.nbytes == x.numel() + len(blob)
            r = QuantizedKV.from_parts(q.data, blob, scheme.value, granularity, torch.bfloat16)
            assert torch.equal(dequantize(r), dequantize(q))


def test_quant_dequantize_to_another_dtype_and_into_out():
    x = kv_block((2, 2, 2, 16, 8), torch.float32)
    q = quantize(x, QuantScheme.INT8)
    out = torch.empty(x.shape, dtype=torch.float16)
    got = dequantize(q, torch.float16, out=out)
    assert got is out
    assert bool(((got.float() - x).abs() <= error_bound(x, q, torch.float16)).all())
    with pytest.raises(ShapeMismatch):
        dequantize(q, torch.float32, out=out)


def test_quant_rejects_bad_inputs():
    with pytest.raises(ShapeMismatch):
        quantize(torch.zeros(3, 2, 2, 4, 4), QuantScheme.INT8)
    with pytest.raises(ShapeMismatch):
        quantize(torch.zeros(2, 2, 4, 4), QuantScheme.INT8)
    with pytest.raises(DTypeMismatch):
        quantize(torch.zeros(2, 1, 1, 4, 4, dtype=torch.int32), QuantScheme.INT8)
    bad = torch.zeros(2, 1, 1, 4, 4)
    bad[1, 0, 0, 2, 2] = float("nan")
    with pytest.raises(InvalidArgument):
        quantize(bad, QuantScheme.FP8_E4M3)
    with pytest.raises(InvalidArgument):
        quantize(torch.zeros(2, 1, 1, 4, 4), QuantScheme.INT8, "token")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        quantize(torch.zeros(2, 1, 1, 4, 4), "int4")
    q = quantize(torch.ones(2, 1, 1, 4, 4), QuantScheme.INT8)
    with pytest.raises(ShapeMismatch):
        QuantizedKV.from_parts(q.data, q.scales_bytes()[:-4], QuantScheme.INT8, "channel", torch.float16)
    with pytest.raises(DTypeMismatch):
        QuantizedKV.from_parts(q.data, q.scales_bytes(), QuantScheme.FP8_E4M3, "channel", torch.float16)


@settings(max_examples=40, deadline=None)
@given(
    lead=st.integers(0, 2),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    tokens=st.integers(1, 17),
    dim=st.integers(1, 9),
    dtype=st.sampled_from(DTYPES),
    scheme=st.sampled_from(list(QuantScheme)),
    granularity=st.sampled_from(["channel", "head"]),
    magnitude=st.sampled_from([1e-4, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_quant_roundtrip_property(lead, layers, heads, tokens, dim, dtype, scheme, granularity,
                                  magnitude, seed):
    shape = (2,) * lead + (2, layers, heads, tokens, dim)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * magnitude).to(dtype)
    q = quantize(x, scheme, granularity)
    out = dequantize(q)
    assert out.dtype == dtype
    assert bool(((out.float() - x.float()).abs() <= error_bound(x, q)).all())
    # quantizing a dequantized block again is stable: the scales cannot grow
    q2 = quantize(out, scheme, granularity)
    assert bool((q2.k_scale <= q.k_scale * (1 + 2**-6)).all())
