"""The pre-open check of an LMDB file (``tiers.lmdb_check``) refused healthy stores as truncated:
it wanted the file to be at least (last_pg + 1) pages, but LMDB never writes the pages it
allocated at the end of the file and freed again in the same transaction, so a commit that mixes
overflow puts and deletes leaves last_pg past the end of a file LMDB reads and writes fine (a
store's next open failed: an outage). Now only what a read would fault on is checked against the
file's size: each tree page the check reads and each value's extent.

Also: the free-page lists were unpacked into Python ints (seconds and a few hundred MiB at each
open after a large delete), and each value's overflow header was one read at a random place in
the file (slow on a cold page cache): the lists are compared in numpy, and the headers read in
page order, those close together in one read."""

from __future__ import annotations

import os
import shutil
import struct
import tracemalloc
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.errors import IntegrityError
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers import lmdb_check
from tiers.lmdb_check import FileDamage, check_file

LENIENT = frozenset({b"blocks"})
PAGE = 4096


def _short_tail(d: Path) -> tuple[int, int]:
    """An LMDB file whose last commit put overflow values at the end of the file and deleted
    them again (after a commit that reused free pages): (file size, (last_pg + 1) * page)."""
    env = lmdb.open(str(d), map_size=1 << 30, max_dbs=4)
    db = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for i in range(8):
            txn.put(b"a%d" % i, b"x" * 20000, db=db)
    with env.begin(write=True) as txn:
        for i in range(4):
            txn.delete(b"a%d" % i, db=db)
    with env.begin(write=True) as txn:
        txn.put(b"c", b"z" * 100, db=db)
    with env.begin(write=True) as txn:
        txn.put(b"c0", b"z" * 30000, db=db)
        for i in range(8):
            txn.put(b"b%d" % i, b"y" * 50000, db=db)
        for i in range(8):
            txn.delete(b"b%d" % i, db=db)
    last = env.info()["last_pgno"]
    env.close()
    return (d / "data.mdb").stat().st_size, (last + 1) * PAGE


def test_a_commit_that_put_and_deleted_overflow_values_opens(tmp_path):
    """The file is shorter than its last commit's last page; LMDB reads and writes it, and so
    must the check let it."""
    d = tmp_path / "e"
    size, last = _short_tail(d)
    assert size < last, "LMDB wrote every page of this commit: the case is not made"
    check_file(d / "data.mdb", lenient=LENIENT)
    env = lmdb.open(str(d), map_size=1 << 30, max_dbs=4)
    db = env.open_db(b"blocks")
    with env.begin(db=db) as txn:
        assert {bytes(k): len(v) for k, v in txn.cursor()} == {
            **{b"a%d" % i: 20000 for i in range(4, 8)}, b"c": 100, b"c0": 30000}
    with env.begin(write=True) as txn:
        txn.put(b"new", b"n" * 50000, db=db)
    env.close()
    check_file(d / "data.mdb", lenient=LENIENT)


def test_a_store_whose_last_commit_left_its_tail_unwritten_opens(tmp_path):
    """The Store calls a fuzzer ran (the last a purge_model): the next open was refused with
    'restore it from a backup'."""
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=0, dram_bytes=0, nvme_bytes=8 << 20,
                      master_key=bytes(range(32)), encrypt=False, durable=False, min_compress_ratio=1.0,
                      compression_level=1)

    def spec(model: str, d: int, layers: int = 1, heads: int = 1, tokens: int = 16) -> ModelSpec:
        return ModelSpec(model=model, revision="r", num_layers=layers, num_kv_heads=heads, head_dim=d,
                         dtype="bfloat16", block_tokens=tokens)

    b, c, d, e = spec("b", 64), spec("c", 63), spec("d", 65), spec("e", 64, 2, 2)
    a8 = ModelSpec(model="a", revision="r", num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16",
                   block_tokens=8)
    torch.manual_seed(25)

    def chain(s: Store, t: str, sp: ModelSpec, n: int, i: int, ttl: float | None = None,
              zero: bool = False) -> list[bytes]:
        keys = s.block_keys(t, sp, list(range(i * 10**7, i * 10**7 + n * sp.block_tokens)))
        kv = torch.zeros((n, *sp.block_shape)) if zero else torch.randn((n, *sp.block_shape))
        s.put(t, sp, keys, kv.to(sp.torch_dtype), ttl_s=ttl)
        return keys

    s = Store.open(cfg)
    k = chain(s, "t0", c, 8, 1, ttl=60)
    s.delete("t0", k[5:])
    s.purge_model(b.fingerprint)
    chain(s, "t4", d, 1, 2, zero=True)
    chain(s, "t5", b, 2, 3, ttl=60)
    keys_e = chain(s, "t0", e, 64, 4)
    chain(s, "t4", a8, 2, 5, ttl=60, zero=True)
    chain(s, "t4", d, 64, 6, ttl=60, zero=True)
    chain(s, "t2", d, 2, 7, zero=True)
    s.purge_model(d.fingerprint)
    s.close()
    s = Store.open(cfg)
    try:
        assert s.lookup("t0", e, keys_e).num_blocks == 64
        assert s.get("t0", e, keys_e).shape[0] == 64
    finally:
        s.close()


def _puts_only(d: Path, values: list[int]) -> None:
    """A new file, one commit of puts only: every page 2..last_pg is in use."""
    env = lmdb.open(str(d), map_size=1 << 30, max_dbs=4)
    db = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for i, n in enumerate(values):
            txn.put(b"k%04d" % i, b"v" * n, db=db)
    env.close()


