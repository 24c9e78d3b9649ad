"""The data and session plane on Python values, scoped to an authenticated principal.

:class:`DataPlane` is what the KVStore servicer calls; it knows nothing of gRPC. Namespaces: a
call acts on the caller's own namespace (from its token) unless it names a shared namespace it
was granted (read) or publishes (write); see :mod:`kvstore.auth`. A block of another tenant is
never reachable: the Store scopes every lookup by namespace, so a foreign key is a plain miss.

A target may continue a chain from a stored ``parent`` block (a long chain split across calls);
every Store call below passes it on. A target with ``roots`` names independent root blocks
instead of a chain (``Store.put(roots=True)``, ``Store.lookup_roots``, ``Store.lease_roots``):
presence, puts and gets of many pages in one call, each key answered on its own.

Shared-memory Put and Get copy outside the Store's lock: a Get takes a read lease on the prefix
(its memory-tier blocks stay in place, pinned, while they are copied into the client's slots;
NVMe blocks are decoded under the lock straight into the slots of a mapped region, else into
staging), a Put reserves tier slots, copies into them and commits, all or nothing
(:mod:`kvstore.store_lease`, :mod:`kvstore.store_reserve`). The region does the copies on its
side (:class:`kvstore.shm_attach.AttachedRegion`: memcpy on a sealed memfd, preadv/pwritev on a
``/dev/shm`` segment, so that no client and no tmpfs shortage can SIGBUS the server). The
copies of one call are spread over ``copy_threads``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kernels.copy import copy_blocks, copy_bytes
from kvstore.audit import AuditLog, Recorder
from kvstore.auth import AuthRegistry, Principal, resolve_namespace
from kvstore.block import SessionState, Tier
from kvstore.errors import FailedPrecondition, InvalidArgument, KVStoreError, Unavailable
from kvstore.keys import KEY_BYTES, ROOT_KEY, block_keys
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
from kvstore.service_rpc import known_namespace
from kvstore.shm_attach import Region
from kvstore.spec import ModelSpec
from kvstore.store_reserve import _parent, check_roots
from proto.kvstore.v1 import kvstore_pb2 as pb

if TYPE_CHECKING:
    from kvstore.store_lease import ReadLease
    from kvstore.store_reserve import PutReservation

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Blocks:
    """The resolved target of a call: namespace, spec, keys and the chain's stored parent."""

    namespace: str
    spec: ModelSpec
    keys: Sequence[bytes]  # a list, or PackedKeys from resolve(packed=True)
    computed: bool  # keys were computed from token ids
    parent: bytes | None = None
    #: the call's ``is_active`` (its gRPC context): a shared-memory put commits only while it is
    #: true, as the Put stream does (None: not checked)
    active: Callable[[], bool] | None = None
    #: the keys are independent roots, not a chain (``Target.roots``)
    roots: bool = False


@dataclass(frozen=True, slots=True)
class RegionSlot:
    """Block bytes at ``offset`` of a registered region: one side of a :meth:`DataPlane._copy`
    pair, copied by the region itself (never through a mapping that could SIGBUS)."""

    region: Region
    offset: int


