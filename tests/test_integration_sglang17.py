"""SGLang HiCache backend: the hybrid-pool (``*_v2``) verbs and the other hooks SGLang 0.5.23 calls.

SGLang 0.5.23 runs every HiCache model through ``HybridCacheController``. When the model has
pools beside its KV pool (the DSA indexer, Mamba/SWA state, a speculative draft KV pool), the
controller registers them with ``register_mem_host_pool_v2`` and calls ``batch_exists_v2`` (hit
query), ``batch_get_v2`` (prefetch, KV-derived pools from ``_page_transfer_kv_batch``) and
``batch_set_v2`` (backup, before the KV pages). ``HiCacheStorage`` raises NotImplementedError
there: in the backup thread that exception skipped the KV write too, so nothing reached kvstore.
``get_stats`` feeds SGLang's storage metrics on the scheduler thread, which sets an attribute on
what it returns (a dict raised AttributeError) and asserts a ``StorageMetrics``.
Run against the real classes of the ``sglang`` wheel (see ``sglang_wheel``)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import sglang_fixtures
import sglang_wheel
import torch

try:
    API = sglang_wheel.load()
except sglang_wheel.WheelUnavailable as exc:
    pytest.skip(f"sglang wheel unavailable, HiCache conformance not checked: {exc}", allow_module_level=True)

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.integrations import sglang as kv_sglang

sidecar, _no_failure_injection = sglang_fixtures.sidecar, sglang_fixtures._no_failure_injection

HS: Any = sys.modules["sglang.srt.mem_cache.hicache_storage"]  # the wheel's module
PoolName, PoolTransfer, PoolHitPolicy = HS.PoolName, HS.PoolTransfer, HS.PoolHitPolicy
DYNAMIC = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
           "class_name": "KVStoreHiCacheStorage"}
PAGE = 4  # tokens per page


@pytest.fixture(scope="module")
def token(sidecar: Any) -> str:
    return sidecar.admin().create_tenant("sglang17")


class HostPool:
    """Test double of an SGLang host pool (the real ones need CUDA): the members the storage
    paths use. Each token row holds ``row`` elements of ``dtype``; a page is ``PAGE`` rows."""

    layout = "layer_first"
    page_size = PAGE

    def __init__(self, tokens: int, row: int, dtype: torch.dtype, seed: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed or 0)
        if seed is None:
            self.buf = torch.zeros(tokens, row, dtype=dtype)
        elif dtype == torch.uint8:
            self.buf = torch.randint(0, 256, (tokens, row), generator=g, dtype=torch.uint8)
        else:
            self.buf = torch.randn(tokens, row, generator=g).to(dtype)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE * self.buf.shape[1], dtype=self.buf.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.buf[index : index + PAGE].flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.buf[index : index + PAGE] = data_page.reshape(PAGE, -1)

    def page(self, i: int) -> torch.Tensor:
        return self.buf[i * PAGE : (i + 1) * PAGE]


def pools(seed: int | None) -> dict[Any, HostPool]:
    """A DSA-like stack: bf16 KV, an fp8 indexer stored as uint8 (KV-derived) and Mamba state."""
    return {PoolName.KV: HostPool(8 * PAGE, 64, torch.bfloat16, seed),
            PoolName.INDEXER: HostPool(8 * PAGE, 33, torch.uint8, None if seed is None else seed + 1),
            PoolName.MAMBA: HostPool(8 * PAGE, 24, torch.float32, None if seed is None else seed + 2)}


def attach(sidecar: Any, token: str, host: dict[Any, HostPool], **over: Any) -> Any:
    """A backend built and registered as HybridCacheController.attach_storage_backend does."""
    fields = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
              "is_mla_model": False, "enable_storage_metrics": False, "is_page_first_layout": False,
              "model_name": "test/dsa-tiny",
              "extra_config": {**DYNAMIC, "kvstore_target": sidecar.target, "kvstore_token": token}}
    fields.update(over)
    backend = API.StorageBackendFactory.create_backend("dynamic", API.HiCacheStorageConfig(**fields), None)
    sidecar.clients.append(backend.client)
    backend.register_mem_pool_host(host[PoolName.KV])
    for name, pool in host.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def idx(pages: range) -> torch.Tensor:
    return torch.arange(pages.start * PAGE, pages.stop * PAGE)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- conformance ----------------------------------------------------------------------------------
def test_backend_overrides_every_v2_verb_of_the_wheel() -> None:
    cls = kv_sglang.KVStoreHiCacheStorage
    for verb in ("batch_exists_v2", "batch_get_v2", "batch_set_v2", "register_mem_host_pool_v2",
                 "batch_get_v1", "batch_set_v1", "get_stats", "clear"):
        assert getattr(cls, verb) is not getattr(API.HiCacheStorage, verb), verb


# -- the hybrid path, as the controller drives it -------------------------------------------------
def test_backup_then_prefetch_of_kv_derived_and_state_pools_bit_exact(sidecar: Any, token: str) -> None:
    src = pools(seed=1)
    writer = attach(sidecar, token, src)
    keys = [f"dsa-{i}" for i in range(3)]
    # _page_backup_with_stable_layout: the side pools first (v2), then the KV pages (v1 here)
    wrote = writer.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=idx(range(1, 4)), keys=keys,
                                              indices_from_pool=PoolName.KV),
                                 PoolTransfer(name=PoolName.MAMBA, host_indices=idx(range(3, 4)), keys=keys[2:],
                                              hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert wrote == {PoolName.INDEXER: [True] * 3, PoolName.MAMBA: [True]}
    assert writer.batch_set_v1(keys, idx(range(1, 4))) == [True] * 3

    dst = pools(seed=None)
    reader = attach(sidecar, token, dst)
    hit = reader.batch_exists_v2(keys + ["dsa-missing"], [
        PoolTransfer(name=PoolName.INDEXER, indices_from_pool=PoolName.KV),
        PoolTransfer(name=PoolName.MAMBA, hit_policy=PoolHitPolicy.TRAILING_PAGES, keys=keys[2:])])
    assert isinstance(hit, HS.PoolTransferResult)
    assert hit.kv_hit_pages == 3 and hit.restorable_prefix_pages == [3]  # the state exists at page 3 only
    assert hit.extra_pool_hit_pages == {PoolName.KV: 3, PoolName.INDEXER: 3, PoolName.MAMBA: 3}

    # _page_transfer_kv_batch: KV pages, then the KV-derived pools at the KV host indices
    assert reader.batch_get_v1(keys, idx(range(3))) == [True] * 3
    got = reader.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=idx(range(3)), keys=keys)])
    assert HS.count_pool_hits(got) == {PoolName.INDEXER: 3}
    got = reader.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=idx(range(5, 6)), keys=keys[2:])])
    assert got == {PoolName.MAMBA: [True]}
    for i in range(3):
        assert same(dst[PoolName.KV].page(i), src[PoolName.KV].page(i + 1))
        assert same(dst[PoolName.INDEXER].page(i), src[PoolName.INDEXER].page(i + 1))
    assert same(dst[PoolName.MAMBA].page(5), src[PoolName.MAMBA].page(3))


def test_a_missing_side_page_shortens_the_hit(sidecar: Any, token: str) -> None:
    src = pools(seed=2)
    writer = attach(sidecar, token, src)
    keys = [f"short-{i}" for i in range(4)]
    assert all(writer.batch_set_v1(keys, idx(range(4))))
    assert writer.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=idx(range(2)), keys=keys[:2])])
    hit = writer.batch_exists_v2(keys, [PoolTransfer(name=PoolName.INDEXER)])
    assert hit.kv_hit_pages == 2 and hit.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.INDEXER: 2}
    got = writer.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=idx(range(4, 8)), keys=keys)])
    assert got == {PoolName.INDEXER: [True, True, False, False]}
    # pages of the KV pool and of a side pool under one SGLang key are distinct blocks
    assert writer.batch_exists_v2(["only-indexer"], [PoolTransfer(name=PoolName.INDEXER)]).kv_hit_pages == 0
    assert writer.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=idx(range(1)),
                                             keys=["only-indexer"])])
    assert not writer.exists("only-indexer")


def test_mla_shares_kv_derived_pages_across_tp_ranks_but_not_mamba_state(sidecar: Any, token: str) -> None:
    mla = {"is_mla_model": True, "tp_size": 2}
    rank0 = attach(sidecar, token, pools(seed=3), tp_rank=0, **mla)
    rank1 = attach(sidecar, token, pools(seed=None), tp_rank=1, **mla)
    keys = ["mla-0"]
    assert rank0.batch_set_v2([PoolTransfer(name=name, host_indices=idx(range(1)), keys=keys)
                               for name in (PoolName.INDEXER, PoolName.MAMBA)])
    assert rank0.batch_set_v1(keys, idx(range(1))) == [True]
    got = rank1.batch_get_v2([PoolTransfer(name=name, host_indices=idx(range(1)), keys=keys)
                              for name in (PoolName.INDEXER, PoolName.MAMBA)])
    assert got == {PoolName.INDEXER: [True], PoolName.MAMBA: [False]}  # each TP rank holds its own state shard


class OddStatePool(HostPool):
    """A state pool whose pages are 3 bytes: kvstore blocks are whole K/V pairs (even sizes)."""

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(3, dtype=torch.uint8)


class NoFlatPagesPool(HostPool):
    """As SGLang's MXFP8 host pool: no flat pages for L3 storage."""

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        raise NotImplementedError("MXFP8 KV host pool does not expose flat storage (L3) pages yet")


