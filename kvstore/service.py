"""gRPC servicers of ``kvstore.v1``: thin adapters over plain functions.

Layers, outermost first:

* ``KVStoreServicer`` / ``AdminServicer`` — decode protobuf, authenticate, call one plain
  method of :class:`DataPlane` / :class:`AdminPlane`, encode the result. Errors are mapped to
  status codes in one place (:mod:`kvstore.status`) by :meth:`RpcRunner.run`.
* :class:`DataPlane` / :class:`AdminPlane` — the operations on Python values (principal,
  ModelSpec, keys, buffers), usable and testable without gRPC.

Namespaces: a data-plane call acts on the caller's own namespace (from its token) unless it
names a shared namespace it was granted (read) or publishes (write); see :mod:`kvstore.auth`.
A block of another tenant is never reachable: lookups are scoped by namespace in the Store, so
a foreign key is a plain miss.

In-band Put streams buffer their blocks and commit once the whole stream arrived intact, so a
cancelled, failed or past-deadline Put leaves nothing visible.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import xxhash

from kvstore.audit import AuditLog
from kvstore.auth import (
    SHARED_PREFIX,
    AuthRegistry,
    Principal,
    Role,
    TenantPolicy,
    bearer_token,
    check_name,
    resolve_namespace,
)
from kvstore.block import Tier
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    ResourceExhausted,
)
from kvstore.keys import KEY_BYTES
from kvstore.metrics import ServiceMetrics
from kvstore.server_config import LimitsConfig
from kvstore.shm import Region, attach_region
from kvstore.spec import FINGERPRINT_BYTES, ModelSpec
from kvstore.status import to_status
from proto.kvstore.v1 import admin_pb2 as apb
from proto.kvstore.v1 import admin_pb2_grpc
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

log = logging.getLogger(__name__)

_SPEC_DEFAULTED = ("dtype", "block_tokens", "layout", "tp_size")
_SPEC_FIELDS = tuple(f.name for f in pb.ModelSpec.DESCRIPTOR.fields)
_REGION_KINDS = {pb.REGION_KIND_POSIX_SHM: "posix_shm", pb.REGION_KIND_CUDA_IPC: "cuda_ipc"}
_ROLE_PB = {Role.TENANT: apb.ROLE_TENANT, Role.PUBLISHER: apb.ROLE_PUBLISHER, Role.ADMIN: apb.ROLE_ADMIN}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_PB.items()} | {apb.ROLE_UNSPECIFIED: Role.TENANT}


# -- conversions ------------------------------------------------------------------------------
def spec_from_pb(msg: pb.ModelSpec, present: bool = True) -> ModelSpec:
    """A validated ModelSpec; zero/empty defaulted fields take ModelSpec's defaults."""
    if not present:
        raise InvalidArgument("a model spec is required")
    data = {name: getattr(msg, name) for name in _SPEC_FIELDS}
    for name in _SPEC_DEFAULTED:
        if not data[name]:
            del data[name]
    return ModelSpec.from_dict(data)


def spec_to_pb(spec: ModelSpec) -> pb.ModelSpec:
    return pb.ModelSpec(**{name: getattr(spec, name) for name in _SPEC_FIELDS})


def split_keys(packed: bytes, limit: int) -> list[bytes]:
    """Packed 32-byte keys -> list; InvalidArgument on a ragged buffer or past ``limit``."""
    if len(packed) % KEY_BYTES:
        raise InvalidArgument(f"keys must be a concatenation of {KEY_BYTES}-byte keys, got {len(packed)} bytes")
    n = len(packed) // KEY_BYTES
    if n > limit:
        raise InvalidArgument(f"{n} keys exceed limits.max_keys_per_call={limit}")
    return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


_TIER_PB = {t.label: int(t) + 1 for t in Tier}


def tier_to_pb(name: str | Tier) -> int:
    value = _TIER_PB.get(name) if isinstance(name, str) else None
    return value if value is not None else int(Tier.parse(name)) + 1


def tier_from_pb(value: int, default: Tier = Tier.HBM) -> Tier:
    if value == pb.TIER_UNSPECIFIED:
        return default
    try:
        return Tier(value - 1)
    except ValueError:
        raise InvalidArgument(f"unknown tier {value}") from None


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


