"""A damaged page of the NVMe tier's LMDB file: reads are counted misses (never wrong bytes, never
"disk full"), deletions go past it, and an open that cannot go on says which file and what to do.

The damage is made as the crash prober made it: bytes of one page of ``data.mdb`` changed (the
flags of a leaf page of the value database, which makes LMDB take it for a branch; or a child page
number of the record database's root past the file's end). The pages are found by walking the
file from its meta page (LMDB's documented on-disk layout). A damaged page that only a deletion's
merge meets is faked (a wrapped write transaction)."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.errors import IntegrityError, NVMeWriteFailed
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.nvme import tenant_prefix

#: values of 4 KiB: each in overflow pages of its own, a leaf holds only keys (as real KV blocks)
SPEC = ModelSpec(model="m", revision="r", num_layers=2, num_kv_heads=2, head_dim=32,
                 dtype="bfloat16", block_tokens=8)
TENANTS = ("t0", "t1", "t2")
CHAINS = 10
PAGE = 4096
P_BRANCH = 0x01


def _config(path: Path) -> StoreConfig:
    return StoreConfig(path=path, hbm_bytes=0, dram_bytes=0, nvme_bytes=400 * SPEC.block_nbytes,
                       master_key=bytes(range(32)))


def _chain(tenant: str, c: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(100 * TENANTS.index(tenant) + c)
    kv = torch.randn((4, *SPEC.block_shape), generator=g).to(SPEC.torch_dtype)
    return list(range(1000 * c, 1000 * c + 4 * SPEC.block_tokens)), kv


def _build(path: Path) -> None:
    s = Store.open(_config(path))
    for t in TENANTS:
        for c in range(CHAINS):
            toks, kv = _chain(t, c)
            s.put(t, SPEC, s.block_keys(t, SPEC, toks), kv)
    s.close()


def _nodes(data: bytes, pg: int) -> Iterator[tuple[int, bytes, int]]:
    """(child page number of a branch node, key, offset after the key) of page ``pg``'s nodes."""
    o = pg * PAGE
    lower = struct.unpack_from("<H", data, o + 12)[0]
    for ptr in struct.unpack_from(f"<{(lower - 16) // 2}H", data, o + 16):
        lo, hi, flags, ksize = struct.unpack_from("<HHHH", data, o + ptr)
        key_at = o + ptr + 8
        yield lo | hi << 16 | flags << 32, bytes(data[key_at:key_at + ksize]), key_at + ksize


def _root(data: bytes, name: bytes) -> int:
    """The root page of the named database ``name`` in the newest meta page."""
    newest = max((0, 1), key=lambda m: struct.unpack_from("<Q", data, m * PAGE + 144)[0])
    main_root = struct.unpack_from("<Q", data, newest * PAGE + 128)[0]
    return next(struct.unpack_from("<Q", data, after + 40)[0]
                for _, key, after in _nodes(data, main_root) if key == name)


def _is_branch(data: bytes, pg: int) -> bool:
    return bool(struct.unpack_from("<H", data, pg * PAGE + 10)[0] & P_BRANCH)


def _leaves(data: bytes, name: bytes) -> list[tuple[int, list[bytes]]]:
    """The live leaf pages of the named database ``name`` and their keys, in key order."""
    out, todo = [], [_root(data, name)]
    while todo:
        pg = todo.pop(0)
        if _is_branch(data, pg):
            todo[0:0] = [child for child, _, _ in _nodes(data, pg)]
        else:
            out.append((pg, [key for _, key, _ in _nodes(data, pg)]))
    return out


def _damage_leaf_of(path: Path, tenant: str, name: bytes = b"blocks") -> None:
    """Flip the branch bit of a leaf page of ``name`` holding only ``tenant``'s keys."""
    data_file = path / "nvme" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    pg = next(pg for pg, keys in _leaves(data, name)
              if keys and all(k.startswith(tenant_prefix(tenant)) for k in keys))
    data[pg * PAGE + 10] ^= P_BRANCH
    data_file.write_bytes(data)


def _damage_branch_of(path: Path, name: bytes) -> None:
    """Make the last child of the root (a branch page) of ``name`` a page number past the file's
    end (LMDB: MDB_PAGE_NOTFOUND when a walk gets there)."""
    data_file = path / "nvme" / "data.mdb"
    data = bytearray(data_file.read_bytes())
    root = _root(data, name)
    assert _is_branch(data, root), "too few records for a branch page"
    lower = struct.unpack_from("<H", data, root * PAGE + 12)[0]
    last = struct.unpack_from("<H", data, root * PAGE + 16 + (lower - 16) - 2)[0]
    struct.pack_into("<HH", data, root * PAGE + last, 0xFFFF, 0xFFFF)  # the page number's low 32 bits
    data_file.write_bytes(data)


