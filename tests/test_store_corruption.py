"""Damaged NVMe values are misses, are deleted and are counted — never wrong bytes."""

import lmdb
import pytest
import torch
from conftest import make_kv, tokens


def _damage(path, how):
    env = lmdb.open(str(path / "nvme"), max_dbs=8)
    db = env.open_db(b"blocks")
    with env.begin(write=True, db=db) as txn:
        items = [(bytes(k), bytes(v)) for k, v in txn.cursor()]
        how(txn, items)
    env.close()
    return items


def _store_with_blocks(open_store, spec, path, n=6):
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=32, path=path)
    chains = []
    for c in range(3):
        keys = s.block_keys("a", spec, tokens(n // 3, spec, start=1000 * c))
        kv = make_kv(spec, len(keys), seed=c)
        s.put("a", spec, keys, kv)
        chains.append((keys, kv))
    s.close()
    return chains


@pytest.mark.parametrize("where", ["header", "middle", "tag", "truncate", "empty", "swap"])
def test_damaged_values_are_misses(open_store, spec, tmp_path, where):
    path = tmp_path / "s"
    chains = _store_with_blocks(open_store, spec, path)

    def how(txn, items):
        for k, v in items:
            if where == "header":
                v = v[:5] + bytes([v[5] ^ 0x01]) + v[6:]
            elif where == "middle":
                i = len(v) // 2
                v = v[:i] + bytes([v[i] ^ 0x80]) + v[i + 1:]
            elif where == "tag":
                v = v[:-1] + bytes([v[-1] ^ 0xFF])
            elif where == "truncate":
                v = v[: len(v) - 7]
            elif where == "empty":
                v = b""
            elif where == "swap":  # every value replaced by another block's value
                v = dict(items)[items[(items.index((k, v)) + 1) % len(items)][0]]
            txn.put(k, v)

    _damage(path, how)
    s = open_store(spec, hbm_blocks=2, dram_blocks=2, nvme_blocks=32, path=path)
    for keys, _kv in chains:
        out = s.get("a", spec, keys)
        assert out.shape[0] == 0  # the first block is damaged: nothing is served
        assert s.lookup("a", spec, keys).num_blocks == 0  # deleted, with its dependants
    assert s.stats()["integrity_failures"] == len(chains)


def test_one_damaged_block_cuts_the_prefix_there(open_store, spec, tmp_path):
    path = tmp_path / "s"
    chains = _store_with_blocks(open_store, spec, path, n=12)
    keys, kv = chains[1]
    from tiers.nvme import tenant_prefix
    dbkey = tenant_prefix("a") + keys[2]  # the NVMe tier's documented key layout

    def how(txn, items):
        v = txn.get(dbkey)
        txn.put(dbkey, v[:-40] + bytes(40))

    _damage(path, how)
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=32, path=path)
    out = s.get("a", spec, keys)
    assert out.shape[0] == 2 and torch.equal(out, kv[:2])
    assert s.stats()["integrity_failures"] == 1
    for other_keys, other_kv in (chains[0], chains[2]):
        assert torch.equal(s.get("a", spec, other_keys), other_kv)


def test_wrong_master_key_serves_nothing(open_store, spec, tmp_path):
    path = tmp_path / "s"
    _store_with_blocks(open_store, spec, path)
    from kvstore.config import StoreConfig
    from kvstore.errors import KVStoreError
    from kvstore.store import Store
    cfg = StoreConfig(path=path, hbm_bytes=0, dram_bytes=0, nvme_bytes=32 * spec.block_nbytes,
                      master_key=b"\x01" * 32)
    with pytest.raises(KVStoreError, match="master key"):
        Store.open(cfg)


@pytest.mark.parametrize("which", ["nvme", "nvme/keys"])
def test_a_truncated_lmdb_file_is_refused_by_name_not_a_sigbus(open_store, spec, tmp_path, which):
    """A data file cut short (a bad restore) killed the process with SIGBUS at the first read."""
    import os

    from kvstore.errors import IntegrityError

    path = tmp_path / "t"
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=64, path=path)
    s.put("a", spec, s.block_keys("a", spec, tokens(48, spec)), make_kv(spec, 48))
    s.close()
    data = path / which / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    for _ in range(2):  # the failed open let go of the directory: the second fails the same way
        with pytest.raises(IntegrityError, match=f"{data} is .* bytes, but its last commit uses"):
            open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=64, path=path)


@pytest.mark.parametrize("what", ["spec", "record"])
def test_blocks_whose_record_or_spec_cannot_be_read_are_dropped_at_open(open_store, spec, tmp_path, what):
    """A block whose model spec (or its own record) cannot be read was kept on disk and
    counted against nvme_bytes, but was in no index, so nothing ever evicted or deleted it:
    capacity lost for good. It is now deleted at open and counted."""
    path = tmp_path / "s"
    chains = _store_with_blocks(open_store, spec, path)
    env = lmdb.open(str(path / "nvme"), max_dbs=8)
    meta, specs, blocks = (env.open_db(name) for name in (b"meta", b"specs", b"blocks"))
    if what == "spec":  # another model's spec, unreadable (a newer writer, or damage)
        with env.begin(write=True) as txn:
            txn.put(b"\xee" * 16, b"{not json", db=specs)
            k, raw = next(iter(txn.cursor(db=meta)))
            rec = bytearray(raw)
            fp_at = bytes(raw).index(spec.fingerprint)
            rec[fp_at:fp_at + len(spec.fingerprint)] = b"\xee" * len(spec.fingerprint)
            txn.put(k, bytes(rec), db=meta)
    else:
        with env.begin(write=True) as txn:
            k, _ = next(iter(txn.cursor(db=meta)))
            txn.put(k, b"\x01", db=meta)
    env.close()
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=32, path=path)
    st = s.stats()
    assert st["counters"]["unreadable_dropped"] == 1
    held = sum(s.lookup("a", spec, keys).num_blocks for keys, _ in chains)
    assert held < 6
    assert st["tiers"]["nvme"]["used_bytes"] == st["tiers"]["nvme"]["blocks"] * spec.block_nbytes
    s.close()
    env = lmdb.open(str(path / "nvme"), max_dbs=8)
    meta, blocks = env.open_db(b"meta"), env.open_db(b"blocks")
    with env.begin() as txn:
        assert txn.get(k, db=blocks) is None and txn.get(k, db=meta) is None
    env.close()