class DataPlane:
    """Data and session operations; each method raises typed errors from kvstore.errors."""

    def __init__(self, store: Any, audit: AuditLog, limits: LimitsConfig, metrics: ServiceMetrics | None = None,
                 copy_threads: int = 1, auth: AuthRegistry | None = None) -> None:
        self.store = store
        #: the registry that re-validates a caller before its put commits (and as a Get stream
        #: sends): a call that outlives its token's rotation, its principal's deletion or its
        #: grant's revocation fails. None: not re-validated (the KVStore servicer sets its own).
        self.auth = auth
        self.audit = audit
        self.limits = limits
        self.metrics = metrics
        self.inflight = InflightBudget(limits.max_inflight_bytes_per_tenant)
        self.regions = RegionTable(limits.max_regions_per_principal, limits.max_region_bytes,
                                   idle_evict_s=limits.region_idle_evict_s)
        if limits.max_regions_per_principal:
            self.regions.sweep()  # segments left by clients killed before this server started
        self.staging = StagingPool(limits.staging_cache_bytes)
        self.copy_threads = copy_threads
        self._copy_pool = (ThreadPoolExecutor(copy_threads - 1, thread_name_prefix="kvstore-copy")
                           if copy_threads > 1 else None)

    def close(self) -> None:
        """Stop the copy threads (after the server stopped serving) and close the regions."""
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
        self.regions.close()

    def _copy(self, pairs: Sequence[tuple[Any, Any]]) -> None:
        """Copy each ``(dst, src)`` pair: buffers (:func:`kernels.copy.copy_bytes`), or a
        :class:`RegionSlot` on one side. Spread over ``copy_threads`` in contiguous parts (slots
        next to each other in a region go in one system call); the first error is raised once
        every part is done."""
        copy_blocks(pairs, self._copy_pool, self.copy_threads, part=_copy_part)

    # -- targets ------------------------------------------------------------------------------
    def keys_for(self, principal: Principal, spec: ModelSpec, namespace: str, token_ids: Sequence[int],
                 extra: list[list[bytes]] | None, *, write: bool = False,
                 parent: bytes | None = None) -> tuple[str, list[bytes]]:
        """The namespace and chained keys of every full block of ``token_ids``: at most
        ``limits.max_keys_per_call`` of them, checked before any is computed (BlockKeys and a
        Lookup by tokens send them all back, and a key list that long fits max_message_bytes)."""
        ns = resolve_namespace(principal, namespace, write=write)
        if len(token_ids) > self.limits.max_tokens_per_call:
            raise InvalidArgument(
                f"{len(token_ids)} token ids exceed limits.max_tokens_per_call={self.limits.max_tokens_per_call}")
        # NOTE: BlockKeys had no bound (block_tokens=1, 140k tokens: every key computed, then
        # grpc's "Sent message larger than max", counted as OK); a token Lookup checked after
        n_blocks = len(token_ids) // spec.block_tokens
        if n_blocks > self.limits.max_keys_per_call:
            raise InvalidArgument(
                f"{n_blocks} blocks of {spec.block_tokens} tokens exceed "
                f"limits.max_keys_per_call={self.limits.max_keys_per_call}")
        keys = block_keys(ns, spec.fingerprint, spec.block_tokens, token_ids, extra or None,
                          parent=parent or ROOT_KEY)
        return ns, keys

    def resolve(self, principal: Principal, target: pb.Target, *, write: bool = False,
                packed: bool = False) -> Blocks:
        """Validate a Target: spec, namespace (read or write access), keys, parent, roots.
        ``packed``: keys sent packed stay so (:class:`kvstore.keys.PackedKeys`, for lookups)."""
        spec = spec_from_pb(target.spec, target.HasField("spec"))
        parent = parent_from_pb(target.parent)
        if target.roots:
            if target.WhichOneof("blocks") == "tokens":
                raise InvalidArgument("roots take keys, not token ids (the keys of token ids are a chain)")
            check_roots(True, _parent(parent))
            ns = resolve_namespace(principal, target.namespace, write=write)
            return Blocks(ns, spec, split_keys(target.keys, self.limits.max_keys_per_call), False, roots=True)
        if target.WhichOneof("blocks") == "tokens":
            extra = [list(e.items) for e in target.tokens.extra]
            ns, keys = self.keys_for(principal, spec, target.namespace, list(target.tokens.ids), extra,
                                     write=write, parent=parent)
            return Blocks(ns, spec, keys, True, parent)
        ns = resolve_namespace(principal, target.namespace, write=write)
        limit = self.limits.max_keys_per_call
        keys = packed_keys(target.keys, limit) if packed else split_keys(target.keys, limit)
        return Blocks(ns, spec, keys, False, parent)

    # -- operations ---------------------------------------------------------------------------
    def lookup(self, b: Blocks) -> tuple[int, list[str | None]]:
        """Longest usable prefix and the tier name of each of its blocks; of roots, how many
        keys are present and the tier name of each key (None: absent)."""
        if b.roots:
            tiers = self.store.lookup_roots(b.namespace, b.spec, b.keys)
            n = len(tiers) - tiers.count(None)
        else:
            result = self.store.lookup(b.namespace, b.spec, b.keys, parent=b.parent)
            n, tiers = result.num_blocks, result.tiers[: result.num_blocks]
        if self.metrics is not None:
            self.metrics.lookup(b.namespace, len(b.keys), n, self._known)
        return n, tiers

    def reserve_put(self, b: Blocks, since: int | None, session: str = "") -> PutReservation:
        """Reserve tier slots for a put whose bytes arrive later (``Store.reserve_put``;
        ``since``: the caller's ``Principal.epoch``; ``session``: the put's, "" for none)."""
        # NOTE: the session was not passed: reserving made room (evicting other tenants' blocks)
        # before the commit found the session unknown, or HBM held by other sessions' pins
        return self.store.reserve_put(b.namespace, b.spec, b.keys, parent=b.parent, since=since,
                                      session=session or None, roots=b.roots)

    def commit_put(self, b: Blocks, reservation: PutReservation, data: Callable[[int], Any], session: str,
                   ttl_s: float | None, plane: str = "stream", *, p: Principal | None = None) -> int:
        """Publish a reserved put, all or nothing; ``data(i)``: block i's bytes where the
        reservation has no slot. The number of blocks written. With :attr:`auth` and ``p``, the
        principal must still be allowed to write ``b.namespace`` (checked under
        :meth:`AuthRegistry.holding`: a token rotated, a principal deleted or a grant revoked
        after the call began fails it, and nothing is stored)."""
        auth = self.auth
        if auth is not None and p is not None:
            with auth.holding(p, b.namespace, write=True):
                self.store.commit_put(reservation, data, session=session or None, ttl_s=ttl_s)
        else:
            self.store.commit_put(reservation, data, session=session or None, ttl_s=ttl_s)
        if self.metrics is not None:
            self.metrics.bytes_in.labels(plane=plane).inc(b.spec.block_nbytes * len(b.keys))
        return len(b.keys)

    def abort_put(self, reservation: PutReservation) -> None:
        self.store.abort_put(reservation)

    def lease(self, b: Blocks, stage: Callable[[int], np.ndarray],
              keys_after: int = 0) -> tuple[ReadLease, list[bool] | None]:
        """The longest usable prefix under a read lease (``Store.lease_prefix``): each block's
        bytes in place in its memory tier, or copied into ``stage(i)``. Release it in a finally.
        Nothing is counted here: the bytes count as they are served (:meth:`sent`, :meth:`served`).
        With ``b.roots``, every key that is stored (``Store.lease_roots``) and whether each
        was; else the second value is None (the lease's blocks are the leading ones).

        ``keys_after``: keys of the same get after ``b.keys``, read by later calls
        (``GetRequest.keys_after``, and the keys a Get cut at its stream limit): misses too
        when the prefix ends within ``b.keys``, at most ``limits.max_keys_per_call`` (what one
        call may ask for; the client says how many). Ignored for roots: the client asks for
        every root it wants answered, each counted once."""
        # NOTE: kvstore_bytes_out counted every leased byte here, bytes never sent included
        if b.roots:
            return self.store.lease_roots(b.namespace, b.spec, b.keys, stage)
        after = min(keys_after, self.limits.max_keys_per_call)
        return self.store.lease_prefix(b.namespace, b.spec, b.keys, stage, parent=b.parent, keys_after=after), None

    def _known(self, namespace: str) -> bool:
        """Whether ``namespace`` is still counted in the metrics as its call ends: not a tenant
        deleted while the call ran (always, without :attr:`auth`)."""
        return self.auth is None or known_namespace(self.auth, namespace)

    def sent(self, nbytes: int, plane: str) -> None:
        """``nbytes`` block bytes delivered to a client over ``plane`` (``stream``, ``shm``)."""
        if self.metrics is not None:
            self.metrics.bytes_out.labels(plane=plane).inc(nbytes)

    def served(self, namespace: str, spec: ModelSpec, blocks: int) -> None:
        """``blocks`` blocks of ``namespace`` delivered whole to a client: the prefill tokens
        they save (kvstore_saved_prefill_tokens)."""
        if self.metrics is not None:
            self.metrics.served(namespace, blocks, spec.block_tokens, self._known)

    @contextmanager
    def _region(self, principal: Principal, region_id: int, offsets: Sequence[int], nbytes: int,
                seq: int) -> Iterator[Region]:
        """The caller's region, its slots at ``offsets`` checked, for the duration of the block
        (call ``seq`` of the client: see :class:`~kvstore.service_resources.SlotUse`)."""
        with self.regions.using(principal.name, region_id, seq) as region:
            for off in offsets:
                region.check(off, nbytes)
            yield region

    def _stage(self, principal: str, nbytes: int, staged: list[np.ndarray]) -> np.ndarray:
        """A staging buffer for a block that cannot go straight between the region and a tier
        (a region read through its fd, a device tier), counted in the caller's in-flight bytes
        (``principal``'s, whatever namespace it targets; :meth:`_unstage` gives them back)."""
        # NOTE: counted per target namespace, a publisher of N shared namespaces held N times
        # the limit, and the other publishers of one were refused for its bytes
        self.inflight.take(principal, nbytes)
        buf = self.staging.take(nbytes)
        staged.append(buf)
        return buf

    def _unstage(self, principal: str, staged: list[np.ndarray]) -> None:
        for buf in staged:
            self.inflight.give(principal, buf.nbytes)
            self.staging.give(buf)
        staged.clear()

    def fence(self, principal: Principal, region_id: int, seq: int, timeout: float | None) -> None:
        """Return once the client's call ``seq`` on its region is not running and never will."""
        if not seq:
            raise InvalidArgument("seq is required")
        if not self.regions.fence(principal.name, region_id, seq, timeout):
            raise Unavailable(f"call {seq} on this region is still running")

    def put_local(self, principal: Principal, b: Blocks, region_id: int, offsets: Sequence[int],
                  session: str, ttl_s: float | None, seq: int = 0) -> int:
        """Store the blocks in the caller's region slots ``offsets``, all or nothing; the
        principal is re-validated at the commit (:meth:`commit_put`), and nothing is committed
        once the call is no longer active (``b.active``: cancelled, past its deadline).

        Each block is read from the region straight into its reserved tier slot; blocks without
        a host slot (a device tier, none reserved) go through a staging buffer where the region
        cannot be mapped safely (:meth:`kvstore.shm_attach.AttachedRegion.host_view`)."""
        nbytes = b.spec.block_nbytes
        check_slots(offsets, nbytes, len(b.keys))
        with self._region(principal, region_id, offsets, nbytes, seq) as region:
            reservation = self.reserve_put(b, principal.epoch, session)
            staged: list[np.ndarray] = []
            try:
                pairs: list[tuple[Any, Any]] = []
                data: dict[int, Any] = {}
                through: list[tuple[Any, np.ndarray]] = []  # (device slot, staged bytes)
                for i, dst in enumerate(reservation.views):
                    off = offsets[i]
                    if isinstance(dst, np.ndarray):
                        pairs.append((dst, RegionSlot(region, off)))
                        continue
                    mapped = region.host_view(off, nbytes)
                    if mapped is not None:
                        if dst is None:
                            data[i] = mapped  # read by the commit, as the caller's own bytes
                        else:
                            pairs.append((dst, mapped))  # a device slot, from the mapping
                        continue
                    buf = self._stage(principal.name, nbytes, staged)
                    pairs.append((buf, RegionSlot(region, off)))
                    if dst is None:
                        data[i] = buf
                    else:
                        through.append((dst, buf))
                self._copy(pairs)
                for dst, buf in through:
                    copy_bytes(dst, buf)
                if b.active is not None and not b.active():
                    # NOTE: as the Put stream: a caller told DEADLINE_EXCEEDED/CANCELLED must not
                    # find the blocks stored
                    raise FailedPrecondition("the PutLocal was cancelled or passed its deadline before it "
                                             "completed: nothing was stored")
                return self.commit_put(b, reservation, data.__getitem__, session, ttl_s, plane="shm",
                                       p=principal)
            except BaseException:
                self.abort_put(reservation)
                raise
            finally:
                self._unstage(principal.name, staged)

    def get_local(self, principal: Principal, b: Blocks, region_id: int, offsets: Sequence[int],
                  seq: int = 0, keys_after: int = 0) -> tuple[int, list[bool] | None]:
        """Copy the longest available prefix into the caller's region slots ``offsets``; the
        number of blocks, and (``b.roots``: every stored key, each into its own slot) whether
        each key was (None for a chain). Blocks in host memory tiers are written from their
        tier slot; the others are decoded straight into the slot where the region is mapped,
        else into a staging buffer written from there. ``keys_after``: as :meth:`lease` takes
        it (``GetLocalRequest.keys_after``: a chain read in pieces through the region)."""
        nbytes = b.spec.block_nbytes
        check_slots(offsets, nbytes, len(b.keys))
        with self._region(principal, region_id, offsets, nbytes, seq) as region:
            staged: list[np.ndarray] = []
            mapped: dict[int, np.ndarray] = {}

            def stage(i: int) -> np.ndarray:
                view = region.host_view(offsets[i], nbytes)
                if view is not None:
                    mapped[i] = view
                    return view
                return self._stage(principal.name, nbytes, staged)

            try:
                lease, present = self.lease(b, stage, keys_after)
                try:
                    # the key of each served block (roots: the keys present, in order)
                    of = range(len(lease.views)) if present is None else [i for i, hit in enumerate(present) if hit]
                    # blocks leased in place are copied here; the others were decoded into their
                    # slot, or into staging
                    self._copy([(RegionSlot(region, offsets[i]), src) for i, src in zip(of, lease.views)
                                if src is not mapped.get(i)])
                    n = len(lease.views)
                finally:
                    lease.release()
                # NOTE: counted when leased before: a copy that failed counted bytes never served
                self.sent(n * nbytes, "shm")
                self.served(b.namespace, b.spec, n)
                return n, present
            finally:
                self._unstage(principal.name, staged)

    def session(self, principal: Principal, verb: str, session_id: str, namespace: str = "") -> SessionState:
        """``verb`` is one of open, pause, resume, close; the session's state after it. The
        session lives in ``namespace`` (resolved for writing, as a put's: "" is the caller's
        own; a publisher of several namespaces names one, the namespace its puts with
        ``session=`` name)."""
        if not session_id:
            raise InvalidArgument("session_id is required")
        size = len(session_id.encode())
        if size > self.limits.max_session_id_bytes:
            raise InvalidArgument(f"session_id is {size} bytes, more than "
                                  f"limits.max_session_id_bytes={self.limits.max_session_id_bytes}")
        # NOTE: this resolved "" always: a publisher of several namespaces could not use sessions
        ns = resolve_namespace(principal, namespace, write=True)
        # NOTE: a session lives until closed: without a bound (max_sessions), memory grew per id
        return self.store.session_verb(ns, session_id, verb, max_sessions=self.limits.max_sessions_per_tenant)

    def prefetch(self, b: Blocks, tier: Tier) -> int:
        if b.roots:
            raise InvalidArgument("Prefetch takes a chain, not roots (Target.roots)")
        return int(self.store.prefetch(b.namespace, b.spec, b.keys, tier=tier.label, parent=b.parent))

    def delete(self, principal: Principal, namespace: str, packed: bytes) -> int:
        """Delete blocks (audited, whatever the outcome: a refused namespace or malformed keys
        too, under the namespace as asked; the outcome of one made says ``blocks=N``, the blocks
        removed with their descendants). The deletion is recorded before it is made, and not
        made when that record cannot be written (:class:`~kvstore.audit.Recorder`)."""
        count = f"{len(packed) // KEY_BYTES} keys" if len(packed) % KEY_BYTES == 0 else f"{len(packed)} bytes of keys"
        audit = Recorder(self.audit, "blocks.delete", namespace or principal.name, count)
        try:
            ns = audit.target = resolve_namespace(principal, namespace, write=True)
            keys = split_keys(packed, self.limits.max_keys_per_call)
            audit.begin(principal.name)
            n = int(self.store.delete(ns, keys))
        except Exception as exc:
            try:
                audit.end(principal.name, exc.code if isinstance(exc, KVStoreError) else "INTERNAL")
            except KVStoreError as failed:  # NOTE: the delete's own error goes on, not this one
                log.error("a failed delete of %s was not audited: %s", audit.target, failed)
            raise
        # NOTE: the outcome names how many blocks went (descendants included), as a model
        # purge's does: "1 keys" alone left what a delete destroyed off the record
        audit.detail = f"{count} blocks={n}"
        try:
            audit.end(principal.name, "OK")
        except KVStoreError as exc:
            raise FailedPrecondition(f"the blocks were deleted, but {exc}") from None
        return n

    def stats(self, principal: Principal) -> dict[str, Any]:
        return scope_stats(self.store.stats(), principal.readable)


