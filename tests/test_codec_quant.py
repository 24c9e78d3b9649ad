"""Codec quantization: round trips within kernels.quant's bounds, the format in the
authenticated header, fallbacks to lossless, and lossless (quant=None) still bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.checksum import checksum
from kernels.quant import QuantScheme, error_bound, quantize
from kvstore.codec import Codec, CodecConfig, parse_header
from kvstore.errors import (
    IntegrityError,
    InvalidArgument,
    KeyUnavailable,
    ShapeMismatch,
)
from kvstore.keyring import Keyring
from kvstore.quantization import Quantization
from kvstore.spec import ModelSpec

MASTER = b"\x07" * 32
KEY_A, KEY_B = b"\xaa" * 32, b"\xbb" * 32
QUANT_BYTE = 7  # offset of the quantization id in the fixed header
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
FORMATS = [Quantization(s, g) for s in QuantScheme for g in ("channel", "head")]  # type: ignore[arg-type]


def _spec(dtype: str = "float16", layers: int = 2, heads: int = 2, head_dim: int = 32,
          tokens: int = 16, revision: str = "r1") -> ModelSpec:
    return ModelSpec(model="m", revision=revision, num_layers=layers, num_kv_heads=heads,
                     head_dim=head_dim, dtype=dtype, block_tokens=tokens)


def _kv(spec: ModelSpec, seed: int = 0, outlier: float = 0.0) -> torch.Tensor:
    """A KV-like block: normal values, optionally one key channel scaled up (RoPE-like outlier)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.block_shape, generator=g)
    if outlier:
        x[0, :, :, :, 0] *= outlier
    return x.to(spec.torch_dtype)


def _bytes(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.uint8).reshape(-1).numpy().copy()


def _as_block(raw: np.ndarray, spec: ModelSpec) -> torch.Tensor:
    return torch.from_numpy(raw).view(spec.torch_dtype).reshape(spec.block_shape)


def _assert_within_bound(x: torch.Tensor, raw: np.ndarray, spec: ModelSpec, q: Quantization) -> None:
    y = _as_block(raw, spec)
    bound = error_bound(x, quantize(x, q.scheme, q.key_granularity), spec.torch_dtype)
    err = (y.to(torch.float32) - x.to(torch.float32)).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


def _codec(encrypt: bool = True, **kw: object) -> Codec:
    cfg = CodecConfig(encrypt=encrypt, chunk_bytes=kw.pop("chunk_bytes", 4096), **kw)  # type: ignore[arg-type]
    return Codec(cfg, Keyring(MASTER, {}) if encrypt else None)


# -- round trips ------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    fmt=st.sampled_from(FORMATS),
    layers=st.integers(1, 3), heads=st.integers(1, 3), head_dim=st.sampled_from([8, 64]),
    tokens=st.sampled_from([4, 16]), encrypt=st.booleans(), level=st.sampled_from([0, 1]),
    chunk=st.sampled_from([4096, 1 << 20]), threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 1000), outlier=st.sampled_from([0.0, 30.0]),
)
def test_codec_quant_round_trip_within_documented_bound(
        dtype: str, fmt: Quantization, layers: int, heads: int, head_dim: int, tokens: int,
        encrypt: bool, level: int, chunk: int, threads: int, seed: int, outlier: float) -> None:
    spec = _spec(dtype, layers, heads, head_dim, tokens)
    x = _kv(spec, seed, outlier)
    with _codec(encrypt, compression_level=level, chunk_bytes=chunk, threads=threads) as codec:
        value = codec.encode("t", KEY_A, spec, _bytes(x), quant=fmt)
        info = parse_header(value)
        assert info.quant == fmt and info.raw_nbytes == fmt.payload_nbytes(spec)
        assert len(value) <= codec.max_encoded_nbytes(spec)
        out = np.empty(spec.block_nbytes, np.uint8)
        assert codec.decode("t", KEY_A, spec, bytes(value), out=out) is out
        _assert_within_bound(x, out, spec, fmt)
        buf = bytearray(codec.max_encoded_nbytes(spec))
        n = codec.encode_into("t", KEY_A, spec, x, buf, quant=fmt)  # a CPU tensor works too
        _assert_within_bound(x, codec.decode("t", KEY_A, spec, memoryview(buf)[:n]), spec, fmt)


def test_codec_quant_bare_scheme_means_per_channel_keys_and_values_shrink() -> None:
    spec = _spec("float16", layers=4, heads=4, head_dim=64)
    x = _kv(spec, outlier=20.0)
    with _codec(compression_level=0) as codec:
        lossless = codec.encode("t", KEY_A, spec, _bytes(x))
        for scheme in QuantScheme:
            value = codec.encode("t", KEY_A, spec, _bytes(x), quant=scheme)
            assert parse_header(value).quant == Quantization(scheme, "channel")
            # 1 byte per element + scales: 4*L*H*(D+1) bytes (~1/T of the fp16 block)
            stored = sum(n for n, _, _ in parse_header(value).chunks)
            assert stored == Quantization(scheme).payload_nbytes(spec) == spec.block_nbytes // 2 + 4 * 4 * 4 * 65
            assert len(value) < 0.6 * len(lossless)


