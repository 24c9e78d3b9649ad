"""Prometheus metrics of the service (prometheus-client, one registry per server).

Two sources:

* :class:`ServiceMetrics` — counted by the service as calls happen: requests and latency per
  RPC and status code, limit/quota rejections per limit, bytes in/out per plane, blocks hit and
  missed per lookup, prefill tokens saved (blocks served by Get and GetLocal x block tokens).
* :class:`StoreCollector` — read from ``Store.stats()`` at scrape time (hits and misses per
  tier, bytes per tier and per tenant, evictions, demotions, promotions, blocks moved and bytes
  written per tier pair (``moved_X_to_Y``, ``bytes_X_to_Y``: see :data:`_HELP`), integrity
  failures, ...). Every numeric leaf of the stats mapping becomes a gauge named
  ``kvstore_store_<path>``; a mapping whose keys are tier or tenant names becomes a label.

Tenant labels (``tenant=``, and the tenant inside ``resource="quota:TENANT:TIER"``) are
bounded by :class:`TenantLabels`: at most ``[metrics] max_tenant_labels`` tenants have their
own label value at once, the others are counted under ``tenant="_other"`` (summed, so totals
over a metric stay right), and a deleted tenant's series go (:meth:`ServiceMetrics.forget_tenant`),
freeing its place. A count passed ``known`` is dropped when ``known(tenant)`` is false as it is
counted (under the lock :meth:`ServiceMetrics.forget_tenant` holds): a call authenticated before
its tenant's deletion and counted after it made the deleted tenant's series again, for good.
NOTE: unbounded, 50,000 tenants (one block, a lookup, a Get and a quota
refusal each) were 450,019 series on the endpoint, a 32 MB scrape taking 7 s, and Prometheus's
memory and the sidecar's grew with every tenant seen; capped at 1,000: 9,028 series, 0.6 MB.

No module-global registry: each server owns its :class:`prometheus_client.CollectorRegistry`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TIER_NAMES = {"hbm", "dram", "nvme", "remote"}
_LABEL_SECTIONS = {"tiers": "tier", "tenants": "tenant", "per_tenant": "tenant", "namespaces": "tenant",
                   "migrations": "pair", "moves": "pair"}
#: help texts of the store statistics that say more than their name (the rest: "Store statistic")
_HELP = (
    (re.compile(r"kvstore_store_counters_moved_([a-z]+)_to_([a-z]+)$"),
     ("Blocks whose tier changed from {0} to {1}, a demotion onto the NVMe copy a block had included "
      "(the pairs downward sum to demotions, upward to promotions)")),
    (re.compile(r"kvstore_store_counters_bytes_([a-z]+)_to_([a-z]+)$"),
     ("Bytes written into {1} copied from a block in {0}, once per write (a move, an ancestor's NVMe "
      "copy, a flush); a demotion onto an NVMe copy the block had writes none")),
)
#: the label value of the tenants past the cap; no principal can be named so (a name starts
#: with a letter or digit: :func:`kvstore.auth.check_name`)
OVERFLOW_TENANT = "_other"
#: ``[metrics] max_tenant_labels``'s default (:class:`kvstore.server_config.MetricsConfig`)
MAX_TENANT_LABELS = 1000
#: whether a tenant (or namespace) still is one as its count is made: false once it was deleted
Known = Callable[[str], bool]


class TenantLabels:
    """Which tenants have their own label value: at most ``cap`` at once, first come first
    served, the rest :data:`OVERFLOW_TENANT`. A tenant keeps its place until it is forgotten
    (deleted), or, when only the store gauges gave it one, until a scrape finds it has no bytes
    left. Thread-safe; :attr:`lock` is held while a label is chosen and its counter changed,
    and while a tenant is forgotten: a series never outlives its tenant's place, so the cap
    holds on the endpoint."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.lock = threading.Lock()
        self._held: dict[str, bool] = {}  # tenant -> it has counter series (else: gauges only)

    def counted(self, tenant: str) -> str:
        """The label value to count ``tenant`` under. Call with :attr:`lock` held."""
        if tenant in self._held or len(self._held) < self.cap:
            self._held[tenant] = True
            return tenant
        return OVERFLOW_TENANT

    def forget(self, tenant: str) -> None:
        """``tenant`` is gone: its place is free. Call with :attr:`lock` held."""
        self._held.pop(tenant, None)

    def for_gauges(self, tenants: Iterable[str]) -> dict[str, str]:
        """The label value of each of ``tenants`` (those the store reports now, the ones to
        keep first): tenants with a place keep it, the others take the free places in the
        order given. Places only gauges held and whose tenant is no longer reported are freed
        first (else a tenant seen once by the store, e.g. on a remote tier another server
        shares, kept its place for good)."""
        tenants = list(tenants)
        with self.lock:
            present = set(tenants)
            for tenant in [t for t, counted in self._held.items() if not counted and t not in present]:
                del self._held[tenant]
            labels = {}
            for tenant in tenants:
                if tenant in self._held or len(self._held) < self.cap:
                    self._held.setdefault(tenant, False)
                    labels[tenant] = tenant
                else:
                    labels[tenant] = OVERFLOW_TENANT
            return labels