# -- the data plane on Python values ---------------------------------------------------------
@dataclass(slots=True)
class Blocks:
    """The resolved target of a call: namespace, spec and keys."""

    namespace: str
    spec: ModelSpec
    keys: list[bytes]
    computed: bool  # keys were computed from token ids


class InflightBudget:
    """Bytes each tenant has buffered in unfinished Put streams (limits.max_inflight_bytes_per_tenant)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            used = self._used.get(tenant, 0)
            if used + nbytes > self._limit:
                raise ResourceExhausted(
                    f"tenant {tenant!r} would have {used + nbytes} bytes in flight, over "
                    f"limits.max_inflight_bytes_per_tenant={self._limit}",
                    resource="limits.max_inflight_bytes_per_tenant",
                )
            self._used[tenant] = used + nbytes

    def give(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            left = self._used.get(tenant, 0) - nbytes
            assert left >= 0, "in-flight accounting went negative"
            if left:
                self._used[tenant] = left
            else:
                self._used.pop(tenant, None)


class RegionTable:
    """Shared-memory regions registered by principals; a region is usable only by its owner."""

    def __init__(self, max_per_principal: int, max_bytes: int) -> None:
        self._max_per, self._max_bytes = max_per_principal, max_bytes
        self._regions: dict[int, tuple[str, Region]] = {}
        self._next = 1
        self._lock = threading.Lock()

    def register(self, owner: str, kind: str, name: str, size: int, handle: bytes = b"") -> tuple[int, Region]:
        if self._max_per == 0:
            raise FailedPrecondition("the local data plane is disabled on this server")
        if size <= 0 or size > self._max_bytes:
            raise InvalidArgument(f"region size {size} must be in (0, limits.max_region_bytes={self._max_bytes}]")
        with self._lock:
            if sum(o == owner for o, _ in self._regions.values()) >= self._max_per:
                raise ResourceExhausted(
                    f"{owner!r} has limits.max_regions_per_principal={self._max_per} regions",
                    resource="limits.max_regions_per_principal",
                )
        region = attach_region(kind, name, size, handle)
        with self._lock:
            rid = self._next
            self._next += 1
            self._regions[rid] = (owner, region)
        return rid, region

    def get(self, owner: str, region_id: int) -> Region:
        entry = self._regions.get(region_id)
        if entry is None or entry[0] != owner:
            raise InvalidArgument(f"region {region_id} is not registered by this caller")
        return entry[1]

    def unregister(self, owner: str, region_id: int) -> None:
        with self._lock:
            self.get(owner, region_id)
            _, region = self._regions.pop(region_id)
        region.close()

    def close(self) -> None:
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
        for _, region in regions:
            region.close()


def _check_slots(offsets: list[int], nbytes: int, n: int) -> None:
    if len(offsets) != n:
        raise InvalidArgument(f"{len(offsets)} offsets for {n} keys: send one per key")
    ordered = sorted(offsets)
    for a, b in zip(ordered, ordered[1:]):
        if b - a < nbytes:
            raise InvalidArgument(f"slots at {a} and {b} overlap (block is {nbytes} bytes)")


class DataPlane:
    """Data and session operations on Python values, scoped to an authenticated principal."""

    def __init__(self, store: Any, audit: AuditLog, limits: LimitsConfig, metrics: ServiceMetrics | None = None) -> None:
        self.store = store
        self.audit = audit
        self.limits = limits
        self.metrics = metrics
        self.inflight = InflightBudget(limits.max_inflight_bytes_per_tenant)
        self.regions = RegionTable(limits.max_regions_per_principal, limits.max_region_bytes)

    # -- targets ------------------------------------------------------------------------------
    def keys_for(self, principal: Principal, spec: ModelSpec, namespace: str, token_ids: list[int],
                 extra: list[list[bytes]] | None, *, write: bool = False) -> tuple[str, list[bytes]]:
        ns = resolve_namespace(principal, namespace, write=write)
        if len(token_ids) > self.limits.max_tokens_per_call:
            raise InvalidArgument(
                f"{len(token_ids)} token ids exceed limits.max_tokens_per_call={self.limits.max_tokens_per_call}")
        return ns, self.store.block_keys(ns, spec, token_ids, extra_keys=extra or None)

    def resolve(self, principal: Principal, target: pb.Target, *, write: bool = False) -> Blocks:
        spec = spec_from_pb(target.spec, target.HasField("spec"))
        which = target.WhichOneof("blocks")
        if which == "tokens":
            extra = [list(e.items) for e in target.tokens.extra]
            ns, keys = self.keys_for(principal, spec, target.namespace, list(target.tokens.ids), extra, write=write)
            if len(keys) > self.limits.max_keys_per_call:
                raise InvalidArgument(
                    f"{len(keys)} blocks exceed limits.max_keys_per_call={self.limits.max_keys_per_call}")
            return Blocks(ns, spec, keys, computed=True)
        ns = resolve_namespace(principal, target.namespace, write=write)
        return Blocks(ns, spec, split_keys(target.keys, self.limits.max_keys_per_call), computed=False)

    # -- operations ---------------------------------------------------------------------------
    def lookup(self, b: Blocks) -> tuple[int, list[str]]:
        result = self.store.lookup(b.namespace, b.spec, b.keys)
        if self.metrics is not None:
            self.metrics.lookup(b.namespace, len(b.keys), result.num_blocks, b.spec.block_tokens)
        return result.num_blocks, list(result.tiers)[: result.num_blocks]

    def put(self, b: Blocks, buffers: list[Any], session: str, ttl_s: float | None) -> int:
        nbytes = b.spec.block_nbytes
        for i, buf in enumerate(buffers):
            if len(buf) != nbytes:
                raise InvalidArgument(f"block {i} has {len(buf)} bytes; the spec's blocks are {nbytes}")
        kwargs: dict[str, Any] = {}
        if session:
            kwargs["session"] = session
        if ttl_s is not None:
            if ttl_s <= 0:
                raise InvalidArgument("ttl_s must be positive")
            kwargs["ttl_s"] = ttl_s
        self.store.put_bytes(b.namespace, b.spec, b.keys, buffers, **kwargs)
        if self.metrics is not None:
            self.metrics.bytes_in.labels(plane="store").inc(nbytes * len(buffers))
        return len(buffers)

    def get_into(self, b: Blocks, outs: list[Any]) -> int:
        n = self.store.get_into(b.namespace, b.spec, b.keys, outs)
        if self.metrics is not None:
            self.metrics.bytes_out.labels(plane="store").inc(n * b.spec.block_nbytes)
        return n

    def put_local(self, principal: Principal, b: Blocks, region_id: int, offsets: list[int],
                  session: str, ttl_s: float | None) -> int:
        region = self.regions.get(principal.name, region_id)
        nbytes = b.spec.block_nbytes
        _check_slots(offsets, nbytes, len(b.keys))
        views = [region.view(off, nbytes) for off in offsets]
        try:
            return self.put(b, views, session, ttl_s)
        finally:
            for v in views:
                v.release()

    def get_local(self, principal: Principal, b: Blocks, region_id: int, offsets: list[int]) -> int:
        region = self.regions.get(principal.name, region_id)
        nbytes = b.spec.block_nbytes
        _check_slots(offsets, nbytes, len(b.keys))
        views = [region.view(off, nbytes) for off in offsets]
        try:
            return self.get_into(b, views)
        finally:
            for v in views:
                v.release()

    def session(self, principal: Principal, verb: str, session_id: str) -> None:
        if not session_id:
            raise InvalidArgument("session_id is required")
        ns = resolve_namespace(principal, "", write=True)
        getattr(self.store, f"{verb}_session")(ns, session_id)

    def prefetch(self, b: Blocks, tier: Tier) -> int:
        return int(self.store.prefetch(b.namespace, b.spec, b.keys, tier=tier.label))

    def delete(self, principal: Principal, namespace: str, keys: list[bytes]) -> int:
        ns = resolve_namespace(principal, namespace, write=True)
        result = "OK"
        try:
            n = int(self.store.delete(ns, keys))
            return n
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


# -- the admin plane on Python values --------------------------------------------------------
class AdminPlane:
    """Operator actions. Every call is audited by the servicer (who, what, target, result)."""

    def __init__(self, store: Any, registry: AuthRegistry, audit: AuditLog) -> None:
        self.store, self.registry, self.audit = store, registry, audit

    def create_tenant(self, name: str, role: Role, namespaces: list[str]) -> str:
        return self.registry.create(name, role, namespaces)

    def rotate(self, name: str) -> str:
        return self.registry.rotate(name)

    def delete_tenant(self, name: str) -> None:
        """Remove a principal (its token stops working) and, for a tenant or a shared namespace,
        destroy its data key and blocks on every tier."""
        if name.startswith(SHARED_PREFIX):
            self.store.drop_tenant(name)
            return
        check_name(name)
        principal = self.registry.delete(name)
        if principal.role is Role.TENANT:
            self.store.drop_tenant(name)

    def set_policy(self, namespace: str, policy: TenantPolicy) -> TenantPolicy:
        if policy.ttl_s is not None and policy.ttl_s <= 0:
            raise InvalidArgument("ttl_s must be positive (unset it for no TTL)")
        quota = {Tier.parse(t).label: int(v) for t, v in policy.quota_bytes.items()}
        policy = TenantPolicy(ttl_s=policy.ttl_s, quota_bytes=quota, priority=policy.priority)
        self.registry.set_policy(namespace, policy)
        self.store.set_tenant_policy(namespace, policy.ttl_s, quota or None)
        return policy

    def apply_policies(self) -> None:
        """Re-apply the recorded policies to a freshly opened Store."""
        for ns, policy in self.registry.policies().items():
            self.store.set_tenant_policy(ns, policy.ttl_s, dict(policy.quota_bytes) or None)

    def purge_model(self, fingerprint: bytes) -> int:
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise InvalidArgument(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
        return int(self.store.purge_model(fingerprint))


# -- servicers --------------------------------------------------------------------------------
class RpcRunner:
    """Authentication, timing, error mapping and (for Admin) auditing around one plain call."""

    def __init__(self, registry: AuthRegistry, metrics: ServiceMetrics | None) -> None:
        self.registry, self.metrics = registry, metrics

    def principal(self, context: grpc.ServicerContext) -> Principal:
        return self.registry.authenticate(bearer_token(context.invocation_metadata()))

    def run(self, name: str, context: grpc.ServicerContext, fn: Callable[[Principal], Any],
            audit: Callable[[str, str], None] | None = None) -> Any:
        """Authenticate, call ``fn(principal)``, map errors; with ``audit``, require the admin
        role and record the outcome (failed authentications included, as principal ``?``)."""
        start = time.perf_counter()
        code = "OK"
        who = "?"
        try:
            principal = self.principal(context)
            who = principal.name
            if audit is not None and principal.role is not Role.ADMIN:
                raise PermissionDenied(f"{principal.name!r} is not an admin")
            result = fn(principal)
            if audit is not None:
                audit(who, "OK")
            return result
        except KVStoreError as exc:
            status, message = to_status(exc)
            code = status.name
            if audit is not None:
                audit(who, code)
            if self.metrics is not None and isinstance(exc, ResourceExhausted):
                self.metrics.rejections.labels(resource=exc.resource or "unknown").inc()
            context.abort(status, message)
        except Exception:
            if context.code() is not None or not context.is_active():
                code = "CANCELLED"
                raise
            code = "INTERNAL"
            log.exception("%s failed", name)
            if audit is not None:
                audit(who, code)
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            if self.metrics is not None:
                self.metrics.observe(name, code, time.perf_counter() - start)


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, plane: DataPlane, rpc: RpcRunner) -> None:
        self.plane, self.rpc = plane, rpc

    def WhoAmI(self, request, context):
        return self.rpc.run("WhoAmI", context, lambda p: pb.WhoAmIResponse(
            principal=p.name, role=p.role.value, readable=sorted(p.readable), writable=sorted(p.writable)))

    def BlockKeys(self, request, context):
        def call(p: Principal) -> pb.BlockKeysResponse:
            spec = spec_from_pb(request.spec, request.HasField("spec"))
            extra = [list(e.items) for e in request.tokens.extra]
            _, keys = self.plane.keys_for(p, spec, request.namespace, list(request.tokens.ids), extra)
            return pb.BlockKeysResponse(keys=b"".join(keys))
        return self.rpc.run("BlockKeys", context, call)

    def Lookup(self, request, context):
        def call(p: Principal) -> pb.LookupResponse:
            b = self.plane.resolve(p, request.target)
            n, tiers = self.plane.lookup(b)
            return pb.LookupResponse(num_blocks=n, tiers=[tier_to_pb(t) for t in tiers],
                                     keys=b"".join(b.keys) if b.computed else b"")
        return self.rpc.run("Lookup", context, call)

    def Put(self, request_iterator, context):
        return self.rpc.run("Put", context, lambda p: self._put(p, request_iterator, context))

    def _put(self, p: Principal, requests: Iterator[pb.PutChunk], context: grpc.ServicerContext) -> pb.PutResponse:
        first = next(requests, None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("the first Put message must carry the header")
        header = first.header
        b = self.plane.resolve(p, header.target, write=True)
        limits = self.plane.limits
        if len(b.keys) > limits.max_blocks_per_stream:
            raise InvalidArgument(f"{len(b.keys)} blocks exceed limits.max_blocks_per_stream={limits.max_blocks_per_stream}")
        nbytes = b.spec.block_nbytes
        total = nbytes * len(b.keys)
        if total > limits.max_stream_bytes:
            raise ResourceExhausted(f"{total} bytes exceed limits.max_stream_bytes={limits.max_stream_bytes}",
                                    resource="limits.max_stream_bytes")
        self.plane.inflight.take(b.namespace, total)
        try:
            buffers = _assemble(first, requests, len(b.keys), nbytes)
            if not context.is_active():  # cancelled or past its deadline: commit nothing
                raise FailedPrecondition("the Put was cancelled before it completed")
            ttl = header.ttl_s if header.HasField("ttl_s") else None
            written = self.plane.put(b, buffers, header.session, ttl)
        finally:
            self.plane.inflight.give(b.namespace, total)
        if self.plane.metrics is not None:
            self.plane.metrics.bytes_in.labels(plane="stream").inc(total)
        return pb.PutResponse(blocks_written=written)

    def Get(self, request, context):
        # the stream's first message is produced inside run(): errors abort before any data
        state: dict[str, Any] = {}

        def prepare(p: Principal) -> None:
            b = self.plane.resolve(p, request.target)
            nbytes = b.spec.block_nbytes
            limit = self.plane.limits.chunk_bytes
            chunk = min(request.chunk_bytes or limit, limit)
            outs = [bytearray(nbytes) for _ in b.keys]
            n = self.plane.get_into(b, outs)
            state.update(nbytes=nbytes, chunk=chunk, outs=outs[:n])

        self.rpc.run("Get", context, prepare)
        outs, nbytes, chunk = state["outs"], state["nbytes"], state["chunk"]
        yield pb.GetChunk(header=pb.GetHeader(num_blocks=len(outs), block_nbytes=nbytes))
        for i, buf in enumerate(outs):
            view = memoryview(buf)
            for off in range(0, nbytes, chunk):
                data = view[off : off + chunk]
                yield pb.GetChunk(chunk=pb.BlockChunk(block=i, offset=off, data=bytes(data), xxh3=checksum(data)))
        if self.plane.metrics is not None:
            self.plane.metrics.bytes_out.labels(plane="stream").inc(nbytes * len(outs))

    def RegisterRegion(self, request, context):
        def call(p: Principal) -> pb.RegisterRegionResponse:
            if p.role is Role.ADMIN:
                raise PermissionDenied("admin tokens have no data-plane access")
            kind = _REGION_KINDS.get(request.kind)
            if kind is None:
                raise InvalidArgument("region kind is required")
            rid, region = self.plane.regions.register(p.name, kind, request.name, request.size,
                                                      request.cuda_ipc_handle)
            nonce = getattr(region, "nonce", b"")
            return pb.RegisterRegionResponse(region_id=rid, nonce=nonce)
        return self.rpc.run("RegisterRegion", context, call)

    def UnregisterRegion(self, request, context):
        def call(p: Principal) -> pb.UnregisterRegionResponse:
            self.plane.regions.unregister(p.name, request.region_id)
            return pb.UnregisterRegionResponse()
        return self.rpc.run("UnregisterRegion", context, call)

    def PutLocal(self, request, context):
        def call(p: Principal) -> pb.PutResponse:
            b = self.plane.resolve(p, request.target, write=True)
            ttl = request.ttl_s if request.HasField("ttl_s") else None
            n = self.plane.put_local(p, b, request.region_id, list(request.offsets), request.session, ttl)
            return pb.PutResponse(blocks_written=n)
        return self.rpc.run("PutLocal", context, call)

    def GetLocal(self, request, context):
        def call(p: Principal) -> pb.GetLocalResponse:
            b = self.plane.resolve(p, request.target)
            n = self.plane.get_local(p, b, request.region_id, list(request.offsets))
            return pb.GetLocalResponse(num_blocks=n)
        return self.rpc.run("GetLocal", context, call)

    def _session(self, verb: str, state: int, request, context):
        def call(p: Principal) -> pb.SessionResponse:
            self.plane.session(p, verb, request.session_id)
            return pb.SessionResponse(session_id=request.session_id, state=state)
        return self.rpc.run(f"{verb.capitalize()}Session", context, call)

    def OpenSession(self, request, context):
        return self._session("open", pb.SESSION_STATE_ACTIVE, request, context)

    def PauseSession(self, request, context):
        return self._session("pause", pb.SESSION_STATE_PAUSED, request, context)

    def ResumeSession(self, request, context):
        return self._session("resume", pb.SESSION_STATE_RESUMED, request, context)

    def CloseSession(self, request, context):
        return self._session("close", pb.SESSION_STATE_CLOSED, request, context)

    def Prefetch(self, request, context):
        def call(p: Principal) -> pb.PrefetchResponse:
            b = self.plane.resolve(p, request.target)
            return pb.PrefetchResponse(blocks=self.plane.prefetch(b, tier_from_pb(request.tier)))
        return self.rpc.run("Prefetch", context, call)

    def Delete(self, request, context):
        def call(p: Principal) -> pb.DeleteResponse:
            keys = split_keys(request.keys, self.plane.limits.max_keys_per_call)
            return pb.DeleteResponse(deleted=self.plane.delete(p, request.namespace, keys))
        return self.rpc.run("Delete", context, call)

    def Stats(self, request, context):
        return self.rpc.run("Stats", context, lambda p: pb.StatsResponse(
            json=json.dumps(self.plane.stats(p), default=str, sort_keys=True)))


def _assemble(first: pb.PutChunk, requests: Iterator[pb.PutChunk], n: int, nbytes: int) -> list[Any]:
    """Collect ``n`` blocks of ``nbytes`` from in-order, checksummed chunks."""
    buffers: list[Any] = []
    current: bytearray | None = None
    filled = 0

    def chunks() -> Iterator[pb.PutChunk]:
        if first.HasField("chunk"):
            yield first
        yield from requests

    for msg in chunks():
        if msg.HasField("header"):
            raise InvalidArgument("only the first Put message may carry a header")
        c = msg.chunk
        data = c.data
        if c.block != len(buffers) or c.offset != filled:
            raise InvalidArgument(
                f"out-of-order chunk: got block {c.block} offset {c.offset}, expected block {len(buffers)} offset {filled}")
        if len(buffers) >= n:
            raise InvalidArgument(f"more data than the {n} blocks the header names")
        if filled + len(data) > nbytes or not data:
            raise InvalidArgument(f"chunk of {len(data)} bytes at offset {filled} overruns the {nbytes}-byte block")
        if checksum(data) != c.xxh3:
            raise InvalidArgument(f"checksum mismatch in block {c.block} at offset {c.offset}")
        if filled == 0 and len(data) == nbytes:
            buffers.append(data)  # a whole block in one message: keep it, no copy
            continue
        if current is None:
            current = bytearray(nbytes)
        current[filled : filled + len(data)] = data
        filled += len(data)
        if filled == nbytes:
            buffers.append(current)
            current, filled = None, 0
    if len(buffers) != n or current is not None:
        raise InvalidArgument(f"the stream ended after {len(buffers)} of {n} blocks")
    return buffers


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, plane: AdminPlane, rpc: RpcRunner) -> None:
        self.plane, self.rpc = plane, rpc

    def _run(self, name: str, action: str, target: str, context, fn: Callable[[Principal], Any]) -> Any:
        def audit(who: str, result: str) -> None:
            self.plane.audit.append(who, action, target, result)
        return self.rpc.run(f"Admin.{name}", context, fn, audit=audit)

    def CreateTenant(self, request, context):
        role = _ROLE_FROM_PB.get(request.role, Role.TENANT)
        return self._run("CreateTenant", "tenant.create", request.name, context, lambda p: apb.TenantToken(
            name=request.name, token=self.plane.create_tenant(request.name, role, list(request.namespaces))))

    def RotateToken(self, request, context):
        return self._run("RotateToken", "tenant.rotate", request.name, context, lambda p: apb.TenantToken(
            name=request.name, token=self.plane.rotate(request.name)))

    def DeleteTenant(self, request, context):
        def call(p: Principal) -> apb.DeleteTenantResponse:
            self.plane.delete_tenant(request.name)
            return apb.DeleteTenantResponse()
        return self._run("DeleteTenant", "tenant.delete", request.name, context, call)

    def ListTenants(self, request, context):
        return self._run("ListTenants", "tenant.list", "", context, lambda p: apb.ListTenantsResponse(
            tenants=[_tenant_pb(t) for t in self.plane.registry.list()]))

    def Grant(self, request, context):
        action = "namespace.revoke" if request.revoke else "namespace.grant"
        return self._run("Grant", action, f"{request.tenant} {request.namespace}", context, lambda p: _tenant_pb(
            self.plane.registry.grant(request.tenant, request.namespace, revoke=request.revoke)))

    def GetPolicy(self, request, context):
        return self._run("GetPolicy", "policy.get", request.name, context,
                         lambda p: _policy_pb(request.name, self.plane.registry.policy(request.name)))

    def SetPolicy(self, request, context):
        policy = TenantPolicy(ttl_s=request.ttl_s if request.HasField("ttl_s") else None,
                              quota_bytes=dict(request.quota_bytes), priority=request.priority)
        return self._run("SetPolicy", "policy.set", request.tenant, context,
                         lambda p: _policy_pb(request.tenant, self.plane.set_policy(request.tenant, policy)))

    def PurgeModel(self, request, context):
        def call(p: Principal) -> apb.PurgeModelResponse:
            fp = request.fingerprint or (spec_from_pb(request.spec, request.HasField("spec")).fingerprint)
            return apb.PurgeModelResponse(blocks=self.plane.purge_model(fp))
        target = request.fingerprint.hex() or request.spec.model
        return self._run("PurgeModel", "model.purge", target, context, call)

    def ReadAudit(self, request, context):
        def call(p: Principal) -> apb.ReadAuditResponse:
            entries = self.plane.audit.read(request.since_seq, request.limit or 1000)
            return apb.ReadAuditResponse(entries=[apb.AuditEntry(
                seq=e.seq, time=e.time, principal=e.principal, action=e.action, target=e.target,
                result=e.result, detail=e.detail) for e in entries])
        return self.rpc.run("Admin.ReadAudit", context, _admin_only(call))

    def Stats(self, request, context):
        return self.rpc.run("Admin.Stats", context, _admin_only(lambda p: pb.StatsResponse(
            json=json.dumps(self.plane.store.stats(), default=str, sort_keys=True))))


def _admin_only(fn: Callable[[Principal], Any]) -> Callable[[Principal], Any]:
    """For read-only admin calls that are not audited (reading the audit log must not grow it)."""
    def call(p: Principal) -> Any:
        if p.role is not Role.ADMIN:
            raise PermissionDenied(f"{p.name!r} is not an admin")
        return fn(p)
    return call


def _tenant_pb(p: Principal) -> apb.TenantInfo:
    return apb.TenantInfo(name=p.name, role=_ROLE_PB[p.role], namespaces=list(p.namespaces), created=p.created)


def _policy_pb(name: str, policy: TenantPolicy) -> apb.TenantPolicy:
    msg = apb.TenantPolicy(tenant=name, quota_bytes=policy.quota_bytes, priority=policy.priority)
    if policy.ttl_s is not None:
        msg.ttl_s = policy.ttl_s
    return msg
