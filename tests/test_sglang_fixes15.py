"""SGLang HiCache backend under decode context parallelism (DCP, SGLang 0.5.23's
``HiCacheStorageConfig.dcp_rank/dcp_size``): each DCP rank writes its own shard of an MLA page,
so each shard needs its own key (one key for all gave every rank the first shard written)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import service_harness
import sglang_wheel
import torch

try:
    API = sglang_wheel.load()
except sglang_wheel.WheelUnavailable as exc:
    pytest.skip(f"sglang wheel unavailable, HiCache DCP keys not checked: {exc}", allow_module_level=True)

from test_integration_sglang import _no_failure_injection, storage_config  # noqa: F401 (an autouse fixture)

from kvstore.errors import InvalidArgument
from kvstore.integrations import sglang as kv_sglang

PAGE_BYTES = 256
DCP_FIELDS = {"dcp_size": 2, "logical_page_size": 4}


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Any:
    sc = service_harness.start(tmp_path_factory.mktemp("sglang-dcp"))
    yield sc
    sc.stop()


def mla_config(extra: dict[str, Any], tp_rank: int, tp_size: int, **over: Any) -> Any:
    return storage_config(extra, tp_rank=tp_rank, tp_size=tp_size, is_mla_model=True,
                          model_name="deepseek-tiny", **over)


def dcp_backend(sidecar: Any, token: str, tp_rank: int, tp_size: int = 2) -> Any:
    extra = {"kvstore_target": sidecar.target, "kvstore_token": token, "kvstore_page_bytes": PAGE_BYTES,
             "kvstore_dtype": "bfloat16"}
    cfg = mla_config(extra, tp_rank, tp_size, dcp_rank=tp_rank % 2, **DCP_FIELDS)
    backend = API.StorageBackendFactory.create_backend("dynamic", cfg, None)
    sidecar.clients.append(backend.client)
    return backend


def test_each_dcp_rank_reads_back_its_own_shard(sidecar: Any) -> None:
    token = sidecar.admin().create_tenant("sglang-dcp")
    r0, r1 = dcp_backend(sidecar, token, 0), dcp_backend(sidecar, token, 1)
    assert r0.storage_config.is_storage_writer and r1.storage_config.is_storage_writer
    shard0 = torch.full((PAGE_BYTES // 2,), 1.0, dtype=torch.bfloat16)
    shard1 = torch.full((PAGE_BYTES // 2,), 2.0, dtype=torch.bfloat16)
    assert r0.set("page-h", shard0) and r1.set("page-h", shard1)
    assert r0._key("page-h") != r1._key("page-h")
    got0, got1 = r0.get("page-h"), r1.get("page-h")
    assert got0 is not None and torch.equal(got0, shard0)
    assert got1 is not None and torch.equal(got1, shard1)


def test_dcp_groups_share_shards_and_topologies_do_not() -> None:
    """TP 4 with DCP 2 is two DCP groups holding the same shards: rank 2 (DCP rank 0 of the
    second group, not a writer) reads the keys rank 0 writes. Another TP size or logical page size
    (other shard contents) is another key, as in SGLang's own file and Mooncake backends."""
    extra = {"kvstore_target": "unused:1", "kvstore_token": "t"}
    cfg = kv_sglang.KVStoreBackendConfig(target="unused:1", token="t")

    def spec(tp_rank: int, tp_size: int, page: int = 4) -> Any:
        sc = mla_config(extra, tp_rank, tp_size, dcp_rank=tp_rank % 2, dcp_size=2, logical_page_size=page)
        return kv_sglang.page_spec(cfg, sc, PAGE_BYTES, "bfloat16", "layer_first")

    assert not mla_config(extra, 2, 4, dcp_rank=0, **DCP_FIELDS).is_storage_writer
    assert spec(0, 4) == spec(2, 4) and spec(1, 4) == spec(3, 4)
    assert len({spec(0, 4), spec(1, 4), spec(0, 2), spec(0, 4, page=8)}) == 4


def test_configs_without_dcp_keep_their_keys() -> None:
    """Without DCP (dcp_size 1, or an SGLang release whose config has no DCP fields) the spec,
    and so every stored page's key, is what it was before DCP was handled."""
    cfg = kv_sglang.KVStoreBackendConfig(target="unused:1", token="t")
    for mla in (True, False):
        sc = storage_config({}, tp_rank=1, tp_size=2, is_mla_model=mla)
        old = SimpleNamespace(**{k: v for k, v in vars(sc).items()
                                 if k not in ("dcp_rank", "dcp_size", "logical_page_size")})
        want = "sglang-page:layer_first:pp0/1:cp0/1:mla=" + str(int(mla))
        for conf in (sc, old):
            spec = kv_sglang.page_spec(cfg, conf, PAGE_BYTES, "bfloat16", "layer_first")
            assert spec.layout == want and (spec.tp_rank, spec.tp_size) == ((0, 1) if mla else (1, 2))


def test_a_bad_dcp_shard_is_refused() -> None:
    cfg = kv_sglang.KVStoreBackendConfig(target="unused:1", token="t")
    sc = storage_config({}, is_mla_model=True)
    for rank, size in ((2, 2), (0, 0), ("0", 2)):
        bad = SimpleNamespace(**{**vars(sc), "dcp_rank": rank, "dcp_size": size})
        with pytest.raises(InvalidArgument, match="dcp_rank"):
            kv_sglang.page_spec(cfg, bad, PAGE_BYTES, "bfloat16", "flat")