@pytest.mark.parametrize(("pool", "why"), [(OddStatePool(8, 1, torch.uint8), "3 bytes"),
                                           (NoFlatPagesPool(8, 1, torch.uint8), "MXFP8")])
def test_a_pool_kvstore_cannot_hold_is_refused_at_registration(sidecar: Any, token: str, pool: HostPool,
                                                               why: str) -> None:
    host = pools(seed=None)
    host[PoolName.SWA] = HostPool(8, 1, torch.uint8)  # pages of 4 bytes: fine
    host[PoolName.DRAFT] = pool
    with pytest.raises(InvalidArgument, match=f"'draft'.*{why}"):
        attach(sidecar, token, host)


def test_transfers_of_an_unregistered_pool_are_refused(sidecar: Any, token: str) -> None:
    host = pools(seed=None)
    del host[PoolName.MAMBA]
    backend = attach(sidecar, token, host)
    with pytest.raises(InvalidArgument, match="mamba"):
        backend.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=idx(range(1)), keys=["k"])])


def test_a_failing_sidecar_costs_one_call_per_v2_batch_and_gives_misses(sidecar: Any, token: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    backend = attach(sidecar, token, pools(seed=4))
    keys = [f"down-{i}" for i in range(3)]
    assert all(backend.batch_set_v1(keys, idx(range(3))))
    calls = []

    def down(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        raise Unavailable("sidecar down")

    for verb in ("get_into", "put_bytes", "lookup", "get_roots_into", "lookup_roots"):
        monkeypatch.setattr(backend.client, verb, down)
    both = (PoolName.INDEXER, PoolName.MAMBA)
    got = backend.batch_get_v2([PoolTransfer(name=n, host_indices=idx(range(3)), keys=keys) for n in both])
    assert got == {PoolName.INDEXER: [False] * 3, PoolName.MAMBA: [False] * 3} and len(calls) == 1
    put = backend.batch_set_v2([PoolTransfer(name=n, host_indices=idx(range(3)), keys=keys) for n in both])
    assert put == {PoolName.INDEXER: [False] * 3, PoolName.MAMBA: [False] * 3} and len(calls) <= 2
    hit = backend.batch_exists_v2(keys, [PoolTransfer(name=n) for n in both])
    assert hit.kv_hit_pages == 0 and len(calls) <= 3


# -- the other hooks ------------------------------------------------------------------------------
def test_get_stats_is_safe_for_sglangs_storage_metrics(sidecar: Any, token: str) -> None:
    backend = attach(sidecar, token, pools(seed=None))
    # UnifiedRadixCache (0.5.23) on the scheduler thread, with storage metrics enabled:
    metrics = backend.get_stats()
    if metrics is not None:
        if not hasattr(metrics, "prefetch_stats"):
            metrics.prefetch_stats = {}
        for name in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
            assert isinstance(getattr(metrics, name), list)


def test_clear_says_it_keeps_the_pages(sidecar: Any, token: str, caplog: pytest.LogCaptureFixture) -> None:
    backend = attach(sidecar, token, pools(seed=5))
    assert backend.batch_set_v1(["kept"], idx(range(1))) == [True]
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.sglang"):
        assert backend.clear() is False
    assert backend.exists("kept") and "not cleared" in caplog.text
