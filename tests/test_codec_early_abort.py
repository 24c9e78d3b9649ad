"""Codec early abort (CodecConfig.min_compress_ratio): a block compresses only when a sample of
it shrinks enough; the choice is in the authenticated header, decode needs no config, and
values written before the early abort existed still decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.codec import Codec, CodecConfig, parse_header
from kvstore.codec_format import (
    COMPRESSION_NONE,
    COMPRESSION_ZSTD_ALL,
    COMPRESSION_ZSTD_TOP,
)
from kvstore.config import StoreConfig
from kvstore.errors import IntegrityError, InvalidArgument
from kvstore.keyring import Keyring
from kvstore.spec import ModelSpec

MASTER = b"\x07" * 32
KEY_A = b"\xaa" * 32
COMP_BYTE = 6  # offset of the compression id in the fixed header


def _spec(dtype: str = "float16", layers: int = 2, heads: int = 2, head_dim: int = 64,
          tokens: int = 16) -> ModelSpec:
    return ModelSpec(model="m", revision="r1", num_layers=layers, num_kv_heads=heads,
                     head_dim=head_dim, dtype=dtype, block_tokens=tokens)


def _block(spec: ModelSpec, kind: str, seed: int = 0) -> np.ndarray:
    """Block bytes of a kind: KV-like normal values, random bytes, zeros, or half of each."""
    n = spec.block_nbytes
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if kind == "zeros":
        return np.zeros(n, np.uint8)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(spec.block_shape, generator=gen).to(spec.torch_dtype)
    out = kv.contiguous().view(torch.uint8).reshape(-1).numpy().copy()
    if kind == "half":  # compressible first half, random second half
        out[n // 2 :] = rng.integers(0, 256, n - n // 2, dtype=np.uint8)
    return out


def _codec(encrypt: bool = True, keyring: Keyring | None = None, **kw: object) -> Codec:
    cfg = CodecConfig(encrypt=encrypt, **kw)  # type: ignore[arg-type]
    return Codec(cfg, (keyring or Keyring(MASTER, {})) if encrypt else None)


# -- the decision -----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "float8"]),
    layers=st.integers(1, 4), tokens=st.sampled_from([1, 5, 16, 64]),
    kind=st.sampled_from(["normal", "random", "zeros", "half"]),
    ratio=st.sampled_from([1.0, 1.05, 1.2, 1.3, 1.5, 2.0, 64.0]),
    encrypt=st.booleans(), level=st.sampled_from([1, 3]), planes=st.sampled_from(["top", "all"]),
    chunk=st.sampled_from([4096, 16384, 1 << 20]), threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 1000),
)
def test_any_block_round_trips_bit_exact_whatever_the_decision(
        dtype: str, layers: int, tokens: int, kind: str, ratio: float, encrypt: bool, level: int,
        planes: str, chunk: int, threads: int, seed: int) -> None:
    spec = _spec(dtype, layers=layers, tokens=tokens)
    data = _block(spec, kind, seed)
    keyring = Keyring(MASTER, {})
    with _codec(encrypt, keyring, compression_level=level, chunk_bytes=chunk, threads=threads,
                compress_planes=planes, min_compress_ratio=ratio) as codec:
        value = codec.encode("t", KEY_A, spec, data)
        assert len(value) <= codec.max_encoded_nbytes(spec)
        info = parse_header(value)
        want = COMPRESSION_ZSTD_TOP if planes == "top" else COMPRESSION_ZSTD_ALL
        assert info.compression in (COMPRESSION_NONE, want)
        if info.compression == COMPRESSION_NONE:  # aborted: stored as with compression off
            assert ratio > 1.0
            assert all(flags == 0 for _, flags, _ in info.chunks)
        if ratio == 1.0:
            assert info.compression == want  # no sample: the old behaviour
        if kind == "zeros" and ratio <= 1.2:  # (fp32 "top": at most 4/3 when plane 3 vanishes)
            assert info.compression == want
        # decoding needs no config: a codec with another threshold (and level 0) reads it
        with _codec(encrypt, keyring, compression_level=0, chunk_bytes=4096) as reader:
            assert np.array_equal(reader.decode("t", KEY_A, spec, bytes(value)), data)


def test_kv_is_stored_raw_and_sparse_blocks_compressed_by_default() -> None:
    assert CodecConfig().min_compress_ratio > 1.0
    fp16, bf16 = _spec("float16", layers=8), _spec("bfloat16", layers=8)
    sparse = _block(bf16, "normal")
    sparse[: bf16.block_nbytes * 3 // 4] = 0  # zero padding: the top plane shrinks ~4x
    with _codec() as codec:
        v16 = codec.encode("t", KEY_A, fp16, _block(fp16, "normal"))
        vbf = codec.encode("t", KEY_A, bf16, _block(bf16, "normal"))
        vsp = codec.encode("t", KEY_A, bf16, sparse)
    for v, spec in ((v16, fp16), (vbf, bf16)):  # ~1.18x and ~1.49x: not worth zstd
        assert parse_header(v).compression == COMPRESSION_NONE
        assert len(v) > spec.block_nbytes
    assert parse_header(vsp).compression == COMPRESSION_ZSTD_TOP
    assert len(vsp) < 0.7 * bf16.block_nbytes
    with _codec(min_compress_ratio=1.0) as always:  # the threshold off: KV compresses again
        v = always.encode("t", KEY_A, fp16, _block(fp16, "normal"))
        w = always.encode("t", KEY_A, bf16, _block(bf16, "normal"))
    assert parse_header(v).compression == parse_header(w).compression == COMPRESSION_ZSTD_TOP
    assert len(v) < 0.9 * fp16.block_nbytes and len(w) < 0.75 * bf16.block_nbytes


def test_block_compressible_in_one_region_only_is_judged_on_all_of_it() -> None:
    """The sample spans the block: zeros at the end are seen although the start is random."""
    spec = _spec("bfloat16", layers=8)
    data = _block(spec, "random")
    data[spec.block_nbytes // 4 :] = 0  # three quarters zeros: ~4x overall
    with _codec(min_compress_ratio=2.0, compress_planes="all") as codec:
        value = codec.encode("t", KEY_A, spec, data)
        assert parse_header(value).compression == COMPRESSION_ZSTD_ALL
        assert len(value) < spec.block_nbytes / 3
        assert np.array_equal(codec.decode("t", KEY_A, spec, value), data)


def test_small_raw_values_are_one_chunk_and_large_ones_still_split() -> None:
    """A raw value of at most INLINE_RAW_BYTES is one chunk (done on the calling thread); a
    larger one is still cut so every codec thread gets work."""
    small, large = _spec("float16", layers=32, heads=8, head_dim=128), _spec(
        "float16", layers=32, heads=8, head_dim=128, tokens=64)  # 2 MiB and 8 MiB
    with _codec(compression_level=0, threads=2) as codec:
        for spec, chunks in ((small, 1), (large, 2)):
            data = _block(spec, "random")
            value = codec.encode("t", KEY_A, spec, data)
            assert len(parse_header(value).chunks) == chunks
            assert np.array_equal(codec.decode("t", KEY_A, spec, value), data)


# -- tampering with the choice ----------------------------------------------------------------
@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("ratio", [1.0, 1.5])
def test_flipped_compression_choice_fails_authentication(encrypt: bool, ratio: float) -> None:
    spec = _spec("bfloat16", layers=4)
    with _codec(encrypt, min_compress_ratio=ratio) as codec:
        value = bytearray(codec.encode("t", KEY_A, spec, _block(spec, "normal")))
        stored = value[COMP_BYTE]
        assert stored == (COMPRESSION_ZSTD_TOP if ratio == 1.0 else COMPRESSION_NONE)
        for forged in {COMPRESSION_NONE, COMPRESSION_ZSTD_ALL, COMPRESSION_ZSTD_TOP} - {stored}:
            value[COMP_BYTE] = forged
            with pytest.raises(IntegrityError):
                codec.decode("t", KEY_A, spec, value)
        value[COMP_BYTE] = COMPRESSION_ZSTD_TOP if stored == COMPRESSION_NONE else COMPRESSION_NONE
        if stored == COMPRESSION_NONE:  # a well-formed header: only the tag / digest can tell
            if encrypt:
                parse_header(value)  # (parse_header checks the digest of unencrypted values)
            with pytest.raises(IntegrityError, match="authentication" if encrypt else "header checksum"):
                codec.decode("t", KEY_A, spec, value)


# -- backward compatibility: values written before the early abort existed --------------------
GOLDEN_DATA = bytes.fromhex(
    "d0a3af9fb29e1fa41a943d9e04a11fa44b9f381af69f26998d985224ae18ca1c239ff1a12a1f14186f200119"
    "ca9e2220a4213597c0a568a30311539e16a06495d024e9917616ec9f14187d0f4416df9c8c94ff197796b78c"
    "092650a10824739ec0a0951d6e117a9ccf1f851cf7212925a115ce209e979a9ee22374a044a8a99f2e8c3da1"
    "1b9e26a15098f2844924c706359f97971aa142a0b99cbc9d0d1c07a1309d1614b29e7e1f58a3219d08178e96"
    "3719249d55a1801f5ea1d29cf6191925c61e18222e20ada018232ba0c0a0b121d622301e3d94329662a5599e"
    "92a3cea17920bd9d95222f203418401a7c1d6a9c8d26c7986a88c32412a59b242c14f71a4b1f8ca43f1b2422"
    "359a83a4801e1ea020a4cba4901dc41ee025e91e632498a4fba209a1bd23931ed81c649ca51deca34e1d5d14"
    "8419c8227824c0243c9f8c26471c5b984da04d9c649e01a17b200e21571ac9232c22a6a4229ce9a06a837692"
    "5220f821651d2524f0a0cc15b496569b6924389ae418e2223a14a221ff9ada20d29d4a2091240198461dbba4"
    "78a7cf9d8b9d952085a0721deaa31997751fad10a3205b21559df022d118e724b424c822f6a069223222689d"
    "7a18e29d7623892439246c9c8d995ea363228622011cee1b8a92001bdc2016a36a240ea6c2a0031a6818ce20"
    "8123b39da19f2498b498df00b01bf39ddc9d2b2154940aa27093c41d")

GOLDEN_ENCRYPTED = bytes.fromhex(
    "4b565356010102000207050000100000010000000002000000000000f5bb6afca30af461ec067d3557e67c08"
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa3d44c102ccd44c49aa484cdc"
    "4be8b924666c6f617431360200000001000000010000000400000020000000e6010000018b9299a0a7aeb5bc"
    "c3cad1d85964fb97195d8b3017bbbe710ebd8c4865a19a05a2ce163fb44f861bfaa5f165f6f641f382cd1db6"
    "6138ae73672443762520933312dcf238bb6c9683fe6323ce0510e2e096e8b497277c9ad6e506b0ad4a02e26b"
    "2acf819d25e708d41573e1488e1e429913bb6f5b43e99d03a44c4ff0f93a59cf090ad676dec326e6aa909dfa"
    "db54f38990e17373db7b81a35e5ec1d21e147ebf0815e4e15991c6caf2e3092025045298945b87e8080784f5"
    "350994c2d8baf07b35b5bd0d55b3a72fd527652ce0d51a827640ed2a70e1c73b24faaccc8fca48efefc0df16"
    "e31638855dfb156b3f8f643ba3c9376d97e60956bbc4512d06e0db2c37dd0f1adbbea4e145d1cd053a332003"
    "c5d5266c6a7a65d4b0fd81cb42ad35a4d55c1812b5fa0e3aebc522449f6eb9af477545ce8e62a2aa8bf4bd28"
    "cf7f0b5dec1dc18715d273f58669e21046f2b945e13f40a1ea37d5aa0a5de1f2628d25dfb82705e6e2b4556e"
    "a5d7673818e779f2ccf4c5d9f70116a0d925f6f4e44a1d18fca8b0326c7a757fe9431010a1ba1c72f16da622"
    "21631d750b33f6b38ddf83400e74c46412c4d8f610f270db05b0df26c01c39c9772fa6ee3a64f16fe52f129d"
    "e4c56e5a42fe5484049b5f24b29e2e14a002105567a95a4a69881d7d0c5c1118708964250c01b8de548b5874"
    "903303fc4dcf227e6403fbabd75dae725488de3551dc")

GOLDEN_CHECKSUMMED = bytes.fromhex(
    "4b565356010202000207050000100000010000000002000000000000f5bb6afca30af461ec067d3557e67c08"
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa3d44c102ccd44c49aa484cdc"
    "4be8b924666c6f617431360200000001000000010000000400000020000000e601000001cebc10eb47bd7be4"
    "94f3cd80be2f10667acf88e431aa217df3bc632026bd9b12d0afb21f1a3d041f4b38f6268d52aeca23f12a14"
    "6f01ca22a435c06803531664d0e976ec147d44df8cff77b709500873c0956e7acf85f729a1ce9e9ae27444a9"
    "2e3d1b2650f249c735971a42b9bc0d073016b27e5821088e372455805ed2f619c6182ead182bc0b1d6303d32"
    "625992ce79bd952f34407c6a8dc76ac3129b2cf74b8c3f243583801e20cb90c4e0e96398fb09bd93d864a5ec"
    "4e5d84c878c03c8c475b4d4d64017b0e57c92ca622e96a7652f86525f0ccb4566938e4e23aa2ffdad24a9101"
    "46bb78cf8b958572ea1975ada35b55f0d1e7b4c8f66932687ae27689396c8d5e638601ee8a00dc166a0ec203"
    "68ce81b3a124b4dfb0f3dc2b540a70c428b52ffd600000e506000610362770b56d038a2ffb674ac9c5b7ed46"
    "422f96370000000000c07d4b9d245b64bb49f035b0399d40012d002a002a0031803b305284a2a9e61d9643fe"
    "0503529e9718483191c00b0e0f321235858aa6e6a34aec1c7189f3e1336194014bc21146708bb796a4dbfa12"
    "46a0876d73775c972994f7cdb70215b46c60d2affaf94751800fdcc36704fa68c9a607334008e7d5b461e06f"
    "aeb3347df8dca945645e2559723dc59c874c660ab6e674361fcbcc264b01f2b46e26c0b9d88ea6c51b582ad3"
    "60d4ae743c66a753effa32a7eda6044d24976b3780b91c6b0700")

GOLDEN_WRAPPED_KEY = bytes.fromhex("4b564b31373e454c535a61686f767d84ee408b8ae62c2f66de973f0c87980d5ffa1ec0e59eeff555917552c70a4f2f9468fe4e50ebea8c510cdd938234981cbb")

GOLDEN_SPEC = ModelSpec(model="m", revision="r1", num_layers=1, num_kv_heads=1, head_dim=32,
                        dtype="float16", block_tokens=4)


@pytest.mark.parametrize("ratio", [1.0, 1.5, 64.0])
def test_values_written_by_the_previous_codec_still_decode(ratio: float) -> None:
    """Both were encoded (fp16, zstd 1 on the top plane, chunk flag compressed) by the codec as
    it was before min_compress_ratio; their bytes must keep decoding, whatever the threshold."""
    keyring = Keyring(MASTER, {"t": GOLDEN_WRAPPED_KEY})
    for value, encrypt in ((GOLDEN_ENCRYPTED, True), (GOLDEN_CHECKSUMMED, False)):
        info = parse_header(value)
        assert info.compression == COMPRESSION_ZSTD_TOP and info.chunks[0][1] == 1
        with Codec(CodecConfig(encrypt=encrypt, min_compress_ratio=ratio),
                   keyring if encrypt else None) as codec:
            out = codec.decode("t", KEY_A, GOLDEN_SPEC, value)
        assert out.tobytes() == GOLDEN_DATA


# -- configuration ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0.5, 0.99, 65.0, "1.3", True, float("nan")])
def test_min_compress_ratio_is_validated(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        CodecConfig(min_compress_ratio=bad)  # type: ignore[arg-type]
    if isinstance(bad, float):
        with pytest.raises(InvalidArgument):
            StoreConfig.build(path="/tmp/x", min_compress_ratio=bad)


def test_store_config_default_matches_the_codec() -> None:
    assert StoreConfig(path="/tmp/x").min_compress_ratio == CodecConfig().min_compress_ratio
