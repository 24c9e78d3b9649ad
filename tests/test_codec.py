"""Value codec: bit-exact round trips, and every tamper case is an IntegrityError."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.checksum import checksum
from kvstore.codec import Codec, CodecConfig, parse_header
from kvstore.errors import (
    EncryptionMismatch,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    KeyUnavailable,
    ShapeMismatch,
)
from kvstore.keyring import Keyring
from kvstore.spec import ModelSpec

MASTER = b"\x07" * 32
KEY_A, KEY_B = b"\xaa" * 32, b"\xbb" * 32


def _spec(dtype: str = "bfloat16", layers: int = 2, heads: int = 2, head_dim: int = 64,
          tokens: int = 16, revision: str = "r1") -> ModelSpec:
    return ModelSpec(model="m", revision=revision, num_layers=layers, num_kv_heads=heads,
                     head_dim=head_dim, dtype=dtype, block_tokens=tokens)


def _kv_bytes(spec: ModelSpec, seed: int = 0, kind: str = "normal") -> np.ndarray:
    """Block bytes: KV-like normal values cast to the dtype, or uniformly random bytes."""
    if kind == "random":
        return np.random.default_rng(seed).integers(0, 256, spec.block_nbytes, dtype=np.uint8)
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(spec.block_shape, generator=gen).to(spec.torch_dtype)
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().copy()


@pytest.fixture
def keyring() -> Keyring:
    return Keyring(MASTER, {})


@pytest.fixture
def codec(keyring: Keyring):  # type: ignore[no-untyped-def]
    with Codec(CodecConfig(chunk_bytes=4096), keyring) as c:
        yield c


# -- round trips ------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "float8"]),
    layers=st.integers(1, 3), heads=st.integers(1, 2), head_dim=st.sampled_from([8, 64]),
    tokens=st.sampled_from([1, 5, 16]),
    encrypt=st.booleans(), level=st.sampled_from([0, 1, 3]),
    planes=st.sampled_from(["top", "all"]), chunk=st.sampled_from([4096, 8192, 1 << 20]),
    threads=st.sampled_from([1, 2]), kind=st.sampled_from(["normal", "random"]),
    seed=st.integers(0, 1000),
)
def test_codec_round_trip_bit_exact(dtype: str, layers: int, heads: int, head_dim: int, tokens: int,
                                    encrypt: bool, level: int, planes: str, chunk: int, threads: int,
                                    kind: str, seed: int) -> None:
    spec = _spec(dtype, layers, heads, head_dim, tokens)
    data = _kv_bytes(spec, seed, kind)
    cfg = CodecConfig(compression_level=level, encrypt=encrypt, chunk_bytes=chunk,
                      threads=threads, compress_planes=planes)  # type: ignore[arg-type]
    with Codec(cfg, Keyring(MASTER, {}) if encrypt else None) as codec:
        value = codec.encode("tenant", KEY_A, spec, data)
        assert len(value) <= codec.max_encoded_nbytes(spec)
        assert np.array_equal(codec.decode("tenant", KEY_A, spec, value), data)
        out = np.empty(spec.block_nbytes, np.uint8)
        assert codec.decode("tenant", KEY_A, spec, bytes(value), out=out) is out
        assert np.array_equal(out, data)


def test_bf16_kv_compresses_and_random_bytes_are_stored_raw(keyring: Keyring) -> None:
    spec = _spec("bfloat16", layers=4)
    with Codec(CodecConfig(chunk_bytes=4096, min_compress_ratio=1.0), keyring) as codec:
        kv = codec.encode("t", KEY_A, spec, _kv_bytes(spec))
        rnd = codec.encode("t", KEY_A, spec, _kv_bytes(spec, kind="random"))
    assert len(kv) < 0.8 * spec.block_nbytes
    assert all(flags == 1 for _, flags, _ in parse_header(kv).chunks)
    assert all(flags == 0 for _, flags, _ in parse_header(rnd).chunks)  # incompressible -> raw


def test_encode_into_reused_buffer(codec: Codec) -> None:
    spec = _spec()
    buf = bytearray(codec.max_encoded_nbytes(spec))
    for seed in range(3):
        data = _kv_bytes(spec, seed)
        n = codec.encode_into("t", KEY_A, spec, data, buf)
        assert np.array_equal(codec.decode("t", KEY_A, spec, memoryview(buf)[:n]), data)
    with pytest.raises(InvalidArgument, match="needs"):
        codec.encode_into("t", KEY_A, spec, _kv_bytes(spec, kind="random"), bytearray(100))


def test_encrypted_value_hides_plaintext_and_nonces_differ(codec: Codec) -> None:
    spec = _spec("float16")
    data = np.zeros(spec.block_nbytes, np.uint8)
    cfg = CodecConfig(compression_level=0, chunk_bytes=4096)
    with Codec(cfg, Keyring(MASTER, {})) as c:
        v1, v2 = c.encode("t", KEY_A, spec, data), c.encode("t", KEY_A, spec, data)
    assert v1 != v2  # fresh nonces
    body = bytes(v1[parse_header(v1).header_nbytes :])
    assert body.count(0) < len(body) // 8


# -- bad input --------------------------------------------------------------------------------
def test_wrong_sizes_are_shape_mismatch(codec: Codec) -> None:
    spec = _spec()
    with pytest.raises(ShapeMismatch):
        codec.encode("t", KEY_A, spec, np.zeros(spec.block_nbytes - 2, np.uint8))
    value = codec.encode("t", KEY_A, spec, _kv_bytes(spec))
    with pytest.raises(ShapeMismatch):
        codec.decode("t", KEY_A, spec, value, out=np.empty(spec.block_nbytes + 1, np.uint8))
    with pytest.raises(ShapeMismatch):
        codec.decode("t", KEY_A, spec, value, out=np.empty(spec.block_nbytes // 2, np.uint16))


def test_encrypting_codec_needs_a_keyring_and_closed_codec_refuses() -> None:
    with pytest.raises(InvalidArgument):
        Codec(CodecConfig(encrypt=True), None)
    with pytest.raises(InvalidArgument):
        CodecConfig(chunk_bytes=1000)
    c = Codec(CodecConfig(encrypt=False), None)
    c.close()
    spec = _spec()
    with pytest.raises(FailedPrecondition):
        c.encode("t", KEY_A, spec, _kv_bytes(spec))


# -- tampering --------------------------------------------------------------------------------
def _flip(value: bytes | bytearray, pos: int) -> bytes:
    b = bytearray(value)
    b[pos] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("level", [0, 1])
def test_every_tamper_is_an_integrity_error(keyring: Keyring, level: int) -> None:
    spec = _spec("bfloat16")
    data = _kv_bytes(spec)
    cfg = CodecConfig(compression_level=level, chunk_bytes=4096, min_compress_ratio=1.0)
    with Codec(cfg, keyring) as codec:
        value = bytes(codec.encode("t", KEY_A, spec, data))
        info = parse_header(value)
        hn = info.header_nbytes
        first_chunk_end = hn + info.chunks[0][0] + 16
        cases = {
            "magic": _flip(value, 0),
            "version": _flip(value, 4),
            "fingerprint byte": _flip(value, 30),
            "header table (nonce)": _flip(value, hn - 3),
            "ciphertext": _flip(value, hn + 5),
            "tag": _flip(value, first_chunk_end - 1),
            "last byte": _flip(value, len(value) - 1),
            "truncated": value[:-1],
            "truncated header": value[:20],
            "empty": b"",
            "extended": bytes(value) + b"\x00",
        }
        for name, bad in cases.items():
            with pytest.raises(IntegrityError):
                codec.decode("t", KEY_A, spec, bad)
            assert name  # every case raised
        # right bytes, wrong identity
        with pytest.raises(IntegrityError, match="block key"):
            codec.decode("t", KEY_B, spec, value)
        with pytest.raises(IntegrityError, match="tenant"):
            codec.decode("other", KEY_A, spec, value)
        with pytest.raises(IntegrityError, match="fingerprint"):
            codec.decode("t", KEY_A, _spec("bfloat16", revision="r2"), value)
        assert np.array_equal(codec.decode("t", KEY_A, spec, value), data)


def test_swapping_chunks_is_detected(keyring: Keyring) -> None:
    spec = _spec("float16")
    with Codec(CodecConfig(compression_level=0, chunk_bytes=4096), keyring) as codec:
        value = bytearray(codec.encode("t", KEY_A, spec, _kv_bytes(spec)))
        hn, step = parse_header(value).header_nbytes, 4096 + 16
        a, b = value[hn : hn + step], value[hn + step : hn + 2 * step]
        value[hn : hn + step], value[hn + step : hn + 2 * step] = b, a
        with pytest.raises(IntegrityError, match="authentication"):
            codec.decode("t", KEY_A, spec, value)


def test_header_rewritten_to_another_key_fails_authentication(keyring: Keyring) -> None:
    spec = _spec()
    with Codec(CodecConfig(chunk_bytes=4096), keyring) as codec:
        value = bytearray(codec.encode("t", KEY_A, spec, _kv_bytes(spec)))
        pos = bytes(value).index(KEY_A)
        value[pos : pos + 32] = KEY_B  # header now claims KEY_B: passes the identity check...
        with pytest.raises(IntegrityError, match="authentication"):  # ...but not the tag
            codec.decode("t", KEY_B, spec, value)


def test_destroyed_tenant_key_makes_values_unreadable(keyring: Keyring) -> None:
    spec = _spec()
    with Codec(CodecConfig(chunk_bytes=4096), keyring) as codec:
        value = codec.encode("t", KEY_A, spec, _kv_bytes(spec))
        keyring.destroy("t")
        with pytest.raises(KeyUnavailable):
            codec.decode("t", KEY_A, spec, value)
        codec.encode("t", KEY_B, spec, _kv_bytes(spec))  # tenant comes back with a new key
        with pytest.raises(IntegrityError, match="authentication"):
            codec.decode("t", KEY_A, spec, value)


def test_wrong_master_key_is_not_an_integrity_error() -> None:
    backend: dict[str, bytes] = {}
    spec = _spec()
    with Codec(CodecConfig(chunk_bytes=4096), Keyring(MASTER, backend)) as codec:
        codec.encode("t", KEY_A, spec, _kv_bytes(spec))
    with pytest.raises(FailedPrecondition):
        Keyring(b"\x08" * 32, backend)


def test_encrypted_and_plain_values_do_not_cross(keyring: Keyring) -> None:
    spec = _spec()
    data = _kv_bytes(spec)
    with Codec(CodecConfig(chunk_bytes=4096), keyring) as enc, \
            Codec(CodecConfig(chunk_bytes=4096, encrypt=False), None) as plain:
        with pytest.raises(EncryptionMismatch):  # a configuration fault, not damage
            plain.decode("t", KEY_A, spec, enc.encode("t", KEY_A, spec, data))
        with pytest.raises(EncryptionMismatch):
            enc.decode("t", KEY_A, spec, plain.encode("t", KEY_A, spec, data))


@pytest.mark.parametrize("level", [0, 1])
def test_unencrypted_checksum_catches_any_flipped_byte(level: int) -> None:
    spec = _spec("float16", layers=1, heads=1, head_dim=32, tokens=8)
    data = _kv_bytes(spec)
    cfg = CodecConfig(compression_level=level, encrypt=False, chunk_bytes=4096, min_compress_ratio=1.0)
    with Codec(cfg, None) as codec:
        value = bytes(codec.encode("t", KEY_A, spec, data))
        for pos in range(0, len(value), 7):
            with pytest.raises(IntegrityError):
                codec.decode("t", KEY_A, spec, _flip(value, pos))
        assert np.array_equal(codec.decode("t", KEY_A, spec, value), data)


def test_corrupt_zstd_frame_with_valid_checksums_is_an_integrity_error() -> None:
    spec = _spec("bfloat16", layers=1)
    with Codec(CodecConfig(encrypt=False, chunk_bytes=1 << 20, min_compress_ratio=1.0), None) as codec:
        value = bytearray(codec.encode("t", KEY_A, spec, _kv_bytes(spec)))
        info = parse_header(value)
        stored, flags, _ = info.chunks[0]
        assert flags == 1
        hn = info.header_nbytes
        top = hn + spec.block_nbytes // 2  # the compressed top plane starts here
        value[top + 8 : hn + stored] = bytes(hn + stored - top - 8)  # garbage frame body
        # forge the chunk checksum and the header digest so only zstd can notice
        entry = hn - 16 - 21
        struct.pack_into("<16s", value, entry + 5, checksum(value[hn : hn + stored], seed=0))
        value[hn - 16 : hn] = checksum(value[: hn - 16])
        with pytest.raises(IntegrityError, match="chunk 0: decompression"):
            codec.decode("t", KEY_A, spec, value)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), level=st.sampled_from([0, 1]), encrypt=st.booleans())
def test_any_single_flipped_bit_is_detected(data: st.DataObject, level: int, encrypt: bool) -> None:
    spec = _spec("bfloat16", layers=1, heads=1, head_dim=64, tokens=16)
    block = _kv_bytes(spec, seed=3)
    cfg = CodecConfig(compression_level=level, encrypt=encrypt, chunk_bytes=1024 * 4,
                      min_compress_ratio=1.0)  # level 1: the compressed layout
    with Codec(cfg, Keyring(MASTER, {}) if encrypt else None) as codec:
        value = bytearray(codec.encode("t", KEY_A, spec, block))
        pos = data.draw(st.integers(0, len(value) - 1))
        value[pos] ^= 1 << data.draw(st.integers(0, 7))
        with pytest.raises(IntegrityError):
            codec.decode("t", KEY_A, spec, value)


@pytest.mark.parametrize("encrypt", [True, False])
def test_value_with_larger_chunks_than_the_reader_decodes(keyring: Keyring, encrypt: bool) -> None:
    """Bug: decode staged a compressed chunk in a scratch buffer sized by the reader's own
    chunk_bytes, so a value written with larger chunks (another config or server) failed its
    integrity check and was deleted as corrupt."""
    spec = _spec("bfloat16", layers=8)  # 64 KiB: one chunk of 64 KiB for the writer
    data = _kv_bytes(spec)
    kr = keyring if encrypt else None
    with Codec(CodecConfig(encrypt=encrypt, chunk_bytes=1 << 20, min_compress_ratio=1.0), kr) as writer, \
            Codec(CodecConfig(encrypt=encrypt, chunk_bytes=4096), kr) as reader:
        value = writer.encode("t", KEY_A, spec, data)
        assert parse_header(value).chunk_bytes > 4096 and parse_header(value).chunks[0][1] == 1
        assert np.array_equal(reader.decode("t", KEY_A, spec, value), data)


def test_concurrent_callers_share_one_codec(keyring: Keyring) -> None:
    import threading

    spec = _spec("float16")
    blocks = [_kv_bytes(spec, seed) for seed in range(6)]
    failures: list[str] = []
    with Codec(CodecConfig(chunk_bytes=4096, threads=2), keyring) as codec:
        def worker(j: int) -> None:
            for _ in range(5):
                key = bytes([j]) * 32
                value = codec.encode(f"t{j % 2}", key, spec, blocks[j])
                if not np.array_equal(codec.decode(f"t{j % 2}", key, spec, value), blocks[j]):
                    failures.append(f"worker {j}")

        threads = [threading.Thread(target=worker, args=(j,)) for j in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failures == []


def test_buffer_inputs_of_any_kind(codec: Codec) -> None:
    spec = _spec("float32", layers=1)
    block = _kv_bytes(spec, seed=5)
    as_floats = block.view(np.float32).reshape(spec.block_shape)  # any contiguous array works
    value = codec.encode("t", KEY_A, spec, as_floats)
    assert np.array_equal(codec.decode("t", KEY_A, spec, memoryview(bytes(value))), block)
    value2 = codec.encode("t", KEY_A, spec, block.tobytes())
    assert np.array_equal(codec.decode("t", KEY_A, spec, value2), block)
    with pytest.raises(InvalidArgument):
        codec.encode("t", KEY_A, spec, as_floats[:, :, :, ::2])  # not contiguous
