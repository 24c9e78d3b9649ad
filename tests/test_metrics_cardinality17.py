"""The metrics endpoint's tenant labels are bounded, and a deleted tenant's series go.

Before: every tenant that ever looked up, was served, was refused by its quota or held bytes
had its own ``tenant`` label value (and ``resource="quota:TENANT:TIER"``) for as long as the
sidecar ran, ~9 series each: 50,000 tenants made 450,019 samples, a 32 MB scrape taking 7 s
(``ServiceMetrics`` + ``StoreCollector`` over a Store of one block per tenant). Now at most
``[metrics] max_tenant_labels`` tenants have their own label value; the others are summed
under ``tenant="_other"``, so every metric's sum over its series stays the total.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import MASTER, make_kv, tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore import server_config
from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.metrics import ServiceMetrics, StoreCollector
from kvstore.spec import ModelSpec
from kvstore.store import Store

OVERFLOW_TENANT = "_other"  # the label value of the tenants past the cap (kvstore.metrics.OVERFLOW_TENANT)


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``{sorted labels: value}`` of every sample named ``name``."""
    return {tuple(sorted(s.labels.items())): s.value
            for family in registry.collect() for s in family.samples if s.name == name}


def _tenant_values(registry: CollectorRegistry) -> set[str]:
    """Every tenant label value on the endpoint, the tenants inside quota resources included."""
    seen = set()
    for family in registry.collect():
        for s in family.samples:
            if "tenant" in s.labels:
                seen.add(s.labels["tenant"])
            resource = s.labels.get("resource", "")
            if resource.startswith("quota:"):
                seen.add(resource[len("quota:"):].rpartition(":")[0])
    return seen


def _total(registry: CollectorRegistry, name: str) -> float:
    return sum(_samples(registry, name).values())


def _count(m: ServiceMetrics, tenant: str, n: int) -> None:
    """``n`` of everything per tenant: lookups (n found, 1 missed), served, quota refusals."""
    m.lookup(tenant, n + 1, n)
    m.served(tenant, n, 4)
    m.rejected(f"quota:{tenant}:hbm")


# -- 1. the counters: at most the cap, the rest under _other, sums kept ------------------------------
def test_tenants_past_the_cap_are_counted_under_other_and_every_sum_stays_the_total():
    m = ServiceMetrics(CollectorRegistry(), max_tenant_labels=3)
    for i in range(10):
        _count(m, f"t{i}", i + 1)
    m.rejected("hbm")  # a capacity refusal names no tenant
    assert _tenant_values(m.registry) == {"t0", "t1", "t2", OVERFLOW_TENANT}
    assert _total(m.registry, "kvstore_lookup_hit_blocks_total") == sum(range(1, 11))
    assert _total(m.registry, "kvstore_lookup_miss_blocks_total") == 10
    assert _total(m.registry, "kvstore_saved_prefill_tokens_total") == 4 * sum(range(1, 11))
    rejections = _samples(m.registry, "kvstore_limit_rejections_total")
    assert rejections[(("resource", "quota:_other:hbm"),)] == 7
    assert rejections[(("resource", "hbm"),)] == 1
    assert sum(rejections.values()) == 11
    assert m.registry.get_sample_value("kvstore_lookup_hit_blocks_total", {"tenant": "t2"}) == 3
    assert m.registry.get_sample_value("kvstore_lookup_hit_blocks_total",
                                       {"tenant": OVERFLOW_TENANT}) == sum(range(4, 11))


def test_a_cap_of_zero_counts_every_tenant_under_other():
    m = ServiceMetrics(CollectorRegistry(), max_tenant_labels=0)
    for i in range(3):
        _count(m, f"t{i}", 1)
    assert _tenant_values(m.registry) == {OVERFLOW_TENANT}
    assert _total(m.registry, "kvstore_lookup_hit_blocks_total") == 3


