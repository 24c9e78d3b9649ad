"""The data and session plane on Python values, scoped to an authenticated principal.

:class:`DataPlane` is what the KVStore servicer calls; it knows nothing of gRPC. Namespaces: a
call acts on the caller's own namespace (from its token) unless it names a shared namespace it
was granted (read) or publishes (write); see :mod:`kvstore.auth`. A block of another tenant is
never reachable: the Store scopes every lookup by namespace, so a foreign key is a plain miss.

A target may continue a chain from a stored ``parent`` block (a long chain split across calls);
every Store call below passes it on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.audit import AuditLog
from kvstore.auth import Principal, resolve_namespace
from kvstore.block import Tier
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import ROOT_KEY, block_keys
from kvstore.metrics import ServiceMetrics
from kvstore.server_config import LimitsConfig
from kvstore.service_convert import (
    check_slots,
    packed_keys,
    parent_from_pb,
    spec_from_pb,
    split_keys,
)
from kvstore.service_resources import InflightBudget, RegionTable, StagingPool
from kvstore.spec import ModelSpec
from proto.kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    import numpy as np

    from kvstore.store_lease import ReadLease
    from kvstore.store_reserve import PutReservation


@dataclass(slots=True)
class Blocks:
    """The resolved target of a call: namespace, spec, keys and the chain's stored parent."""

    namespace: str
    spec: ModelSpec
    keys: Sequence[bytes]  # a list, or PackedKeys from resolve(packed=True)
    computed: bool  # keys were computed from token ids
    parent: bytes | None = None