def test_a_file_cut_inside_a_value_is_still_refused_as_truncated(tmp_path):
    """The last value's last page past the end of the file (its header still inside): LMDB
    would read it (SIGBUS). The value's extent comes from its size."""
    d = tmp_path / "e"
    env = lmdb.open(str(d), map_size=1 << 30, max_dbs=4)
    db = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        for i in range(8):
            txn.put(b"a%d" % i, b"x" * 20000, db=db)
    with env.begin(write=True) as txn:
        for i in range(8):
            txn.delete(b"a%d" % i, db=db)
    with env.begin(write=True) as txn:
        txn.put(b"c", b"z" * 100, db=db)
    with env.begin(write=True) as txn:  # at the end of the file: no run of 257 free pages
        txn.put(b"big", b"z" * (1 << 20), db=db)
    env.close()
    f = d / "data.mdb"
    os.truncate(f, f.stat().st_size - PAGE)
    with pytest.raises(FileDamage, match=r"the value of node 0 of page \d+ of the blocks database ends "
                                         r"past the end of the file") as info:
        check_file(f, lenient=LENIENT)
    assert info.value.truncated and info.value.have == f.stat().st_size
    assert info.value.need == f.stat().st_size + PAGE


@pytest.mark.parametrize("cut", [1, 2, 8])
def test_a_file_cut_short_is_still_refused_at_open(tmp_path, cut):
    """A file cut by whole pages, where every page is in use, refused by the check and by the
    Store's open (the message the truncated file had)."""
    d = tmp_path / "e"
    _puts_only(d, [5000] * 40)
    f = d / "data.mdb"
    os.truncate(f, f.stat().st_size - cut * PAGE)
    with pytest.raises(FileDamage) as info:
        check_file(f, lenient=LENIENT)
    assert info.value.truncated and info.value.need > info.value.have == f.stat().st_size

    from tiers.nvme import _check_file

    with pytest.raises(IntegrityError, match=f"{f} is {f.stat().st_size} bytes, but its last commit uses"):
        _check_file(d, lenient=LENIENT)


def _walk(next_pg: int) -> lmdb_check._Walk:
    w = lmdb_check._Walk(-1, next_pg * PAGE, LENIENT)
    w.psize, w.next_pg = PAGE, next_pg
    return w


def test_a_free_page_list_of_millions_is_checked_without_a_python_int_each():
    """4M free pages (16 GiB deleted): the old check held them as a tuple of Python ints (about
    170 MiB) and compared them in Python (seconds)."""
    n = 4_000_000
    value = struct.pack("<Q", n) + np.arange(n + 1, 1, -1, dtype="<u8").tobytes()
    w = _walk(n + 2)
    tracemalloc.start()
    try:
        w.free_list(value, "a record")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak >> 20} MiB"


@pytest.mark.parametrize("what", ["out of order", "past the last page", "a meta page", "repeated"])
def test_a_damaged_free_page_list_is_still_refused(what):
    pages = np.arange(1001, 1, -1, dtype="<u8")
    if what == "out of order":
        pages[10], pages[11] = pages[11], pages[10]
    elif what == "past the last page":
        pages[0] = 5000
    elif what == "a meta page":
        pages[-1] = 1
    else:
        pages[5] = pages[6]
    value = struct.pack("<Q", len(pages)) + pages.tobytes()
    with pytest.raises(FileDamage, match="outside 2..1001 or out of order"):
        _walk(1002).free_list(value, "a record")
    _walk(1002).free_list(struct.pack("<Q", 1000) + np.arange(1001, 1, -1, dtype="<u8").tobytes(), "a record")
    _walk(1002).free_list(struct.pack("<Q", 0), "a record")


def test_overflow_headers_are_read_in_page_order_the_kernel_told_ahead(tmp_path, monkeypatch):
    """2000 values of 5000 bytes, put in an order unlike their keys': one read per header at a
    random place in the file before (a cold page cache read them one by one); now in page
    order, the kernel told ahead of each run of them (a few large reads)."""
    d = tmp_path / "e"
    env = lmdb.open(str(d), map_size=1 << 30, max_dbs=4)
    db = env.open_db(b"blocks")
    order = np.random.default_rng(0).permutation(2000)
    for lo in range(0, 2000, 100):  # several commits, so the pages are not in key order
        with env.begin(write=True) as txn:
            for i in order[lo:lo + 100]:
                txn.put(b"k%04d" % i, bytes([i % 251]) * 5000, db=db)
    env.close()
    reads: list[tuple[int, int]] = []
    advice: list[tuple[int, int, int]] = []
    real_pread = os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        reads.append((n, offset))
        return real_pread(fd, n, offset)

    monkeypatch.setattr(lmdb_check.os, "pread", pread)
    monkeypatch.setattr(lmdb_check.os, "posix_fadvise", lambda fd, at, n, how: advice.append((at, n, how)))
    check_file(d / "data.mdb", lenient=LENIENT)
    heads = [offset for n, offset in reads if n == 16]
    assert len(heads) == 2000
    assert heads == sorted(heads)
    assert advice and len(advice) < 100
    assert all(how == os.POSIX_FADV_WILLNEED for _, _, how in advice)
    assert all(any(at <= h < at + n for at, n, _ in advice) for h in heads)
    shutil.rmtree(d)