def test_a_deleted_tenant_frees_its_place_and_what_overflowed_stays_counted():
    m = ServiceMetrics(CollectorRegistry(), max_tenant_labels=2)
    for tenant, n in (("a", 1), ("b", 2), ("c", 4)):
        _count(m, tenant, n)
    assert _tenant_values(m.registry) == {"a", "b", OVERFLOW_TENANT}
    m.forget_tenant("a")
    assert _tenant_values(m.registry) == {"b", OVERFLOW_TENANT}
    assert _total(m.registry, "kvstore_lookup_hit_blocks_total") == 2 + 4  # a's series went
    _count(m, "c", 8)  # c takes the place a freed; what it counted under _other stays there
    assert m.registry.get_sample_value("kvstore_lookup_hit_blocks_total", {"tenant": "c"}) == 8
    assert m.registry.get_sample_value("kvstore_lookup_hit_blocks_total", {"tenant": OVERFLOW_TENANT}) == 4
    assert _total(m.registry, "kvstore_lookup_hit_blocks_total") == 2 + 4 + 8
    _count(m, "d", 16)
    assert _tenant_values(m.registry) == {"b", "c", OVERFLOW_TENANT}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["count", "forget"]), st.integers(0, 7), st.integers(1, 5)),
                max_size=60), st.integers(0, 4))
def test_series_stay_within_the_cap_and_sum_to_what_was_counted_minus_what_was_forgotten(ops, cap):
    m = ServiceMetrics(CollectorRegistry(), max_tenant_labels=cap)
    expected = 0.0
    for op, i, n in ops:
        tenant = f"t{i}"
        if op == "count":
            _count(m, tenant, n)
            expected += n
        else:
            expected -= m.registry.get_sample_value("kvstore_lookup_hit_blocks_total", {"tenant": tenant}) or 0
            m.forget_tenant(tenant)
            assert tenant not in _tenant_values(m.registry)
        assert len(_tenant_values(m.registry) - {OVERFLOW_TENANT}) <= cap
        assert _total(m.registry, "kvstore_lookup_hit_blocks_total") == expected


# -- 2. the store's gauges: bytes per tenant and tier ------------------------------------------------
@pytest.fixture
def store(tmp_path: Path) -> Store:
    spec = _spec()
    n = spec.block_nbytes
    s = Store.open(StoreConfig(path=tmp_path / "store", hbm_bytes=64 * n, dram_bytes=4 * n, nvme_bytes=64 * n,
                               master_key=MASTER, durable=False, persist_on_close=False))
    yield s
    s.close()


def _spec() -> ModelSpec:
    return ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype="float16", block_tokens=4)


def _put(store: Store, tenant: str, blocks: int) -> None:
    spec = _spec()
    store.put(tenant, spec, store.block_keys(tenant, spec, tokens(blocks, spec)), make_kv(spec, blocks))


def _tenant_bytes(store: Store) -> dict[str, dict[str, int]]:
    return store.stats()["tenants"]


def test_the_store_gauges_name_the_largest_tenants_and_sum_the_rest_per_tier(store):
    m = ServiceMetrics(CollectorRegistry(), max_tenant_labels=3)
    m.registry.register(StoreCollector(store.stats, m.tenants))
    m.lookup("t0", 1, 1)  # t0 holds a place already (counted), small as it is
    for i, blocks in enumerate((1, 2, 3, 4, 5, 6)):
        _put(store, f"t{i}", blocks)
    gauges = _samples(m.registry, "kvstore_store_tenants")
    assert {dict(k)["tenant"] for k in gauges} == {"t0", "t5", "t4", OVERFLOW_TENANT}
    by_tier: dict[str, float] = {}
    for tiers in _tenant_bytes(store).values():
        for tier, n in tiers.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    for tier, n in by_tier.items():
        assert sum(v for k, v in gauges.items() if dict(k)["tier"] == tier) == n
    nb = _spec().block_nbytes
    assert sum(v for k, v in gauges.items() if dict(k)["tenant"] == OVERFLOW_TENANT) == (2 + 3 + 4) * nb


