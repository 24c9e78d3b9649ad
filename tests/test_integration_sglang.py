"""SGLang HiCache backend: conformance against the real ``HiCacheStorage`` / ``StorageBackendFactory``
of the ``sglang`` wheel (unpacked by ``sglang_wheel``; the engine is never imported), and bit-exact
round trips against a live sidecar."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sglang_fixtures
import sglang_wheel
import torch

try:
    API = sglang_wheel.load()
except sglang_wheel.WheelUnavailable as exc:
    pytest.skip(f"sglang wheel unavailable, HiCache conformance not checked: {exc}", allow_module_level=True)

from kvstore.errors import InvalidArgument
from kvstore.integrations import sglang as kv_sglang

sidecar, _no_failure_injection = sglang_fixtures.sidecar, sglang_fixtures._no_failure_injection

LAYERS, PAGE, HEADS, DIM = 2, 4, 2, 8
PAGE_SHAPE = (2, LAYERS, PAGE, HEADS, DIM)  # SGLang's flat MHA data page, layer_first
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * DIM * 2  # bfloat16
DYNAMIC = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
           "class_name": "KVStoreHiCacheStorage"}


def storage_config(extra: dict[str, Any], **over: Any) -> Any:
    fields = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
              "is_mla_model": False, "enable_storage_metrics": False, "is_page_first_layout": False,
              "model_name": "test/llama-tiny", "extra_config": {**DYNAMIC, **extra}}
    fields.update(over)
    return API.HiCacheStorageConfig(**fields)


def create(sidecar: Any, token: str, **extra: Any) -> Any:
    """A backend made by SGLang's factory through its dynamic-backend path."""
    cfg = storage_config({"kvstore_target": sidecar.target, "kvstore_token": token, **extra})
    backend = API.StorageBackendFactory.create_backend("dynamic", cfg, None)
    sidecar.clients.append(backend.client)
    return backend


@pytest.fixture(scope="module")
def token(sidecar: Any) -> str:
    return sidecar.admin().create_tenant("sglang-a")


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(PAGE_SHAPE, generator=g).to(torch.bfloat16).flatten() for _ in range(n)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- conformance ----------------------------------------------------------------------------------
def test_backend_is_a_complete_subclass_of_the_wheels_hicache_storage() -> None:
    cls = kv_sglang.KVStoreHiCacheStorage
    assert issubclass(cls, API.HiCacheStorage)
    assert cls.__abstractmethods__ == frozenset()
    assert sys.modules["sglang.srt.mem_cache.hicache_storage"].__file__.startswith(str(API.root))


def test_kvstore_imports_without_sglang() -> None:
    code = ("import sys, kvstore.integrations.sglang as m; assert 'sglang' not in sys.modules; "
            "assert callable(m.hicache_storage_class)")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)


def test_factory_dynamic_path_builds_the_backend(sidecar: Any, token: str) -> None:
    backend = create(sidecar, token, kvstore_page_bytes=PAGE_BYTES, kvstore_dtype="bfloat16")
    assert type(backend) is kv_sglang.KVStoreHiCacheStorage
    assert isinstance(backend, API.HiCacheStorage)
    assert backend.spec.block_nbytes == PAGE_BYTES and backend.spec.dtype == "bfloat16"


def test_factory_reports_a_backend_without_target(sidecar: Any) -> None:
    cfg = storage_config({"kvstore_page_bytes": PAGE_BYTES})
    with pytest.raises(InvalidArgument, match="kvstore_target"):
        API.StorageBackendFactory.create_backend("dynamic", cfg, None)


# -- round trips ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shared_memory", [None, False], ids=["auto-shm", "streams"])
def test_set_get_exists_round_trip_bit_exact(sidecar: Any, token: str, shared_memory: bool | None) -> None:
    backend = create(sidecar, token, kvstore_page_bytes=PAGE_BYTES, kvstore_dtype="bfloat16",
                     kvstore_shared_memory=shared_memory)
    (page,) = pages(1, seed=1)
    key = f"page-{shared_memory}"
    assert not backend.exists(key)
    assert backend.get(key) is None
    assert backend.set(key, page) is True
    assert backend.client.uses_shared_memory is (shared_memory is None)  # registered at the first get
    assert backend.exists(key)
    fresh = backend.get(key)
    assert fresh is not None and fresh.dtype == torch.bfloat16 and same_bits(fresh, page)
    target = torch.zeros_like(page)
    assert backend.get(key, target) is target and same_bits(target, page)
    assert backend.set(key, page) is True  # setting an existing page again is a no-op success