class DataPlane:
    """Data and session operations; each method raises typed errors from kvstore.errors."""

    def __init__(self, store: Any, audit: AuditLog, limits: LimitsConfig, metrics: ServiceMetrics | None = None) -> None:
        self.store = store
        self.audit = audit
        self.limits = limits
        self.metrics = metrics
        self.inflight = InflightBudget(limits.max_inflight_bytes_per_tenant)
        self.regions = RegionTable(limits.max_regions_per_principal, limits.max_region_bytes)
        self.staging = StagingPool(limits.staging_cache_bytes)

    # -- targets ------------------------------------------------------------------------------
    def keys_for(self, principal: Principal, spec: ModelSpec, namespace: str, token_ids: Sequence[int],
                 extra: list[list[bytes]] | None, *, write: bool = False,
                 parent: bytes | None = None) -> tuple[str, list[bytes]]:
        """The namespace and chained keys of every full block of ``token_ids``."""
        ns = resolve_namespace(principal, namespace, write=write)
        if len(token_ids) > self.limits.max_tokens_per_call:
            raise InvalidArgument(
                f"{len(token_ids)} token ids exceed limits.max_tokens_per_call={self.limits.max_tokens_per_call}")
        keys = block_keys(ns, spec.fingerprint, spec.block_tokens, token_ids, extra or None,
                          parent=parent or ROOT_KEY)
        return ns, keys

    def resolve(self, principal: Principal, target: pb.Target, *, write: bool = False,
                packed: bool = False) -> Blocks:
        """Validate a Target: spec, namespace (read or write access), keys, parent.
        ``packed``: keys sent packed stay so (:class:`kvstore.keys.PackedKeys`, for lookups)."""
        spec = spec_from_pb(target.spec, target.HasField("spec"))
        parent = parent_from_pb(target.parent)
        if target.WhichOneof("blocks") == "tokens":
            extra = [list(e.items) for e in target.tokens.extra]
            ns, keys = self.keys_for(principal, spec, target.namespace, list(target.tokens.ids), extra,
                                     write=write, parent=parent)
            if len(keys) > self.limits.max_keys_per_call:
                raise InvalidArgument(
                    f"{len(keys)} blocks exceed limits.max_keys_per_call={self.limits.max_keys_per_call}")
            return Blocks(ns, spec, keys, True, parent)
        ns = resolve_namespace(principal, target.namespace, write=write)
        limit = self.limits.max_keys_per_call
        keys = packed_keys(target.keys, limit) if packed else split_keys(target.keys, limit)
        return Blocks(ns, spec, keys, False, parent)

    # -- operations ---------------------------------------------------------------------------
    def lookup(self, b: Blocks) -> tuple[int, list[str]]:
        """Longest usable prefix and the tier name of each of its blocks."""
        result = self.store.lookup(b.namespace, b.spec, b.keys, parent=b.parent)
        if self.metrics is not None:
            self.metrics.lookup(b.namespace, len(b.keys), result.num_blocks, b.spec.block_tokens)
        return result.num_blocks, result.tiers[: result.num_blocks]

    def put(self, b: Blocks, buffers: Sequence[Any], session: str, ttl_s: float | None, plane: str = "store") -> int:
        """Store one buffer of ``spec.block_nbytes`` per key, all or nothing (the Store checks
        ``ttl_s``)."""
        nbytes = b.spec.block_nbytes
        for i, buf in enumerate(buffers):
            if len(buf) != nbytes:
                raise InvalidArgument(f"block {i} has {len(buf)} bytes; the spec's blocks are {nbytes}")
        self.store.put_bytes(b.namespace, b.spec, b.keys, buffers, session=session or None, ttl_s=ttl_s,
                             parent=b.parent)
        if self.metrics is not None:
            self.metrics.bytes_in.labels(plane=plane).inc(nbytes * len(buffers))
        return len(buffers)

    def reserve_put(self, b: Blocks) -> PutReservation:
        """Reserve tier slots for a put whose bytes arrive later (``Store.reserve_put``)."""
        return self.store.reserve_put(b.namespace, b.spec, b.keys, parent=b.parent)

    def commit_put(self, b: Blocks, reservation: PutReservation, data: Callable[[int], Any], session: str,
                   ttl_s: float | None, plane: str = "stream") -> int:
        """Publish a reserved put, all or nothing; ``data(i)``: block i's bytes where the
        reservation has no slot. The number of blocks written."""
        self.store.commit_put(reservation, data, session=session or None, ttl_s=ttl_s)
        if self.metrics is not None:
            self.metrics.bytes_in.labels(plane=plane).inc(b.spec.block_nbytes * len(b.keys))
        return len(b.keys)

    def abort_put(self, reservation: PutReservation) -> None:
        self.store.abort_put(reservation)

    def get_into(self, b: Blocks, outs: Sequence[Any], plane: str = "store") -> int:
        """Copy the longest usable prefix into ``outs``; the number of blocks written."""
        n = self.store.get_into(b.namespace, b.spec, b.keys, outs, parent=b.parent)
        if self.metrics is not None:
            self.metrics.bytes_out.labels(plane=plane).inc(n * b.spec.block_nbytes)
        return n

    def lease(self, b: Blocks, stage: Callable[[int], np.ndarray], plane: str = "stream") -> ReadLease:
        """The longest usable prefix under a read lease (``Store.lease_prefix``): each block's
        bytes in place in its memory tier, or copied into ``stage(i)``. Release it in a finally."""
        lease = self.store.lease_prefix(b.namespace, b.spec, b.keys, stage, parent=b.parent)
        if self.metrics is not None:
            try:
                self.metrics.bytes_out.labels(plane=plane).inc(len(lease.views) * b.spec.block_nbytes)
            except BaseException:
                lease.release()
                raise
        return lease

    def put_local(self, principal: Principal, b: Blocks, region_id: int, offsets: Sequence[int],
                  session: str, ttl_s: float | None) -> int:
        region = self.regions.get(principal.name, region_id)
        nbytes = b.spec.block_nbytes
        check_slots(offsets, nbytes, len(b.keys))
        views = [region.view(off, nbytes) for off in offsets]
        try:
            return self.put(b, views, session, ttl_s, plane="shm")
        finally:
            for v in views:
                v.release()

    def get_local(self, principal: Principal, b: Blocks, region_id: int, offsets: Sequence[int]) -> int:
        region = self.regions.get(principal.name, region_id)
        nbytes = b.spec.block_nbytes
        check_slots(offsets, nbytes, len(b.keys))
        views = [region.view(off, nbytes) for off in offsets]
        try:
            return self.get_into(b, views, plane="shm")
        finally:
            for v in views:
                v.release()

    def session(self, principal: Principal, verb: str, session_id: str) -> None:
        """``verb`` is one of open, pause, resume, close."""
        if not session_id:
            raise InvalidArgument("session_id is required")
        ns = resolve_namespace(principal, "", write=True)
        call = {"open": self.store.open_session, "pause": self.store.pause_session,
                "resume": self.store.resume_session, "close": self.store.close_session}[verb]
        call(ns, session_id)

    def prefetch(self, b: Blocks, tier: Tier) -> int:
        return int(self.store.prefetch(b.namespace, b.spec, b.keys, tier=tier.label, parent=b.parent))

    def delete(self, principal: Principal, namespace: str, packed: bytes) -> int:
        """Delete blocks (audited, whatever the outcome)."""
        ns = resolve_namespace(principal, namespace, write=True)
        keys = split_keys(packed, self.limits.max_keys_per_call)
        result = "OK"
        try:
            return int(self.store.delete(ns, keys))
        except KVStoreError as exc:
            result = exc.code
            raise
        finally:
            self.audit.append(principal.name, "blocks.delete", ns, result, f"{len(keys)} keys")

    def stats(self, principal: Principal) -> dict[str, Any]:
        return scope_stats(self.store.stats(), principal.readable)


def scope_stats(stats: dict[str, Any], readable: frozenset[str] | None) -> dict[str, Any]:
    """Drop other tenants' entries from per-tenant sections (``readable=None``: keep all)."""
    if readable is None:
        return stats
    out: dict[str, Any] = {}
    for key, value in stats.items():
        if key in ("tenants", "per_tenant", "namespaces") and isinstance(value, dict):
            out[key] = {t: v for t, v in value.items() if t in readable}
        else:
            out[key] = value
    return out