def test_a_deleted_tenants_gauges_and_counters_go_and_its_place_is_taken(store):
    m = ServiceMetrics(CollectorRegistry(), max_tenant_labels=2)
    m.registry.register(StoreCollector(store.stats, m.tenants))
    for i in range(4):
        _put(store, f"t{i}", 1)
        _count(m, f"t{i}", 1)
    assert _tenant_values(m.registry) == {"t0", "t1", OVERFLOW_TENANT}
    store.drop_tenant("t0")
    m.forget_tenant("t0")
    text = generate_latest(m.registry).decode()
    assert '"t0"' not in text and "quota:t0:" not in text
    # t2 and t3 have bytes and no place: the largest first, then by name, takes t0's
    assert _tenant_values(m.registry) == {"t1", "t2", OVERFLOW_TENANT}
    gauges = _samples(m.registry, "kvstore_store_tenants")
    assert sum(gauges.values()) == 3 * _spec().block_nbytes
    for i in (1, 2, 3):
        store.drop_tenant(f"t{i}")
        m.forget_tenant(f"t{i}")
    assert _samples(m.registry, "kvstore_store_tenants") == {}
    assert _tenant_values(m.registry) == {OVERFLOW_TENANT}  # t3's counts under _other stay


def test_a_place_only_the_gauges_held_is_freed_once_the_tenant_holds_no_bytes(store):
    m = ServiceMetrics(CollectorRegistry(), max_tenant_labels=1)
    m.registry.register(StoreCollector(store.stats, m.tenants))
    _put(store, "gone", 1)
    assert {dict(k)["tenant"] for k in _samples(m.registry, "kvstore_store_tenants")} == {"gone"}
    store.drop_tenant("gone")  # e.g. by another server sharing the remote tier: not forgotten here
    _put(store, "next", 1)
    assert {dict(k)["tenant"] for k in _samples(m.registry, "kvstore_store_tenants")} == {"next"}


def test_without_a_tenant_table_the_gauges_are_as_before(store):
    registry = CollectorRegistry()
    registry.register(StoreCollector(store.stats))
    for i in range(3):
        _put(store, f"t{i}", 1)
    assert {dict(k)["tenant"] for k in _samples(registry, "kvstore_store_tenants")} == {"t0", "t1", "t2"}


# -- 3. the config field and a sidecar ---------------------------------------------------------------
def test_max_tenant_labels_is_a_bounded_metrics_field(tmp_path):
    assert server_config.build({}, data_dir=tmp_path).metrics.max_tenant_labels == 1000
    assert server_config.build({"metrics": {"max_tenant_labels": 0}}, data_dir=tmp_path).metrics.max_tenant_labels == 0
    for bad in (-1, 100_001, "many"):
        with pytest.raises(InvalidArgument, match="metrics.max_tenant_labels"):
            server_config.build({"metrics": {"max_tenant_labels": bad}}, data_dir=tmp_path)


def test_a_sidecar_labels_at_most_the_configured_tenants_and_forgets_a_deleted_one(tmp_path):
    sc = start(tmp_path, metrics={"enabled": False, "max_tenant_labels": 1})
    try:
        admin = sc.admin()
        clients = {name: sc.tenant(name) for name in ("alpha", "beta", "gamma")}
        admin.set_policy("gamma", quota_bytes={"hbm": 1, "dram": 1, "nvme": 1})
        for name, c in clients.items():
            keys = c.block_keys(SPEC, fresh_tokens(2))
            if name == "gamma":
                with pytest.raises(ResourceExhausted):
                    c.put(SPEC, keys, random_kv(2))
            else:
                c.put(SPEC, keys, random_kv(2))
            c.lookup(SPEC, keys)
        registry = sc.server.metrics_registry
        assert _tenant_values(registry) == {"alpha", OVERFLOW_TENANT}
        assert registry.get_sample_value("kvstore_limit_rejections_total", {"resource": "quota:_other:hbm"}) == 1
        assert _total(registry, "kvstore_lookup_hit_blocks_total") == 4
        assert sum(_samples(registry, "kvstore_store_tenants").values()) == 4 * SPEC.block_nbytes
        admin.delete_tenant("alpha")
        assert "alpha" not in generate_latest(registry).decode()
        clients["beta"].lookup(SPEC, clients["beta"].block_keys(SPEC, fresh_tokens(1)))
        assert _tenant_values(registry) == {"beta", OVERFLOW_TENANT}
        assert _total(registry, "kvstore_lookup_hit_blocks_total") == 2  # beta's 2, earlier, under _other
    finally:
        sc.stop()