def test_batch_round_trip_and_leading_exists_count(sidecar: Any, token: str) -> None:
    backend = create(sidecar, token, kvstore_page_bytes=PAGE_BYTES, kvstore_dtype="bfloat16")
    keys = [f"batch-{i}" for i in range(5)]
    values = pages(5, seed=2)
    assert backend.batch_set(keys, values) is True
    targets = [torch.empty_like(v) for v in values]
    got = backend.batch_get(keys, targets)
    assert all(g is t for g, t in zip(got, targets))
    assert all(same_bits(g, v) for g, v in zip(got, values))
    assert backend.batch_exists(keys) == 5
    assert backend.batch_exists(keys[:3] + ["batch-missing"] + keys[3:]) == 3
    assert backend.batch_exists(["batch-missing", *keys]) == 0
    assert backend.batch_get(["batch-missing", keys[0]])[0] is None
    assert backend.delete(keys[2]) and backend.batch_exists(keys) == 2


def test_get_into_a_non_contiguous_target(sidecar: Any, token: str) -> None:
    backend = create(sidecar, token, kvstore_page_bytes=PAGE_BYTES, kvstore_dtype="bfloat16")
    (page,) = pages(1, seed=3)
    assert backend.set("strided", page)
    target = torch.zeros(2 * page.numel(), dtype=torch.bfloat16)[::2]
    assert not target.is_contiguous()
    assert backend.get("strided", target) is target and same_bits(target, page)


def test_wrong_page_size_is_refused(sidecar: Any, token: str) -> None:
    backend = create(sidecar, token, kvstore_page_bytes=PAGE_BYTES, kvstore_dtype="bfloat16")
    with pytest.raises(InvalidArgument, match="bytes"):
        backend.set("short", torch.zeros(3, dtype=torch.bfloat16))


def test_tenants_do_not_share_pages(sidecar: Any, token: str) -> None:
    a = create(sidecar, token, kvstore_page_bytes=PAGE_BYTES, kvstore_dtype="bfloat16")
    b = create(sidecar, sidecar.admin().create_tenant("sglang-b"), kvstore_page_bytes=PAGE_BYTES,
               kvstore_dtype="bfloat16")
    (page,) = pages(1, seed=4)
    assert a.set("shared-name", page)
    assert a.exists("shared-name") and not b.exists("shared-name")


def test_page_keys_are_deterministic_and_separate_specs(sidecar: Any, token: str) -> None:
    a = create(sidecar, token, kvstore_page_bytes=PAGE_BYTES, kvstore_dtype="bfloat16")
    b = create(sidecar, token, kvstore_page_bytes=PAGE_BYTES, kvstore_dtype="bfloat16", kvstore_model="other")
    want = hashlib.blake2b(a.spec.fingerprint + b"k1", digest_size=32, person=b"kvstore-sglang1").digest()
    assert kv_sglang.page_key(a.spec, "k1") == want
    assert kv_sglang.page_key(b.spec, "k1") != want
    (page,) = pages(1, seed=5)
    assert a.set("k1", page) and not b.exists("k1")


# -- host-pool (v1) variants ----------------------------------------------------------------------
class LayerFirstHostPool:
    """Test double of SGLang's MHA host pool (the real one needs CUDA): the four members the
    v1 paths use, with SGLang's layer_first flat-page layout ``[2, L, page_size, H, D]``."""

    layout = "layer_first"

    def __init__(self, tokens: int, seed: int | None = None) -> None:
        self.page_size = PAGE
        g = torch.Generator().manual_seed(seed or 0)
        shape = (2, LAYERS, tokens, HEADS, DIM)
        self.kv_buffer = (torch.randn(shape, generator=g) if seed is not None else torch.zeros(shape)).to(torch.bfloat16)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE_SHAPE, dtype=torch.bfloat16).flatten()

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + self.page_size]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index : index + self.page_size] = data_page.reshape(PAGE_SHAPE)


def test_v1_host_pool_round_trip_with_spec_from_the_pool(sidecar: Any, token: str) -> None:
    writer = create(sidecar, token)  # no kvstore_page_bytes: geometry comes from the host pool
    src = LayerFirstHostPool(tokens=4 * PAGE, seed=6)
    writer.register_mem_pool_host(src)
    assert writer.spec.block_nbytes == PAGE_BYTES and writer.spec.dtype == "bfloat16"
    keys = ["v1-a", "v1-b", "v1-c"]
    idx = torch.arange(PAGE, 4 * PAGE)  # pages 1..3 of the source pool
    assert writer.batch_set_v1(keys, idx) == [True, True, True]

    reader = create(sidecar, token)
    dst = LayerFirstHostPool(tokens=4 * PAGE)
    reader.register_mem_pool_host(dst)
    out_idx = torch.arange(0, 3 * PAGE)
    assert reader.batch_get_v1(["v1-a", "v1-missing", "v1-c"], out_idx) == [True, False, True]
    assert same_bits(dst.kv_buffer[:, :, 0:PAGE], src.kv_buffer[:, :, PAGE : 2 * PAGE])
    assert torch.count_nonzero(dst.kv_buffer[:, :, PAGE : 2 * PAGE]) == 0
    assert same_bits(dst.kv_buffer[:, :, 2 * PAGE : 3 * PAGE], src.kv_buffer[:, :, 3 * PAGE : 4 * PAGE])
    assert reader.batch_exists(keys) == 3