def _served(s: Store, tenant: str) -> int:
    """Blocks of ``tenant`` served over its chains, each checked byte for byte."""
    n = 0
    for c in range(CHAINS):
        toks, kv = _chain(tenant, c)
        got = s.get(tenant, SPEC, s.block_keys(tenant, SPEC, toks))
        assert torch.equal(got.view(torch.uint8), kv[:got.shape[0]].view(torch.uint8))
        n += got.shape[0]
    return n


def _victim(path: Path) -> str:
    """A tenant that has a leaf page of the value database to itself."""
    data = (path / "nvme" / "data.mdb").read_bytes()
    return next(t for t in TENANTS for _, keys in _leaves(data, b"blocks")
                if keys and all(k.startswith(tenant_prefix(t)) for k in keys))


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, str]:
    """A store whose value database has a damaged leaf page of one tenant (returned)."""
    path = tmp_path / "s"
    _build(path)
    victim = _victim(path)
    _damage_leaf_of(path, victim)
    return path, victim


def test_a_get_past_a_damaged_page_is_a_counted_miss_not_a_full_disk(damaged):
    """It raised NVMeWriteFailed ("free some space") at every try: the read ran in the call's
    write transaction, which LMDB then refused to commit; nothing was counted."""
    path, victim = damaged
    s = Store.open(_config(path))
    try:
        for _ in range(2):  # the second time, the damaged blocks are gone from the index
            assert _served(s, victim) < CHAINS * 4
        st = s.stats()
        assert st["integrity_failures"] >= 1
        assert st["counters"]["nvme_commit_failures"] == 0
        for t in TENANTS:
            if t != victim:
                assert _served(s, t) == CHAINS * 4
    finally:
        s.close()


def test_a_damaged_read_does_not_spoil_the_writes_of_its_batch(damaged):
    """A block put (of another tenant, far from the damaged page) in the same NVMe batch as a
    read that meets the damage is committed."""
    path, victim = damaged
    other = next(t for t in TENANTS if t != victim)
    s = Store.open(_config(path))
    try:
        nvme = s._nvme
        toks, _ = _chain(victim, 0)
        keys = s.block_keys(victim, SPEC, toks)
        new_toks, new_kv = list(range(900_000, 900_000 + 4 * SPEC.block_tokens)), _chain(other, 9)[1]
        new_keys = s.block_keys(other, SPEC, new_toks)
        with s._lock, s._batch():
            s.put(other, SPEC, new_keys, new_kv)
            assert s.get(victim, SPEC, keys).shape[0] < 4
        assert s.stats()["counters"]["nvme_commit_failures"] == 0
        assert nvme.deletions_pending == 0
    finally:
        s.close()
    s = Store.open(_config(path))
    try:
        assert torch.equal(s.get(other, SPEC, new_keys), new_kv)
    finally:
        s.close()


def test_drop_tenant_goes_past_a_damaged_page_and_the_store_opens_again(damaged):
    """drop_tenant failed at every try as a full disk, its data key was never destroyed, and
    after close the store could not be opened (lmdb.PageNotFoundError from the clean-up)."""
    path, victim = damaged
    s = Store.open(_config(path))
    try:
        assert s.drop_tenant(victim) == CHAINS * 4
        st = s.stats()
        assert victim not in s.keyring.tenants()
        assert victim not in st["tenants"]
        assert st["counters"]["nvme_damaged_deletes"] >= 1
        assert st["counters"]["nvme_commit_failures"] == 0
    finally:
        s.close()
    s = Store.open(_config(path))
    try:
        assert _served(s, victim) == 0
        for t in TENANTS:
            if t != victim:
                assert _served(s, t) == CHAINS * 4
    finally:
        s.close()


def test_recovery_deletes_past_a_damaged_page(tmp_path):
    """A tenant whose data key went before its blocks (a crash mid drop_tenant): the open that
    deletes them met the damaged page and raised lmdb.PageNotFoundError, at every open."""
    path = tmp_path / "s"
    _build(path)
    victim = _victim(path)
    env = lmdb.open(str(path / "nvme" / "keys"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"keys")) as txn:
        assert txn.delete(b"k" + victim.encode())
    env.close()
    _damage_leaf_of(path, victim)
    s = Store.open(_config(path))
    try:
        st = s.stats()
        assert st["counters"]["keyless_dropped"] == CHAINS * 4
        assert st["counters"]["nvme_damaged_deletes"] >= 1
        assert victim not in st["tenants"]
    finally:
        s.close()
    Store.open(_config(path)).close()


@pytest.mark.parametrize("where", ["header", "records"])
def test_a_damaged_page_at_open_is_refused_by_name_with_the_way_out(tmp_path, where):
    """Store.open raised LMDB's own error (MDB_INVALID "File is not an LMDB file" for a damaged
    header, MDB_PAGE_NOTFOUND from mdb_cursor_get for a damaged record page) with no advice."""
    path = tmp_path / "s"
    _build(path)
    if where == "header":  # the magic of both meta pages
        data_file = path / "nvme" / "data.mdb"
        data = bytearray(data_file.read_bytes())
        for meta in (0, 1):
            data[meta * PAGE + 16] ^= 0xFF
        data_file.write_bytes(data)
    else:
        _damage_branch_of(path, b"meta")
    for _ in range(2):  # the failed open let go of the directory and of the files
        with pytest.raises(IntegrityError, match=r"data.mdb is damaged .*restore it from a backup, "
                                                 r"or move .*nvme away"):
            Store.open(_config(path))



