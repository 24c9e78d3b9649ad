"""Codec and quantization fixes, round 15: an ``encrypt`` setting that differs from the one the
values were written with (a remote server of a shared namespace, a Store reopened) is a
configuration fault that deletes nothing; int8 of a float32 ``FLT_MAX`` dequantizes finite;
list / numpy block tables are checked as tensor tables are; ``Codec.decode`` checks its key.

Each test failed on the code before the fix. The remote test uses a real Redis (``redis_ns``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
from conftest import MASTER

from kernels.backend import triton_available
from kernels.paged import PagedLayout, gather_blocks, scatter_blocks
from kernels.quant import QuantScheme, dequantize, error_bound, quantize
from kvstore.codec import Codec, CodecConfig
from kvstore.config import StoreConfig
from kvstore.errors import FailedPrecondition, IntegrityError, InvalidArgument
from kvstore.keyring import Keyring
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
CUDA = torch.cuda.is_available()


# -- 1: a remote server whose encrypt differs from the namespace's writers --------------------------
def test_remote_reader_with_other_encrypt_keeps_the_blocks(redis_ns, caplog) -> None:
    """A miss counted config_mismatch (logged once), never an integrity failure that deletes."""
    import redis

    from kvstore.errors import EncryptionMismatch
    from kvstore.status import to_status
    from tiers.remote import RemoteTier
    from tiers.remote_config import RemoteConfig

    assert issubclass(EncryptionMismatch, FailedPrecondition)
    assert not issubclass(EncryptionMismatch, IntegrityError)
    assert to_status(EncryptionMismatch("x"))[0].name == "FAILED_PRECONDITION"
    url, ns = redis_ns
    raw = redis.Redis.from_url(url)
    enc = RemoteTier.open(RemoteConfig(urls=[url], namespace=ns), MASTER)
    plain = RemoteTier.open(RemoteConfig(urls=[url], namespace=ns, encrypt=False), MASTER)
    try:
        rng = np.random.default_rng(0)
        refs = [BlockRef("alice", bytes([i]) * 32, SPEC) for i in range(4)]
        data = [rng.integers(0, 256, SPEC.block_nbytes, dtype=np.uint8) for _ in refs]
        for ref, d in zip(refs[:2], data[:2], strict=True):
            assert enc.put(ref, d)
        for ref, d in zip(refs[2:], data[2:], strict=True):
            assert plain.put(ref, d)
        with caplog.at_level(logging.WARNING, logger="tiers.remote_reads"):
            for reader, wrong in ((plain, refs[:2]), (enc, refs[2:])):
                for ref in wrong:
                    assert not reader.get_into(ref, np.zeros(SPEC.block_nbytes, np.uint8))
                    assert raw.exists(reader.redis_key(ref))  # NOTE: was deleted
        for reader in (plain, enc):
            m = reader.metrics()
            assert m.get("config_mismatch") == 2 and not m.get("integrity_failures"), m
        warned = [r for r in caplog.records if "must agree on encrypt" in r.getMessage()]
        assert len(warned) == 2  # once per tier, not once per block
        # the writers still read their blocks
        for reader, mine, mine_data in ((enc, refs[:2], data[:2]), (plain, refs[2:], data[2:])):
            for ref, d in zip(mine, mine_data, strict=True):
                out = np.zeros(SPEC.block_nbytes, np.uint8)
                assert reader.get_into(ref, out) and np.array_equal(out, d)
    finally:
        enc.close()
        plain.close()
        raw.close()


# -- 2: a Store reopened with the other encrypt setting ---------------------------------------------
def _open(path: Path, encrypt: bool) -> Store:
    return Store.open(StoreConfig(path=path, hbm_bytes=0, dram_bytes=0, nvme_bytes=64 * SPEC.block_nbytes,
                                  master_key=MASTER, encrypt=encrypt))


def _fill(path: Path, encrypt: bool) -> tuple[list[bytes], torch.Tensor]:
    s = _open(path, encrypt)
    keys = s.block_keys("t", SPEC, list(range(12)))
    kv = torch.randn(3, *SPEC.block_shape).half()
    s.put("t", SPEC, keys, kv)
    s.close()
    return keys, kv


def _assert_intact(path: Path, encrypt: bool, keys: list[bytes], kv: torch.Tensor) -> None:
    with _open(path, encrypt) as s:
        assert s.lookup("t", SPEC, keys).num_blocks == 3
        assert torch.equal(s.get("t", SPEC, keys), kv)
        assert s.stats()["integrity_failures"] == 0


@pytest.mark.parametrize("first", [True, False])
def test_store_reopened_with_other_encrypt_is_refused_and_keeps_blocks(tmp_path: Path, first: bool) -> None:
    keys, kv = _fill(tmp_path / "s", first)
    with pytest.raises(FailedPrecondition, match=f"written with encrypt={first}"):
        _open(tmp_path / "s", not first)
    _assert_intact(tmp_path / "s", first, keys, kv)  # NOTE: before, every block was gone


def _forget_record(path: Path) -> None:
    """Make ``path`` look like a store written before the encrypt setting was recorded."""
    env = lmdb.open(str(path / "nvme" / "keys"), max_dbs=2)
    try:
        db = env.open_db(b"settings")
        with env.begin(write=True) as txn:
            txn.delete(b"encrypt", db=db)
    finally:
        env.close()


@pytest.mark.parametrize("first", [True, False])
def test_store_without_a_record_takes_the_setting_from_its_values(tmp_path: Path, first: bool) -> None:
    keys, kv = _fill(tmp_path / "s", first)
    _forget_record(tmp_path / "s")
    with pytest.raises(FailedPrecondition, match="encrypt"):
        _open(tmp_path / "s", not first)
    _assert_intact(tmp_path / "s", first, keys, kv)
    # an empty store without a record takes the setting it is opened with, and keeps it
    _open(tmp_path / "e", first).close()
    _forget_record(tmp_path / "e")
    _open(tmp_path / "e", not first).close()
    with pytest.raises(FailedPrecondition):
        _open(tmp_path / "e", first)


def test_nvme_value_of_the_other_kind_is_a_miss_not_an_exception(tmp_path: Path) -> None:
    """A guard (it passed before too): in a store whose setting was recorded after values of
    the other kind were written (an earlier mistake), such a value is unreadable under any open
    the tier allows; EncryptionMismatch, now no IntegrityError, must still not escape get."""
    from tiers.nvme import NVMeTier

    ref = BlockRef("t", b"k" * 32, SPEC)
    data = np.arange(SPEC.block_nbytes, dtype=np.uint32).astype(np.uint8)
    tier = NVMeTier(tmp_path / "n", 10 * SPEC.block_nbytes)
    try:
        tier.codec = Codec(CodecConfig(), Keyring(MASTER, tier.key_backend()))
        assert tier.put(ref, data)
        tier.codec.close()
        tier.codec = Codec(CodecConfig(encrypt=False), None)
        assert not tier.get_into(ref, np.empty(SPEC.block_nbytes, np.uint8))
        assert not tier.contains(ref)
    finally:
        tier.close()


# -- 3: int8 of float32 FLT_MAX ---------------------------------------------------------------------
def _extremes(dtype: torch.dtype) -> torch.Tensor:
    big = torch.finfo(dtype).max
    x = torch.zeros(2, 1, 1, 4, 2, dtype=dtype)
    x[0, 0, 0, 0, 0] = big
    x[0, 0, 0, 1, 0] = 1.0
    x[1, 0, 0, 1, 1] = -big
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scheme", list(QuantScheme))
@pytest.mark.parametrize("gran", ["channel", "head"])
def test_quantized_extremes_dequantize_finite_within_a_finite_bound(dtype, scheme, gran) -> None:
    x = _extremes(dtype)
    q = quantize(x, scheme, gran)
    y = dequantize(q)
    assert bool(torch.isfinite(y).all()), y  # NOTE: int8 float32 gave +-inf
    bound = error_bound(x, q)
    assert bool(torch.isfinite(bound).all())  # NOTE: overflowed to inf: a vacuous check
    assert bool(((y.float() - x.float()).abs() <= bound).all())


def test_store_int8_float32_block_with_flt_max_comes_back_finite(tmp_path: Path) -> None:
    spec = ModelSpec(model="m", revision="r", num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype="float32", block_tokens=16)
    kv = torch.randn(1, *spec.block_shape)
    kv.view(-1)[5] = torch.finfo(torch.float32).max
    with Store.open(StoreConfig(path=tmp_path / "s", hbm_bytes=0, dram_bytes=0,
                                nvme_bytes=16 * spec.block_nbytes, master_key=MASTER,
                                nvme_quantization="int8")) as s:
        keys = s.block_keys("t", spec, list(range(16)))
        s.put("t", spec, keys, kv)
        out = s.get("t", spec, keys)
    assert bool(torch.isfinite(out).all())
    assert out.view(-1)[5].item() == torch.finfo(torch.float32).max


@pytest.fixture(params=[
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        CUDA, reason="CUDA present: the kernels run compiled (the [cuda] case)")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA not available")),
])
def device(request, monkeypatch):
    """As in test_kernels_triton: the Triton kernels run in the interpreter on CPU."""
    if not triton_available():
        pytest.skip("triton is not installed")
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy
def test_triton_dequantize_clamps_as_the_reference(device) -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q = quantize(_extremes(dtype).to(device), QuantScheme.INT8, "channel", backend="torch")
        for out_dtype in (torch.float32, torch.float16, torch.bfloat16):
            want = dequantize(q, out_dtype, backend="torch")
            got = dequantize(q, out_dtype, backend="triton")
            assert bool(torch.isfinite(got).all())  # NOTE: int8 float32 FLT_MAX gave +-inf
            assert got.cpu().view(-1).view(torch.uint8).equal(want.cpu().view(-1).view(torch.uint8))


# -- 4: list / numpy block tables -------------------------------------------------------------------
BAD_TABLES = [[1.7, 2.2], np.array([1.9, 0.5]), [True, False], np.array([True, False]),
              [[1], [2]], [[1], [2, 3]], ["1", "2"], [1, None]]


@pytest.mark.parametrize("table", BAD_TABLES, ids=repr)
def test_block_table_lists_are_checked_as_tensors_are(table) -> None:
    cache = [torch.arange(8, dtype=torch.float32).reshape(4, 2, 1, 1, 1)]
    with pytest.raises(InvalidArgument, match="block table"):
        gather_blocks(cache, table, PagedLayout.BLOCKS_FIRST)
    target = [torch.zeros(4, 2, 1, 1, 1)]
    with pytest.raises(InvalidArgument, match="block table"):
        scatter_blocks(torch.ones(2, 2, 1, 1, 1, 1), target, table, PagedLayout.BLOCKS_FIRST)
    assert not target[0].any()  # NOTE: [0.9, 2.99] wrote slots 0 and 2


def test_integer_block_tables_still_work() -> None:
    cache = [torch.arange(8, dtype=torch.float32).reshape(4, 2, 1, 1, 1)]
    for table in ([3, 1], np.array([3, 1]), np.array([3, 1], np.uint8), (3, 1), range(3, 0, -2),
                  [np.int32(3), 1]):
        out = gather_blocks(cache, table, PagedLayout.BLOCKS_FIRST)
        assert out[:, 0].reshape(-1).tolist() == [6.0, 2.0]
    assert gather_blocks(cache, [], PagedLayout.BLOCKS_FIRST).shape[0] == 0


# -- 5: Codec.decode checks its key -----------------------------------------------------------------
@pytest.mark.parametrize("key", ["k" * 32, None, 32, b"k" * 31, 3.5], ids=repr)
def test_decode_checks_the_key_as_encode_does(key) -> None:
    with Codec(CodecConfig(), Keyring(bytes(32), {})) as c:
        value = c.encode("t", b"k" * 32, SPEC, np.zeros(SPEC.block_nbytes, np.uint8))
        with pytest.raises(InvalidArgument, match="block key"):
            c.decode("t", key, SPEC, value)


def test_a_refused_open_closes_the_tiers_it_had_opened(tmp_path: Path, redis_ns) -> None:
    """The refused open (the other encrypt setting) left the remote tier's writer and reader
    threads and connections running, and the NVMe environment open."""
    import threading

    from tiers.remote_config import RemoteConfig

    url, ns = redis_ns
    _fill(tmp_path / "s", True)
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(FailedPrecondition, match="written with encrypt=True"):
        Store.open(StoreConfig(path=tmp_path / "s", hbm_bytes=0, dram_bytes=0, nvme_bytes=64 * SPEC.block_nbytes,
                               master_key=MASTER, encrypt=False, remote=RemoteConfig(urls=[url], namespace=ns)))
    left = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not {n for n in left if n.startswith("kvstore-remote")}, left