def test_backend_without_page_size_refuses_io(sidecar: Any, token: str) -> None:
    backend = create(sidecar, token)
    with pytest.raises(InvalidArgument, match="page size unknown"):
        backend.exists("anything")


# -- options and a sidecar that does not answer ---------------------------------------------------
def test_options_are_typed_and_the_timeout_reaches_the_client(sidecar: Any, token: str) -> None:
    backend = create(sidecar, token, kvstore_page_bytes=str(PAGE_BYTES), kvstore_timeout_s="2.5")
    assert backend.client.timeout == 2.5 and backend.spec.block_nbytes == PAGE_BYTES
    assert create(sidecar, token, kvstore_page_bytes=PAGE_BYTES).client.timeout == 10.0  # the default
    for bad in ({"kvstore_timeout_s": "soon"}, {"kvstore_timeout_s": 0}, {"kvstore_timeout_s": float("nan")},
                {"kvstore_ttl_s": -1}, {"kvstore_page_bytes": "big"}, {"kvstore_page_bytes": 1.5},
                {"kvstore_shared_memory": "false"}):
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            create(sidecar, token, **bad)


def test_a_sidecar_that_does_not_answer_costs_one_timeout_then_misses() -> None:
    """A listening socket that never speaks gRPC stands in for a hung sidecar: every verb
    returns a miss or a failure (logged) instead of raising into SGLang's cache threads, and
    a batch gives up after its first timeout instead of waiting once per page."""
    import socket
    import time

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        cfg = storage_config({"kvstore_target": f"127.0.0.1:{hung.getsockname()[1]}", "kvstore_token": "t",
                              "kvstore_page_bytes": PAGE_BYTES, "kvstore_timeout_s": 0.3})
        backend = API.StorageBackendFactory.create_backend("dynamic", cfg, None)
        try:
            assert not backend.client.uses_shared_memory  # it registers at its first put or get
            keys = [f"page-{i}" for i in range(8)]
            t0 = time.monotonic()
            assert backend.batch_get(keys) == [None] * 8
            assert backend.batch_exists(keys) == 0
            assert backend.batch_set(keys, pages(8, seed=1)) is False
            assert backend.get("page-0") is None and backend.exists("page-0") is False
            # one timeout each (5 calls): per page, the batches alone would take 24
            assert time.monotonic() - t0 < 12 * 0.3
        finally:
            backend.close()


# -- the host pool fixes the page geometry ------------------------------------------------------
def test_page_dtype_comes_from_the_host_pool_when_page_bytes_is_set(sidecar: Any, token: str) -> None:
    backend = create(sidecar, token, kvstore_page_bytes=PAGE_BYTES)  # no kvstore_dtype
    backend.register_mem_pool_host(LayerFirstHostPool(tokens=4 * PAGE))  # a bfloat16 pool
    assert backend.spec.dtype == "bfloat16"
    (page,) = pages(1, seed=9)
    assert backend.set("pool-dtype", page)
    got = backend.get("pool-dtype")
    assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got, page)
    from_pool = create(sidecar, token)  # no page size either: all from the pool, same spec
    from_pool.register_mem_pool_host(LayerFirstHostPool(tokens=4 * PAGE))
    assert from_pool.spec == backend.spec and from_pool.exists("pool-dtype")


@pytest.mark.parametrize(("extra", "key"), [({"kvstore_page_bytes": 2 * PAGE_BYTES}, "kvstore_page_bytes"),
                                            ({"kvstore_page_bytes": PAGE_BYTES, "kvstore_dtype": "float16"},
                                             "kvstore_dtype"),
                                            ({"kvstore_dtype": "float32"}, "kvstore_dtype")])
def test_settings_that_disagree_with_the_host_pool_are_refused_at_registration(
        sidecar: Any, token: str, extra: dict[str, Any], key: str) -> None:
    backend = create(sidecar, token, **extra)
    with pytest.raises(InvalidArgument, match=key):
        backend.register_mem_pool_host(LayerFirstHostPool(tokens=4 * PAGE))