class ServiceMetrics:
    """Counters of the service. ``max_tenant_labels``: tenants with their own label value at
    once (:class:`TenantLabels`, shared with the :class:`StoreCollector` given ``tenants``)."""

    def __init__(self, registry: CollectorRegistry, max_tenant_labels: int = MAX_TENANT_LABELS) -> None:
        self.registry = registry
        self.tenants = TenantLabels(max_tenant_labels)
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
        rejections (``resource="quota:TENANT:TIER"``), and free its label place. A tenant
        created later under its name started with its counts, and the label stayed on the
        endpoint for good. What a tenant counted under :data:`OVERFLOW_TENANT` stays there
        (a counter never goes down; the series is every tenant past the cap, deleted or not)."""
        with self.tenants.lock:
            self.tenants.forget(tenant)
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

    def _label(self, tenant: str, known: Known | None) -> str | None:
        """The label value to count ``tenant`` under; None when ``known`` says it is no longer
        a tenant (deleted): nothing is counted. Call with the tenants' lock held."""
        # NOTE: checked under the lock forget_tenant takes, and a deletion forgets the tenant
        # only once known(tenant) is false: a count either comes before (and its series is
        # removed) or is dropped. Unchecked, a Lookup or Get authenticated before the deletion
        # and counted after it gave the deleted tenant its series back for as long as the
        # sidecar ran (and its place under the cap)
        if known is not None and not known(tenant):
            return None
        return self.tenants.counted(tenant)

    def rejected(self, resource: str | None, known: Known | None = None) -> None:
        """A call refused by a limit or quota (``ResourceExhausted.resource``; None: unknown).
        A quota's resource names its tenant (``quota:TENANT:TIER``): past the cap, ``_other``;
        not counted when ``known(TENANT)`` is false (deleted meanwhile)."""
        resource = resource or "unknown"
        kind, _, rest = resource.partition(":")
        with self.tenants.lock:
            if kind == "quota" and ":" in rest:
                tenant, _, tier = rest.rpartition(":")
                label = self._label(tenant, known)
                if label is None:
                    return
                resource = f"quota:{label}:{tier}"
            self.rejections.labels(resource=resource).inc()

    def lookup(self, tenant: str, asked: int, found: int, known: Known | None = None) -> None:
        """Blocks a Lookup found and missed (what it would save is counted when it is served);
        nothing when ``known(tenant)`` is false."""
        with self.tenants.lock:
            label = self._label(tenant, known)
            if label is None:
                return
            self.lookup_hits.labels(tenant=label).inc(found)
            self.lookup_misses.labels(tenant=label).inc(asked - found)

    def served(self, tenant: str, blocks: int, block_tokens: int, known: Known | None = None) -> None:
        """``blocks`` blocks of ``block_tokens`` tokens served to a client (a Get or GetLocal):
        the prefill they save; nothing when ``known(tenant)`` is false. NOTE: counted per
        Lookup before, so a client that looks up before it saves (HF PrefixCache.save) or once
        per rank (vLLM) counted what it reused twice."""
        with self.tenants.lock:
            label = self._label(tenant, known)
            if label is not None:
                self.saved_tokens.labels(tenant=label).inc(blocks * block_tokens)


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


def _help(name: str) -> str:
    for pattern, text in _HELP:
        if (m := pattern.match(name)) is not None:
            return text.format(*m.groups())
    return f"Store statistic {name}"


class StoreCollector(Collector):
    """Gauges read from ``stats()`` at scrape time. With ``tenants`` (the service's
    :attr:`ServiceMetrics.tenants`), tenants past its cap are summed under ``_other``, the
    largest (their bytes together) keeping their own label when places are free. The
    per-tenant statistics are byte counts, so the sum is their total."""

    def __init__(self, stats: Callable[[], dict[str, Any]], tenants: TenantLabels | None = None) -> None:
        self._stats = stats
        self._tenants = tenants

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = list(flatten(self._stats()))
        if self._tenants is not None:
            size: dict[str, float] = {}
            for _, labels, value in rows:
                if "tenant" in labels:
                    size[labels["tenant"]] = size.get(labels["tenant"], 0.0) + value
            named = self._tenants.for_gauges(sorted(size, key=lambda t: (-size[t], t)))
            rows = [(name, {**labels, "tenant": named[labels["tenant"]]} if "tenant" in labels else labels, value)
                    for name, labels, value in rows]
        sums: dict[tuple[str, tuple[str, ...]], dict[tuple[str, ...], float]] = {}
        for name, labels, value in rows:
            keys = tuple(sorted(labels))
            values = sums.setdefault((name, keys), {})
            at = tuple(labels[k] for k in keys)
            values[at] = values.get(at, 0.0) + value
        for (name, keys), values in sums.items():
            fam = GaugeMetricFamily(name, _help(name), labels=list(keys))
            for at, value in values.items():
                fam.add_metric(list(at), value)
            yield fam
