"""Prometheus metrics of the service (prometheus-client, one registry per server).

Two sources:

* :class:`ServiceMetrics` — counted by the service as calls happen: requests and latency per
  RPC and status code, limit/quota rejections per limit, bytes in/out per plane, blocks hit and
  missed per lookup, prefill tokens saved (blocks served by Get and GetLocal x block tokens).
* :class:`StoreCollector` — read from ``Store.stats()`` at scrape time (hits and misses per
  tier, bytes per tier and per tenant, evictions, demotions, promotions, bytes migrated per tier
  pair, integrity failures, ...). Every numeric leaf of the stats mapping becomes a gauge named
  ``kvstore_store_<path>``; a mapping whose keys are tier or tenant names becomes a label.

No module-global registry: each server owns its :class:`prometheus_client.CollectorRegistry`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TIER_NAMES = {"hbm", "dram", "nvme", "remote"}
_LABEL_SECTIONS = {"tiers": "tier", "tenants": "tenant", "per_tenant": "tenant", "namespaces": "tenant",
                   "migrations": "pair", "moves": "pair"}


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("kvstore_requests", "RPCs served", ["rpc", "code"], registry=registry)
        self.latency = Histogram("kvstore_request_latency_seconds", "RPC latency", ["rpc"],
                                 buckets=_LATENCY_BUCKETS, registry=registry)
        self.rejections = Counter("kvstore_limit_rejections", "Calls refused by a limit or quota",
                                  ["resource"], registry=registry)
        self.bytes_in = Counter("kvstore_bytes_in", "Block bytes received", ["plane"], registry=registry)
        self.bytes_out = Counter("kvstore_bytes_out", "Block bytes served", ["plane"], registry=registry)
        self.lookup_hits = Counter("kvstore_lookup_hit_blocks", "Blocks found by Lookup", ["tenant"],
                                   registry=registry)
        self.lookup_misses = Counter("kvstore_lookup_miss_blocks", "Blocks asked for and not found",
                                     ["tenant"], registry=registry)
        self.saved_tokens = Counter("kvstore_saved_prefill_tokens",
                                    "Prefill tokens of the blocks served by Get and GetLocal "
                                    "(blocks served x block tokens)", ["tenant"], registry=registry)

    def observe(self, rpc: str, code: str, seconds: float) -> None:
        self.requests.labels(rpc=rpc, code=code).inc()
        self.latency.labels(rpc=rpc).observe(seconds)

    def forget_tenant(self, tenant: str) -> None:
        """Drop every series of a deleted tenant: its lookups and saved tokens, and its quota
        rejections (``resource="quota:TENANT:TIER"``). A tenant created later under its name
        started with its counts, and the label stayed on the endpoint for good."""
        for counter in (self.lookup_hits, self.lookup_misses, self.saved_tokens):
            try:
                counter.remove(tenant)
            except KeyError:
                pass  # no series yet
        for resource in self._resources():
            kind, _, rest = resource.partition(":")
            if kind == "quota" and rest.rpartition(":")[0] == tenant:
                try:
                    self.rejections.remove(resource)
                except KeyError:
                    pass  # removed meanwhile

    def _resources(self) -> set[str]:
        """The ``resource`` labels the rejections counter has series for."""
        return {sample.labels["resource"] for family in self.rejections.collect()
                for sample in family.samples if "resource" in sample.labels}

    def lookup(self, tenant: str, asked: int, found: int) -> None:
        """Blocks a Lookup found and missed (what it would save is counted when it is served)."""
        self.lookup_hits.labels(tenant=tenant).inc(found)
        self.lookup_misses.labels(tenant=tenant).inc(asked - found)

    def served(self, tenant: str, blocks: int, block_tokens: int) -> None:
        """``blocks`` blocks of ``block_tokens`` tokens served to a client (a Get or GetLocal):
        the prefill they save. NOTE: counted per Lookup before, so a client that looks up before
        it saves (HF PrefixCache.save) or once per rank (vLLM) counted what it reused twice."""
        self.saved_tokens.labels(tenant=tenant).inc(blocks * block_tokens)


def _name(parts: list[str]) -> str:
    return "kvstore_store_" + re.sub(r"[^a-zA-Z0-9_]", "_", "_".join(parts)).strip("_").lower()


def flatten(stats: Any, path: list[str] | None = None, labels: dict[str, str] | None = None,
            label: str | None = None) -> Iterator[tuple[str, dict[str, str], float]]:
    """(metric name, labels, value) for every numeric leaf of a stats mapping. ``label``: the
    keys of this mapping are label values (tier or tenant names), not name parts."""
    path, labels = path or [], labels or {}
    if isinstance(stats, (bool, int, float)):
        yield _name(path), labels, float(stats)
    elif isinstance(stats, dict):
        for key, value in stats.items():
            key = str(key)
            if label is not None:
                yield from flatten(value, path, {**labels, label: key})
            elif key in _TIER_NAMES and "tier" not in labels:
                yield from flatten(value, path, {**labels, "tier": key})
            else:
                yield from flatten(value, [*path, key], labels, _LABEL_SECTIONS.get(key))


class StoreCollector(Collector):
    """Gauges read from ``stats()`` at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families: dict[tuple[str, tuple[str, ...]], GaugeMetricFamily] = {}
        for name, labels, value in flatten(self._stats()):
            keys = tuple(sorted(labels))
            fam = families.get((name, keys))
            if fam is None:
                fam = families[(name, keys)] = GaugeMetricFamily(name, f"Store statistic {name}", labels=list(keys))
            fam.add_metric([labels[k] for k in keys], value)
        yield from families.values()
