"""Two Stores ("servers" A and B) sharing one remote tier (issue 8).

A prefix put through A is found by B's lookup (tier "remote") and served bit-exact by B's get,
for the same tenant only. Uses the Store integration: ``StoreConfig.remote``, write-through to the remote
queue, lookups continuing into the remote tier, promotion on hit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvstore.config import StoreConfig
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.remote_config import RemoteConfig

MASTER = bytes(range(32))
SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)


def test_prefix_put_on_a_is_served_by_b_same_tenant_only(tmp_path: Path, redis_ns) -> None:
    url, ns = redis_ns
    remote = RemoteConfig(urls=[url], namespace=ns)
    n = SPEC.block_nbytes

    def server(name: str) -> Store:
        cfg = StoreConfig(path=tmp_path / name, hbm_bytes=16 * n, dram_bytes=16 * n,
                          nvme_bytes=64 * n, master_key=MASTER, remote=remote,
                          remote_write="through")
        return Store.open(cfg)

    a, b = server("a"), server("b")
    try:
        tokens = list(range(8 * SPEC.block_tokens))
        keys = a.block_keys("acme", SPEC, tokens)
        kv = torch.randn((len(keys), *SPEC.block_shape),
                         generator=torch.Generator().manual_seed(1)).to(SPEC.torch_dtype)
        a.put("acme", SPEC, keys, kv)
        a.flush()  # write-through queue drained (Store.flush waits for the remote queue)

        assert b.block_keys("acme", SPEC, tokens) == keys  # same chain on every server
        found = b.lookup("acme", SPEC, keys)
        assert found.num_blocks == len(keys) and set(found.tiers) == {"remote"}
        got = b.get("acme", SPEC, keys)
        assert got.shape[0] == len(keys) and torch.equal(got, kv)
        assert b.lookup("acme", SPEC, keys).tiers[0] != "remote"  # promoted on hit
        assert b.stats()["counters"].get("hits_remote", 0) == len(keys)

        # another tenant finds nothing: neither its own chain nor acme's keys
        other = b.block_keys("globex", SPEC, tokens)
        assert b.lookup("globex", SPEC, other).num_blocks == 0
        assert b.lookup("globex", SPEC, keys).num_blocks == 0
        assert b.get("globex", SPEC, keys).shape[0] == 0
    finally:
        a.close()
        b.close()


def test_blocks_evicted_from_the_last_local_tier_are_demoted_to_remote(tmp_path: Path,
                                                                      redis_ns) -> None:
    url, ns = redis_ns
    n = SPEC.block_nbytes
    # NOTE: NVMe holds a chain of 3: a block goes there only with copies of its ancestors
    # (tests/test_nvme_closure15.py); with 2 none could, and every victim was dropped locally
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=2 * n, dram_bytes=2 * n, nvme_bytes=3 * n,
                      master_key=MASTER, remote=RemoteConfig(urls=[url], namespace=ns),
                      high_watermark=1.0, low_watermark=1.0)
    s = Store.open(cfg)
    try:
        chains = []
        for c in range(4):  # 12 blocks through 7 local slots: the oldest go remote
            toks = list(range(1000 * c, 1000 * c + 3 * SPEC.block_tokens))
            keys = s.block_keys("acme", SPEC, toks)
            kv = torch.randn((3, *SPEC.block_shape),
                             generator=torch.Generator().manual_seed(c)).to(SPEC.torch_dtype)
            s.put("acme", SPEC, keys, kv)
            chains.append((keys, kv))
        s.flush()
        st = s.stats()
        assert st["counters"].get("demotions_remote", 0) >= 6
        keys0, kv0 = chains[0]
        assert s.lookup("acme", SPEC, keys0).tiers == ["remote"] * 3
        assert torch.equal(s.get("acme", SPEC, keys0), kv0)  # bit-exact from Redis
        assert "remote" not in s.lookup("acme", SPEC, keys0).tiers[:1]  # promoted back
        # the tenant's remote values go with the tenant
        s.drop_tenant("acme")
        for keys, _ in chains:
            assert s.lookup("acme", SPEC, keys).num_blocks == 0
    finally:
        s.close()


def test_remote_delete_and_purge(tmp_path: Path, redis_ns) -> None:
    url, ns = redis_ns
    n = SPEC.block_nbytes
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=4 * n, dram_bytes=0, nvme_bytes=0,
                      master_key=MASTER, remote=RemoteConfig(urls=[url], namespace=ns),
                      remote_write="through")
    s = Store.open(cfg)
    try:
        keys = s.block_keys("acme", SPEC, list(range(3 * SPEC.block_tokens)))
        s.put("acme", SPEC, keys, torch.zeros((3, *SPEC.block_shape), dtype=torch.float16))
        s.flush()
        s.delete("acme", [keys[1]])
        # locally gone from block 1 on; remotely block 1 is gone too, so the chain stops there
        assert s.lookup("acme", SPEC, keys).tiers == ["hbm"]
        s.purge_model(SPEC.fingerprint)
        assert s.lookup("acme", SPEC, keys).num_blocks == 0
    finally:
        s.close()


def test_quantization_rules_apply_to_remote_copies(tmp_path: Path, redis_ns) -> None:
    """A tenant whose rule says int8 has its remote copies stored int8 (smaller), and another
    server restores them dequantized within the documented bound; other tenants stay exact."""
    from kernels.quant import QuantScheme, error_bound, quantize

    url, ns = redis_ns
    remote = RemoteConfig(urls=[url], namespace=ns)
    n = SPEC.block_nbytes

    def server(name: str) -> Store:
        return Store.open(StoreConfig(path=tmp_path / name, hbm_bytes=16 * n, dram_bytes=0,
                                      nvme_bytes=0, master_key=MASTER, remote=remote,
                                      remote_write="through"))

    a, b = server("a"), server("b")
    try:
        a.set_tenant_policy("lossy", quantization="int8")
        tokens = list(range(4 * SPEC.block_tokens))
        kv = torch.randn((4, *SPEC.block_shape),
                         generator=torch.Generator().manual_seed(3)).to(SPEC.torch_dtype)
        stored = []
        for tenant in ("exact", "lossy"):
            a.put(tenant, SPEC, a.block_keys(tenant, SPEC, tokens), kv)
            a.flush()
            stored.append(a._remote.metrics()["put_stored_bytes"] - sum(stored))
        assert stored[1] < 0.9 * stored[0]  # the int8 copies are smaller
        assert torch.equal(b.get("exact", SPEC, b.block_keys("exact", SPEC, tokens)), kv)
        lossy = b.get("lossy", SPEC, b.block_keys("lossy", SPEC, tokens))
        assert lossy.shape == kv.shape and not torch.equal(lossy, kv)
        bound = error_bound(kv.float(), quantize(kv.float(), QuantScheme.INT8))
        assert torch.all((lossy.float() - kv.float()).abs() <= bound + kv.float().abs() * 2**-10 + 1e-6)
    finally:
        a.close()
        b.close()


def test_a_tenants_remote_quota_bounds_what_it_holds_there(tmp_path: Path, redis_ns) -> None:
    """A quota on "remote" was accepted and ignored: a tenant with a 2-block quota held 12
    blocks there. The remote tier now refuses a tenant's write past it (written and queued
    bytes count); other tenants are not affected."""
    url, ns = redis_ns
    n = SPEC.block_nbytes
    cfg = StoreConfig(path=tmp_path / "q", hbm_bytes=4 * n, dram_bytes=0, nvme_bytes=0, master_key=MASTER,
                      remote=RemoteConfig(urls=[url], namespace=ns), remote_write="through")
    s = Store.open(cfg)
    try:
        s.set_tenant_policy("a", quota_bytes={"remote": 2 * n})
        for i in range(6):
            for tenant in ("a", "b"):
                keys = s.block_keys(tenant, SPEC, list(range(100 * i, 100 * i + 2 * SPEC.block_tokens)))
                s.put(tenant, SPEC, keys, torch.zeros((2, *SPEC.block_shape), dtype=SPEC.torch_dtype))
        s.flush()
        tenants = s.stats()["tenants"]
        assert 0 < tenants["a"]["remote"] <= 2 * n  # was 12 * n
        assert tenants["b"]["remote"] == 12 * n
        assert s.stats()["counters"]["remote_quota_rejected"] >= 10
    finally:
        s.close()