def test_codec_quant_none_stays_bit_exact_and_marks_the_header_lossless() -> None:
    for dtype in ("float16", "bfloat16", "float32", "float8"):
        spec = _spec(dtype)
        raw = np.random.default_rng(1).integers(0, 256, spec.block_nbytes, dtype=np.uint8)
        for level in (0, 1):
            with _codec(compression_level=level) as codec:
                value = codec.encode("t", KEY_A, spec, raw, quant=None)
                assert parse_header(value).quantization == 0 and parse_header(value).quant is None
                assert np.array_equal(codec.decode("t", KEY_A, spec, value), raw)


def test_codec_quant_from_a_torch_tensor_matches_numpy_input() -> None:
    spec = _spec("bfloat16")
    x = _kv(spec, seed=4)
    with _codec(encrypt=False) as codec:
        a = codec.decode("t", KEY_A, spec, codec.encode("t", KEY_A, spec, x, quant=QuantScheme.INT8))
        b = codec.decode("t", KEY_A, spec, codec.encode("t", KEY_A, spec, _bytes(x), quant=QuantScheme.INT8))
        assert np.array_equal(a, b)
        lossless = codec.decode("t", KEY_A, spec, codec.encode("t", KEY_A, spec, x))
        assert np.array_equal(lossless, _bytes(x))


# -- fallbacks and misuse -----------------------------------------------------------------------
def test_codec_quant_block_with_inf_or_nan_is_stored_lossless() -> None:
    spec = _spec("float16")
    x = _kv(spec)
    x[1, 0, 0, 0, 0] = float("nan")
    x[0, 1, 1, 2, 3] = float("inf")
    with _codec() as codec:
        value = codec.encode("t", KEY_A, spec, _bytes(x), quant=QuantScheme.FP8_E4M3)
        assert parse_header(value).quant is None
        assert np.array_equal(codec.decode("t", KEY_A, spec, value), _bytes(x))


def test_codec_quant_tiny_block_whose_scales_outweigh_the_saving_is_stored_lossless() -> None:
    spec = _spec("float16", tokens=1)  # payload 2*L*H*D + 4*L*H*(D+1) > 4*L*H*D bytes
    x = _kv(spec)
    with _codec() as codec:
        value = codec.encode("t", KEY_A, spec, _bytes(x), quant=QuantScheme.INT8)
        assert parse_header(value).quant is None
        assert len(value) <= codec.max_encoded_nbytes(spec)
        assert np.array_equal(codec.decode("t", KEY_A, spec, value), _bytes(x))


def test_codec_quant_rejects_one_byte_specs_and_untyped_schemes() -> None:
    spec8 = _spec("float8")
    with _codec() as codec:
        with pytest.raises(InvalidArgument, match="cannot be quantized"):
            codec.encode("t", KEY_A, spec8, np.zeros(spec8.block_nbytes, np.uint8), quant=QuantScheme.INT8)
        spec = _spec()
        with pytest.raises(InvalidArgument, match="quant must be"):
            codec.encode("t", KEY_A, spec, _bytes(_kv(spec)), quant="int8")  # type: ignore[arg-type]
        with pytest.raises(ShapeMismatch):
            codec.encode("t", KEY_A, spec, np.zeros(spec.block_nbytes - 2, np.uint8), quant=QuantScheme.INT8)


def test_quantization_names_ids_and_parsing() -> None:
    assert Quantization.parse("none") is None
    assert Quantization.parse("int8") == Quantization(QuantScheme.INT8, "channel")
    assert Quantization.parse("FP8_E4M3/head") == Quantization(QuantScheme.FP8_E4M3, "head")
    assert str(Quantization("int8", "head")) == "int8/head"  # type: ignore[arg-type]
    assert sorted(f.format_id for f in FORMATS) == [1, 2, 3, 4]
    for f in FORMATS:
        assert Quantization.from_format_id(f.format_id) == f
    assert Quantization.from_format_id(0) is None
    for bad in ("int4", "int8/row", "none/head"):
        with pytest.raises(InvalidArgument):
            Quantization.parse(bad)
    with pytest.raises(InvalidArgument):
        Quantization.from_format_id(9)