def _copy_part(pairs: Sequence[tuple[Any, Any]]) -> None:
    reads: dict[int, tuple[Region, list[tuple[int, Any]]]] = {}
    writes: dict[int, tuple[Region, list[tuple[int, Any]]]] = {}
    for dst, src in pairs:
        if isinstance(src, RegionSlot):
            reads.setdefault(id(src.region), (src.region, []))[1].append((src.offset, dst))
        elif isinstance(dst, RegionSlot):
            writes.setdefault(id(dst.region), (dst.region, []))[1].append((dst.offset, src))
        else:
            copy_bytes(dst, src)
    for region, items in reads.values():
        region.read_into(items)
    for region, items in writes.values():
        region.write_from(items)


def scope_stats(stats: dict[str, Any], readable: frozenset[str] | None) -> dict[str, Any]:
    """What a caller may see of the Store's statistics (``readable=None``, the admin: all).

    A tenant or publisher sees the usage of the namespaces it reads, per tier, and each tier's
    capacity; nothing store-wide. (It saw every counter before: other tenants' hits, sessions,
    deletions and evictions moved its numbers, so it could watch their activity.)"""
    if readable is None:
        return stats
    out: dict[str, Any] = {}
    for key in ("tenants", "per_tenant", "namespaces"):
        value = stats.get(key)
        if isinstance(value, dict):
            out[key] = {t: v for t, v in value.items() if t in readable}
    out["tiers"] = {t: {"capacity_bytes": v["capacity_bytes"]} for t, v in stats.get("tiers", {}).items()
                    if isinstance(v, dict) and "capacity_bytes" in v}
    return out