"""A store reopened with a lower nvme_bytes than its NVMe file already holds still writes.

The LMDB map was sized from the new capacity alone, smaller than the file: every put that had
to evict (a write) failed with NVMeWriteFailed (MDB_MAP_FULL, "free some space there or lower
nvme_bytes", with the disk nearly empty and nvme_bytes just lowered), and so did close."""

from __future__ import annotations

import torch

from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers import nvme

SPEC = ModelSpec(model="m", revision="r", num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                 block_tokens=64)  # 64 KiB blocks


def _put(s: Store, tenant: str, base: int, n: int) -> None:
    tokens = list(range(base, base + n * SPEC.block_tokens))
    s.put(tenant, SPEC, s.block_keys(tenant, SPEC, tokens), torch.randn((n, *SPEC.block_shape)).to(SPEC.torch_dtype))


def test_lowering_nvme_bytes_below_the_file_keeps_the_store_writable(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme, "MAP_HEADROOM", 8 << 20)  # the map's slack made small, as the file is
    monkeypatch.setattr(nvme, "MAP_FLOOR", 1 << 20)

    def cfg(nvme_bytes: int) -> StoreConfig:
        return StoreConfig(path=tmp_path, hbm_bytes=0, dram_bytes=0, nvme_bytes=nvme_bytes,
                           master_key=bytes(range(32)), durable=False, encrypt=False)
    s = Store.open(cfg(24 << 20))
    for i in range(4):
        _put(s, f"t{i}", i * 10**6, 64)  # 16 MiB
    s.close()
    assert (tmp_path / "nvme" / "data.mdb").stat().st_size > 12 << 20

    s = Store.open(cfg(2 << 20))  # the operator lowers nvme_bytes: 2 MiB < the file
    for i in range(3):
        _put(s, "new", 10**8 + i * 10**5, 8)  # each evicts: writes
    assert s.stats()["tiers"]["nvme"]["used_bytes"] <= 2 << 20
    s.close()
    s = Store.open(cfg(2 << 20))
    assert s.stats()["tiers"]["nvme"]["blocks"] > 0
    s.close()