# -- tampering ----------------------------------------------------------------------------------
def _with_byte(value: bytes, pos: int, byte: int) -> bytes:
    b = bytearray(value)
    b[pos] = byte
    return bytes(b)


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("level", [0, 1])
def test_codec_quant_tampered_format_or_scales_is_an_integrity_error(encrypt: bool, level: int) -> None:
    spec = _spec("bfloat16")
    x = _kv(spec)
    with _codec(encrypt, compression_level=level) as codec:
        fmt = Quantization(QuantScheme.INT8, "channel")
        value = bytes(codec.encode("t", KEY_A, spec, _bytes(x), quant=fmt))
        assert value[QUANT_BYTE] == fmt.format_id
        hn = parse_header(value).header_nbytes
        cases = {
            # same payload size, another format: only the tag / header digest can tell
            "int8 -> fp8 (same size)": _with_byte(value, QUANT_BYTE, 3),
            "channel -> head keys": _with_byte(value, QUANT_BYTE, 2),
            "claims lossless": _with_byte(value, QUANT_BYTE, 0),
            "unknown id": _with_byte(value, QUANT_BYTE, 9),
            "scales (first payload byte)": _with_byte(value, hn, value[hn] ^ 0x10),
        }
        for name, bad in cases.items():
            with pytest.raises(IntegrityError):
                codec.decode("t", KEY_A, spec, bad)
            assert name
        lossless = bytes(codec.encode("t", KEY_A, spec, _bytes(x)))
        with pytest.raises(IntegrityError):  # a lossless value relabelled as quantized
            codec.decode("t", KEY_A, spec, _with_byte(lossless, QUANT_BYTE, fmt.format_id))
        _assert_within_bound(x, codec.decode("t", KEY_A, spec, value), spec, fmt)


def test_codec_quant_forged_header_digest_still_fails_on_length() -> None:
    """Unencrypted: relabel a lossless value as int8 and re-forge the header digest; the raw
    length no longer matches what the format implies, so it is refused before any dequantize."""
    spec = _spec("float16")
    with _codec(encrypt=False, compression_level=0) as codec:
        value = bytearray(codec.encode("t", KEY_A, spec, _bytes(_kv(spec))))
        hn = parse_header(value).header_nbytes
        value[QUANT_BYTE] = 1
        value[hn - 16 : hn] = checksum(bytes(value[: hn - 16]))
        with pytest.raises(IntegrityError, match="holds"):
            codec.decode("t", KEY_A, spec, value)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), encrypt=st.booleans(), level=st.sampled_from([0, 1]),
       fmt=st.sampled_from(FORMATS))
def test_codec_quant_any_single_flipped_bit_is_detected(data: st.DataObject, encrypt: bool,
                                                         level: int, fmt: Quantization) -> None:
    spec = _spec("float16", layers=1, heads=2, head_dim=64)
    with _codec(encrypt, compression_level=level) as codec:
        value = bytearray(codec.encode("t", KEY_A, spec, _bytes(_kv(spec, 3)), quant=fmt))
        pos = data.draw(st.integers(0, len(value) - 1))
        value[pos] ^= 1 << data.draw(st.integers(0, 7))
        with pytest.raises(IntegrityError):
            codec.decode("t", KEY_A, spec, value)


def test_codec_quant_value_is_bound_to_key_tenant_and_spec() -> None:
    spec = _spec()
    keyring = Keyring(MASTER, {})
    with Codec(CodecConfig(chunk_bytes=4096), keyring) as codec:
        value = codec.encode("t", KEY_A, spec, _bytes(_kv(spec)), quant=QuantScheme.FP8_E4M3)
        with pytest.raises(IntegrityError, match="block key"):
            codec.decode("t", KEY_B, spec, value)
        with pytest.raises(IntegrityError, match="tenant"):
            codec.decode("u", KEY_A, spec, value)
        with pytest.raises(IntegrityError, match="fingerprint"):
            codec.decode("t", KEY_A, _spec(revision="r2"), value)
        keyring.destroy("t")
        with pytest.raises(KeyUnavailable):
            codec.decode("t", KEY_A, spec, value)


# -- GPU ------------------------------------------------------------------------------------------
@CUDA
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_codec_quant_cuda_tensor_is_quantized_on_device(fmt: Quantization) -> None:
    spec = _spec("bfloat16", layers=2, heads=4, head_dim=64)
    x = _kv(spec, seed=7, outlier=10.0)
    with _codec() as codec:
        value = codec.encode("t", KEY_A, spec, x.cuda(), quant=fmt)
        assert parse_header(value).quant == fmt
        _assert_within_bound(x, codec.decode("t", KEY_A, spec, value), spec, fmt)
        lossless = codec.encode("t", KEY_A, spec, x.cuda())
        assert np.array_equal(codec.decode("t", KEY_A, spec, lossless), _bytes(x))


def test_a_block_in_read_only_memory_is_quantized_in_place_without_a_warning() -> None:
    """``bytes`` (a received frame, a read-only view) are read where they are: no copy to
    quiet torch's warning about read-only arrays, and the same payload as a writable copy."""
    import warnings

    from kvstore.quantization import block_tensor, pack_payload

    spec = _spec()
    raw = _bytes(_kv(spec, seed=3)).tobytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = block_tensor(raw, spec)
        packed = pack_payload(raw, spec, FORMATS[0])
    assert np.shares_memory(t.view(torch.uint8).reshape(-1).numpy(), np.frombuffer(raw, dtype=np.uint8))
    assert packed is not None
    assert np.array_equal(packed, pack_payload(bytearray(raw), spec, FORMATS[0]))