class _DamagedOnDelete:
    """A write transaction (of :class:`_DamagedEnv`) whose deletion of ``bad`` meets a damaged
    page, as a merge with a damaged neighbour does (the read-only look at ``bad`` does not meet
    it): LMDB refuses the transaction from then on (MDB_BAD_TXN)."""

    def __init__(self, txn: lmdb.Transaction, bad: bytes) -> None:
        self._txn, self._bad, self._spoiled = txn, bad, False

    def __getattr__(self, name: str) -> object:
        if self._spoiled:
            raise lmdb.BadTxnError("MDB_BAD_TXN: Transaction must abort")
        return getattr(self._txn, name)

    def delete(self, key: bytes, **kw: object) -> bool:
        if self._spoiled:
            raise lmdb.BadTxnError("MDB_BAD_TXN: Transaction must abort")
        if key == self._bad:
            self._spoiled = True
            raise lmdb.PageNotFoundError("mdb_del: MDB_PAGE_NOTFOUND: Requested page not found")
        return self._txn.delete(key, **kw)

    def commit(self) -> None:
        if self._spoiled:
            self._txn.abort()
            raise lmdb.BadTxnError("mdb_txn_commit: MDB_BAD_TXN: Transaction must abort")
        self._txn.commit()


class _DamagedEnv:
    def __init__(self, env: lmdb.Environment, bad: bytes) -> None:
        self._env, self._bad = env, bad

    def __getattr__(self, name: str) -> object:
        return getattr(self._env, name)

    def begin(self, **kw: object) -> object:
        txn = self._env.begin(**kw)
        return _DamagedOnDelete(txn, self._bad) if kw.get("write") else txn


def test_a_deletion_that_meets_a_damaged_page_fails_its_commit_once_and_is_not_made_again(tmp_path):
    """LMDB's own error escaped the deletion, and every later deletion of the transaction met
    MDB_BAD_TXN; the deletion was made again with every later write, failing them all."""
    path = tmp_path / "s"
    _build(path)
    s = Store.open(_config(path))
    try:
        nvme = s._nvme
        toks, _ = _chain("t1", 0)
        k1, k2, k3 = s.block_keys("t1", SPEC, toks)[:3]
        nvme._env = _DamagedEnv(nvme._env, tenant_prefix("t1") + k1)
        with pytest.raises(NVMeWriteFailed, match=r"a damaged page of .*data.mdb was met in it\): "
                                                  r"restore the file from a backup"), nvme.batch():
            assert nvme.delete_key("t1", k1)
            assert nvme.delete_key("t1", k2)  # after the damage: left to the failed commit
        assert nvme.deletions_pending == 1  # k2 only
        assert s.stats()["counters"]["nvme_damaged_deletes"] == 1
        assert nvme.delete_key("t1", k3)  # a later write commits, with k2's deletion
        assert nvme.deletions_pending == 0
        nvme._env = nvme._env._env
    finally:
        s.close()
    s = Store.open(_config(path))
    try:
        # k1 is whole in this fake, so it is back; k2 and k3 are gone
        assert s.get("t1", SPEC, s.block_keys("t1", SPEC, toks)).shape[0] == 1
        assert s.stats()["counters"].get("nvme_damaged_deletes", 0) == 0
    finally:
        s.close()


def test_a_put_into_a_damaged_page_says_so_and_others_go_on(damaged):
    """It raised LMDB's own error inside the batch, whose commit then failed as a full disk
    ("free some space there")."""
    from kvstore.errors import KVStoreError

    path, victim = damaged
    other = next(t for t in TENANTS if t != victim)
    s = Store.open(_config(path))
    try:
        failures = []
        for c in range(20):  # new chains of the victim: some land in its damaged leaf
            toks = list(range(500_000 + 1000 * c, 500_000 + 1000 * c + 4 * SPEC.block_tokens))
            try:
                s.put(victim, SPEC, s.block_keys(victim, SPEC, toks), _chain(victim, 0)[1])
            except KVStoreError as exc:
                failures.append(str(exc))
        assert failures
        assert all("damaged page" in f and "free some space" not in f for f in failures), failures[0]
        toks, kv = list(range(900_000, 900_000 + 4 * SPEC.block_tokens)), _chain(other, 9)[1]
        keys = s.block_keys(other, SPEC, toks)
        s.put(other, SPEC, keys, kv)
        assert torch.equal(s.get(other, SPEC, keys), kv)
    finally:
        s.close()
