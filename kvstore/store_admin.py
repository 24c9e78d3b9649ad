"""Administration of the Store: delete blocks, drop tenants, purge models, set rules, expire.

A mixin of :class:`kvstore.store.Store`, like :mod:`kvstore.store_reserve`: it uses the Store's
lock, index, placement, session table, keyring, quantization policy and remote tier.

* ``delete``, ``drop_tenant`` and ``purge_model`` remove blocks, with the descendants that depend
  on them, from every local tier in one NVMe transaction, and their copies from the remote tier
  first, all or nothing here (Unavailable when the remote tier cannot be reached, and nothing
  deleted locally; ``delete``: every remote descendant, whichever server wrote it, through the
  remote tier's children sets). The remote part runs without the Store's lock: the remote
  writer's filter (``deleting`` for a subtree, ``purging`` for a model or a tenant) is held
  from before the lock is released until the local part is done instead, so no block put or
  demoted meanwhile is written behind the deletion; :meth:`Store.close` waits for them.
  ``drop_tenant`` also forgets the tenant's sessions and rules, destroys its data key
  and leaves a tombstone in the remote tier (no server writes its older blocks there again).
* ``_deleted_elsewhere`` — what the remote tier's reader hands over when another server sharing
  it deleted blocks, purged a model or dropped a tenant (:mod:`tiers.remote_invalidate`): the
  local copies go too, with their local subtrees, and their queued demotions; remotely, only
  the copies this server wrote there recently (which may have landed after the deletion).
* ``expire`` drops every local block past its TTL deadline with its subtree (``lookup`` does the
  same first, through ``_expire_due``).
* ``set_tenant_policy`` sets a tenant's TTL and per-tier quotas (a :class:`TenantPolicy`) and its
  NVMe quantization, ``set_model_quantization`` a model's. A TTL caps at once the deadline of
  every block the tenant holds, in every tier, at now + TTL (a block without one gets it, one
  expiring sooner keeps its own), and every put or re-put from then on; raising or removing it
  extends no deadline. A new quantization applies to blocks written from then on. A quota on a
  tier this server does not have is refused (or skipped with a warning: a stored policy of a
  tier since configured away, re-applied at a start).
* ``set_model_ttl`` sets a model fingerprint's TTL (a rollout ageing out the old model's blocks):
  as a tenant's, for every block of the model whatever its tenant; a block gets at most now +
  the lesser of its tenant's and its model's TTL, at a put, a re-put and a promotion.
* ``session_ids``, ``session_info`` and ``end_session`` — the operator's view of the open sessions
  and the close of one (an engine that died leaves its session pinning HBM until its idle expiry);
  a look is no use of a session (its idle time stays).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstore.block import BlockMeta, SessionState, Tier
from kvstore.errors import InvalidArgument, NotFound
from kvstore.expiry import check_ttl
from kvstore.keys import check_keys
from kvstore.sessions import Session
from tiers.remote_invalidate import Deletion

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TenantPolicy:
    ttl_s: float | None = None
    quota_bytes: dict[Tier, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """An open session as an operator sees it (:meth:`TenantAdmin.session_info`)."""

    tenant: str  #: the namespace it lives in (a tenant, or a shared namespace)
    session: str
    state: SessionState  #: ACTIVE, PAUSED or RESUMED
    blocks: int  #: the resident blocks it holds
    nbytes: int  #: their nominal size (what quotas count)
    pinned_blocks: int  #: of them, those it pins in HBM: all while ACTIVE/RESUMED, none PAUSED
    pinned_bytes: int
    idle_s: float  #: seconds since its last use, on the Store's clock
    #: of the pinned, those no other session pins: what closing it frees in HBM. NOTE: the
    #: pinned figures alone count a prefix two sessions share in both; an operator closing one
    #: was told its blocks were unpinned while the other kept them pinned
    only_pinned_blocks: int = 0
    only_pinned_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model with blocks in the Store (:meth:`TenantAdmin.models`)."""

    fingerprint: bytes  #: ModelSpec.fingerprint: what purge_model takes
    model: str
    revision: str
    dtype: str
    block_tokens: int
    blocks: int  #: its blocks held here (memory tiers and NVMe)
    nbytes: int  #: their nominal size
    tenants: int  #: namespaces holding them


class TenantAdmin:
    """Store methods of tenant and model administration and expiry (see the module docstring)."""

    def models(self) -> list[ModelInfo]:
        """Every model with blocks here, most bytes first: its fingerprint (what
        :meth:`purge_model` takes) and the spec it came from, blocks, bytes and namespaces.
        Why: an operator rolling a model out had no way to learn the fingerprint to purge but
        to compute ``ModelSpec.fingerprint`` in Python from every field of the old spec.
        Holds the Store's lock only to copy the index (the counting runs without it). Copies
        held only by a remote tier are not counted."""
        with self._lock:
            self._check_open()
            metas = list(self._index)
            specs = dict(self._specs)
        count: dict[bytes, list[Any]] = {}
        for m in metas:
            c = count.setdefault(m.fingerprint, [0, 0, set()])
            c[0] += 1
            c[1] += m.nbytes
            c[2].add(m.tenant)
        out = []
        for fp, (blocks, nbytes, tenants) in count.items():
            spec = specs.get(fp)
            out.append(ModelInfo(fp, spec.model if spec else "", spec.revision if spec else "",
                                 spec.dtype if spec else "", spec.block_tokens if spec else 0,
                                 blocks, nbytes, len(tenants)))
        return sorted(out, key=lambda i: (-i.nbytes, i.fingerprint))

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Delete the blocks (and the descendants that depend on them); returns how many
        blocks were removed (each once, whether it had a local copy, a remote one or both).

        With a remote tier, the remote copies go first: each key's under every model written
        there (by any server), and every block written under them by any server (:meth:`RemoteTier.delete_subtrees`
        follows the children sets each remote write records; the subtree held here is passed
        too, for copies an older version wrote without them). When any cannot be reached,
        :class:`Unavailable` is raised and nothing is deleted here, so a retry deletes the same
        subtree. Costs one pipelined round trip per level of the remote subtree, without the
        Store's lock: other calls go on meanwhile (a block put under a deleted one meanwhile is
        deleted too, here and before it reaches the remote tier)."""
        self._check_tenant(tenant)
        keys = check_keys(keys)
        if self._remote is None:
            with self._lock, self._batch():
                self._check_open()
                return len(self._delete_local(tenant, keys))
        with ExitStack() as stack:
            with self._lock:
                self._check_open()
                self._deletes_open += 1  # Store.close waits for it
                stack.callback(self._delete_ended)
                self._removals += 1  # a get fetching from the remote tier now promotes nothing
                fps = set(self._specs)
                held = [(d.key, d.fingerprint) for d in self._subtrees_of(tenant, keys)[1]]
                # NOTE: the writer's filter is set before the lock goes: a block put under one
                # of these and demoted meanwhile is not written (placement's spill_remote asks)
                doom = stack.enter_context(self._remote.deleting(tenant, [*keys, *(k for k, _ in held)]))
            # every model written to the remote tier, by any server: this one may never have
            # seen the model (restarted, another replica; the service's Delete says none)
            fps |= self._remote.models()
            start = dict.fromkeys([(key, fp) for key in keys for fp in fps] + held)
            # NOTE: the Store's lock is not held over the remote part (one round trip per level
            # of the remote subtree: 0.3 s for a 2,048-block chain, during which every other
            # call of every tenant waited); the writer's filter is, until the local part is
            # done, so no block demoted meanwhile is written back behind the deletion
            # NOTE: raises before anything local goes (it said "ok" and the copies came back)
            gone = self._remote.delete_subtrees(tenant, list(start), doom)
            if not start:  # NOTE: no model known anywhere: still the other servers' copies go
                self._remote.publish_deletion(tenant, keys)
            with self._lock, self._batch():
                self._check_open()
                self._removals += 1  # a get that fetched meanwhile promotes nothing either
                local = self._delete_local(tenant, keys)
            gone |= doom(local)  # demotions queued meanwhile by blocks now deleted
        # NOTE: blocks, not copies: a block with a remote copy counted twice
        return len(gone | local)

    def _delete_ended(self) -> None:
        with self._lock:
            self._deletes_open -= 1
            self._deletes_done.notify_all()

    def _delete_local(self, tenant: str, keys: Iterable[bytes], reason: str = "deleted") -> set[bytes]:
        """Drop the local blocks ``keys`` of ``tenant`` with their subtrees (counted ``reason``);
        returns the keys dropped. Caller holds the lock and an NVMe batch."""
        roots, blocks = self._subtrees_of(tenant, keys)
        for m in roots:
            self._place.drop(m, reason=reason)
        return {d.key for d in blocks}

    def _subtrees_of(self, tenant: str, keys: Iterable[bytes]) -> tuple[list[BlockMeta], list[BlockMeta]]:
        """(roots, blocks): the local blocks of ``keys`` that lie under no other of them, and
        every block of their subtrees; each subtree walked once, the shallowest first.

        NOTE: a delete (or another server's deletion entry) names every block of a chain, and
        each one's subtree was walked: a 2,048-block chain took two million visits, seconds
        under the Store's lock with every call of every tenant waiting."""
        named = sorted((m for k in dict.fromkeys(keys) if (m := self._index.get(tenant, k)) is not None),
                       key=lambda m: m.depth)
        roots: list[BlockMeta] = []
        blocks: list[BlockMeta] = []
        seen: set[bytes] = set()
        for m in named:
            if m.key in seen:
                continue
            roots.append(m)
            for d in self._index.subtree(m):
                seen.add(d.key)
                blocks.append(d)
        return roots, blocks

    def _purge_local(self, fingerprints: Collection[bytes], reason: str) -> list[BlockMeta]:
        """Remove every local block of the models ``fingerprints``, deepest first (counted
        ``reason``); returns them. Caller holds the lock and an NVMe batch."""
        victims = sorted((m for m in self._index if m.fingerprint in fingerprints), key=lambda m: -m.depth)
        for m in victims:
            self._place.remove(m)
        self.counters.add(reason, len(victims))
        return victims

    def _deleted_elsewhere(self, d: Deletion) -> int:
        """Drop the local copies of what another server sharing the remote tier deleted (an
        entry of its deletions stream, from the tier's reader thread): the blocks ``d.keys``
        with their local subtrees, of each tenant here whose hash is ``d.tenant``, or every
        block of the model purged, or every block of each tenant here whose hash is
        ``d.tenant`` (another server's ``drop_tenant``); counted ``deleted_elsewhere``. A
        dropped tenant's sessions, rules and this server's own NVMe data key stay (the tenant
        may go on here; its next blocks are new ones), and so does anything of a tenant this
        server holds no blocks of (nothing to drop; the remote tier has forgotten its cached
        shared data key either way).

        In the remote tier, only what this server itself wrote there recently of it goes
        (:meth:`RemoteTier.delete_rewritten`: a demotion that landed after the other server's
        deletion, before this entry was read, brought the block back for every server); the
        rest the other server deleted. The remote writer's filter for the deletion is held
        from before the local part until then, and the Redis round trips are made without the
        Store's lock. Returns how many blocks were dropped here."""
        from kvstore.codec import tenant_hash

        assert self._remote is not None
        with self._lock:
            if self._closed:
                return 0
            # NOTE: first, whatever this server holds: a get fetching from the remote tier now
            # promotes nothing (one in flight when the tenant held nothing here promoted the
            # deleted blocks after this entry was applied, and served them from then on)
            self._removals += 1
            held = {t for (t, _), n in self._place.tenant_usage.items() if n}
        names: set[str] = set()  # a model's filter and deletions are not per tenant
        if d.kind != "model":
            names = self._remote.rewritten_tenants(d) | {t for t in held if tenant_hash(t).hex() == d.tenant}
        with ExitStack() as stack:
            # NOTE: the writer's filter first: a block demoted before the lock is taken is not
            # written back to the remote tier behind the deletion
            cancel = self._elsewhere_filter(stack, d, names)
            local = self._drop_elsewhere(d, names)
            if local is None:
                return 0
            cancel(local)  # demotions queued meanwhile by blocks now dropped
            dropped = sum(map(len, local.values()))
            # NOTE: this server's demotions that landed in Redis after the other server deleted
            # the blocks, before this entry was read, were left there (served to every server,
            # promoted, and the deletion undone); not under the Store's lock (round trips)
            again = self._remote.delete_rewritten(d, local)
            if again:  # a get here may have promoted them before they went: dropped too
                dropped += self._drop_promoted(again)
                cancel(again)
        return dropped

    def _elsewhere_filter(self, stack: ExitStack, d: Deletion,
                          names: Collection[str]) -> Callable[[Mapping[str, Collection[bytes]]], None]:
        """Set the remote writer's filter for what ``d`` deletes (``deleting`` for each tenant
        ``names`` of a blocks entry, ``purging`` for the model, or for each tenant ``names`` of
        a tenant entry; held until ``stack`` closes) and wait for a demotion it matches in
        flight. Returns ``cancel(keys)``: cancels the demotions queued since, of the blocks
        ``keys`` (per tenant) for a blocks entry, of the model or tenants otherwise. Called
        without the Store's lock (it waits for a write)."""
        assert self._remote is not None
        if d.kind == "subtree":
            dooms = {t: stack.enter_context(self._remote.deleting(t, d.keys)) for t in names}

            def doom(keys: Mapping[str, Collection[bytes]]) -> None:
                for t, each in dooms.items():
                    each(keys.get(t, ()))
            doom({})
            return doom
        if d.kind == "model":
            cancels = [stack.enter_context(self._remote.purging(fingerprint=d.fingerprints[0]))]
        else:
            cancels = [stack.enter_context(self._remote.purging(tenant=t)) for t in names]

        def purged(_: Mapping[str, Collection[bytes]]) -> None:
            for each in cancels:
                each()
        purged({})
        return purged

    def _drop_elsewhere(self, d: Deletion, names: Collection[str]) -> dict[str, set[bytes]] | None:
        """The local part of :meth:`_deleted_elsewhere`: drops what ``d`` deleted of the
        tenants ``names`` (of every tenant for a model); returns the keys dropped per tenant,
        None when the Store is closed."""
        with self._lock:
            if self._closed:
                return None
            with self._batch():
                self._removals += 1
                if d.kind == "model":
                    out: dict[str, set[bytes]] = {}
                    for m in self._purge_local(d.fingerprints, "deleted_elsewhere"):
                        out.setdefault(m.tenant, set()).add(m.key)
                    return out
                if d.kind == "tenant":  # its blocks only: its sessions, rules and local data key stay
                    out = {t: self._remove_tenant_blocks(t) for t in names}
                    self.counters.add("deleted_elsewhere", sum(map(len, out.values())))
                    return out
                return {t: self._delete_local(t, d.keys, "deleted_elsewhere") for t in names}

    def _drop_promoted(self, removed: Mapping[str, Collection[bytes]]) -> int:
        """Drop the local copies (with their subtrees) of the blocks ``removed`` (per tenant):
        this server's rewrites of a deletion made elsewhere, which a get may have promoted
        before they were deleted from Redis; returns how many were dropped."""
        with self._lock:
            if self._closed:
                return 0
            with self._batch():
                self._removals += 1  # a get that fetched one of them meanwhile promotes nothing
                return sum(len(self._delete_local(t, keys, "deleted_elsewhere")) for t, keys in removed.items())

    def _remove_tenant_blocks(self, tenant: str) -> set[bytes]:
        """Remove every local block of ``tenant``, deepest first; returns their keys. Caller
        holds the lock and an NVMe batch."""
        gone: set[bytes] = set()
        for m in sorted(self._index.of_tenant(tenant), key=lambda m: -m.depth):
            if self._index.get(m.tenant, m.key) is m:
                self._place.remove(m)
                gone.add(m.key)
        return gone

    def drop_tenant(self, tenant: str, *, namespace_stays: bool = False, local_only: bool = False) -> int:
        """Remove every block of ``tenant`` from every tier and destroy its data key; returns how
        many blocks were removed (each once, whatever copies it had).

        A put reserved before the drop fails (:meth:`reserve_put` ``since``): Unauthenticated,
        the tenant being gone; with ``namespace_stays`` (a shared namespace whose blocks an
        admin drops, its publishers and grants kept), Aborted, which the caller may retry.

        With a remote tier, the remote part goes first (its tombstone, its shared data key,
        its values): when the remote tier cannot be reached, :class:`Unavailable` is raised
        and nothing is deleted here (before, the local blocks and key went first, and the
        tenant's remote copies were served and promoted again until a retry); a retry deletes
        it all. The remote part (a ``SCAN`` of the whole keyspace) runs without the Store's
        lock, under the remote writer's filter for the tenant (as :meth:`purge_model`'s): a put
        of the tenant meanwhile is dropped by the local part, and none of its blocks is
        written to the remote tier.

        ``local_only``: this server's blocks, data key and queued demotions of ``tenant`` go,
        and nothing in the remote tier (no tombstone, its shared data key, values and the
        other servers' copies stay, nothing is published): for leftovers of a name this server
        has no principal of, which another server sharing the remote tier may serve."""
        self._check_tenant(tenant)
        with ExitStack() as stack:
            # the remote part destroys its shared data key, then its values
            purge = (lambda r: set()) if local_only else (lambda r: r.purge_tenant(tenant))
            cancel, gone = self._purge_remote(stack, purge, tenant=tenant)
            n = self._drop_locally(tenant, gone, namespace_stays)
            if cancel is not None:
                cancel()  # demotions queued meanwhile by blocks now dropped
        return n

    def _purge_remote(self, stack: ExitStack, purge: Callable[[Any], set],
                      **which: Any) -> tuple[Callable[[], Any] | None, set]:
        """The opening of :meth:`drop_tenant` and :meth:`purge_model`: under the lock, a get
        fetching from the remote tier now promotes nothing and, with a remote tier,
        :meth:`close` waits for the caller (until ``stack`` closes) and the remote writer's
        filter ``which`` (``tenant=`` or ``fingerprint=``) is set, held until ``stack``
        closes; then, without the lock, the queued demotions it matches are cancelled and
        ``purge(remote)`` runs. Returns (the filter's cancel, or None without a remote tier;
        what ``purge`` returned, or an empty set)."""
        with self._lock:
            self._check_open()
            self._removals += 1
            if self._remote is None:
                return None, set()
            self._deletes_open += 1  # Store.close waits for it
            stack.callback(self._delete_ended)
            cancel = stack.enter_context(self._remote.purging(**which))
        cancel()  # NOTE: not under the lock: it waits for a write it matches in flight
        return cancel, purge(self._remote)

    def _drop_locally(self, tenant: str, gone: set[bytes], namespace_stays: bool = False) -> int:
        """The local part of :meth:`drop_tenant` (``gone``: the keys its remote part removed);
        returns how many blocks were removed in all."""
        with self._lock, self._batch():
            self._check_open()
            if self.keyring is not None:
                # NOTE: first, durably (its own LMDB): the block deletions below are committed
                # before the key goes, and a crash between the two left the key for good (a
                # tenant created again under the name got it); the next open destroys a
                # condemned key (Store._recover), after dropping whatever blocks it still has
                self.keyring.condemn(tenant)
            self._removals += 1  # a get that fetched meanwhile promotes nothing either
            self._drop_epoch += 1  # NOTE: a reservation made before fails its commit
            self._dropped_at[tenant] = self._drop_epoch
            if not namespace_stays:
                self._deleted_at[tenant] = self._drop_epoch
            gone |= self._remove_tenant_blocks(tenant)
            n = len(gone)
            self._sessions.drop_tenant(tenant, namespace_stays=namespace_stays)
            self._tenant_policy.pop(tenant, None)
            self._place.priorities.pop(tenant, None)
            self.quant_policy.forget_tenant(tenant)
            if self.keyring is not None:
                # NOTE: the deletions are committed before the key goes (its own LMDB, committed
                # at once): a crash between the two left blocks that no key could open
                # (recovery now drops such blocks too)
                if self._nvme is not None:
                    self._nvme.commit_now()
                self.keyring.destroy(tenant)
            self.counters.add("deleted", n)
            return n

    def purge_model(self, fingerprint: bytes) -> int:
        """Remove every block of a model fingerprint (e.g. after a rollout); returns how many
        blocks were removed (each once). The remote copies go first: :class:`Unavailable`
        (nothing deleted here) when they cannot be reached. The remote part (a ``SCAN`` of
        the whole keyspace) runs without the Store's lock, like :meth:`delete`'s, under the
        remote writer's filter for the model: no demotion of one of its blocks, queued before
        or meanwhile, is written behind the purge (they were, and served again)."""
        from kvstore.codec import tenant_hash

        self._check_fingerprint(fingerprint)  # NOTE: any other value returned 0, deleting nothing
        with ExitStack() as stack:
            cancel, gone = self._purge_remote(stack, lambda r: r.purge_model(fingerprint), fingerprint=fingerprint)
            with self._lock, self._batch():
                self._check_open()
                self._removals += 1  # a get that fetched meanwhile promotes nothing
                victims = self._purge_local({fingerprint}, "deleted")
            if cancel is not None:
                cancel()  # demotions queued meanwhile by blocks now purged
        hashes: dict[str, str] = {}
        for m in victims:
            th = hashes.get(m.tenant) or hashes.setdefault(m.tenant, tenant_hash(m.tenant).hex())
            gone.add((th, m.key))
        return len(gone)

    def set_tenant_policy(self, tenant: str, ttl_s: float | None = None,
                          quota_bytes: dict[str, int] | None = None,
                          quantization: str | None = None, priority: int = 0, *,
                          absent_tiers: Literal["skip", "refuse"] = "skip", enforce: bool = True) -> None:
        """Per-tenant TTL, per-tier quotas in bytes, and the format of the tenant's blocks
        written to NVMe from now on: ``"int8"``, ``"fp8_e4m3"`` (``"/head"`` for per-head key
        scales), ``"none"`` = lossless even where a model rule quantizes; None = no tenant rule
        (the model's rule or StoreConfig.nvme_quantization).

        The TTL is the operator's retention: the default of a put that gives none, the most a
        put's own ``ttl_s`` gets, and the most a re-put extends a block to (now + TTL); and at
        once, every block the tenant holds is capped at now + TTL (one without a deadline gets
        it, one expiring sooner keeps its own): in the index, in its NVMe record, and (with a
        remote tier) its copies in Redis, written by this server or another, through the remote
        writer (:meth:`RemoteTier.cap_ttl`: its queued demotions at once, the copies in Redis
        next, in the background). NOTE: before, it applied only to blocks put afterwards: blocks
        put without a TTL outlived a retention set later, even when put again. Raising or
        removing the TTL extends no deadline (a block keeps the one it has until put again).

        ``priority``: when a tier makes room, every evictable block of a tenant of lower
        priority goes before any of a higher one; the policy orders blocks of equal priority
        (0 for every tenant by default). Quotas still bound what a tenant holds; a quota lower
        than what the tenant holds evicts (demotes) its own blocks at once. A quota on a tier
        this server does not have (NVMe with ``nvme_bytes`` 0, the remote tier without
        ``[store.remote]``) binds nothing: ``absent_tiers="refuse"`` raises InvalidArgument
        (what an operator setting one must be told), ``"skip"`` logs a warning and keeps it (a
        stored policy re-applied at a start after the tier was configured away).

        ``enforce=False`` puts the policy in force for what comes (puts, evictions) without
        touching the blocks stored (no deadline capped, no block demoted to fit a quota): a
        caller that must save the policy before it takes effect (the Admin plane) then calls
        :meth:`enforce_tenant_policy`. NOTE: a policy set whose save then failed had already
        cut every stored block's lifetime, which no rollback can give back."""
        from kvstore.quantization import Quantization

        self._check_tenant(tenant)
        ttl_s = check_ttl(ttl_s)
        if quota_bytes is not None and not isinstance(quota_bytes, Mapping):
            raise InvalidArgument(f"quota_bytes must map tier names to bytes, got {type(quota_bytes).__name__}")
        for name, q in (quota_bytes or {}).items():
            if isinstance(q, bool) or not isinstance(q, int) or q < 0:  # NOTE: True was a 1-byte quota
                raise InvalidArgument(f"quota for {name!r} must be a non-negative int")
        quotas = Tier.each_once((quota_bytes or {}).items())  # NOTE: {"HBM": 5, "hbm": 7} kept one, silently
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidArgument(f"priority must be an int, got {priority!r}")
        quant = Quantization.parse(quantization) if quantization is not None else None
        have = [*self.tiers, *([Tier.REMOTE] if self._remote is not None else [])]
        absent = [t.label for t in quotas if t not in have]
        if absent and absent_tiers == "refuse":
            raise InvalidArgument(f"quota for tier {absent[0]!r}: this server has no {absent[0]} tier "
                                  f"(its tiers are {', '.join(t.label for t in have)})")
        if absent:
            log.warning("the policy of %r has a quota on %s, which this server does not have: it binds nothing",
                        tenant, ", ".join(absent))
        with self._lock, self._batch():
            self._tenant_policy[tenant] = TenantPolicy(ttl_s, quotas)
            if enforce:
                self._enforce_policy(tenant)
            if priority:
                self._place.priorities[tenant] = priority
            else:
                self._place.priorities.pop(tenant, None)
            if quantization is None:  # NOTE: "none" (quant None) is an explicit lossless rule
                self.quant_policy.clear(tenant=tenant)
            else:
                self.quant_policy.set(quant, tenant=tenant)

    def enforce_tenant_policy(self, tenant: str) -> None:
        """Apply ``tenant``'s policy (set with ``enforce=False``) to the blocks it holds: the
        TTL caps their deadlines, a quota lower than what it holds demotes its own blocks."""
        self._check_tenant(tenant)
        with self._lock, self._batch():
            self._enforce_policy(tenant)

    def _enforce_policy(self, tenant: str) -> None:
        """(Lock held, in a batch.) The tenant's TTL caps its stored blocks at now + TTL; a
        quota lowered below what it holds takes effect now: it stayed over it until its next
        put. (Pinned blocks stay; the quota still bounds new ones.)"""
        policy = self._tenant_policy.get(tenant)
        if policy is None:
            return
        if policy.ttl_s is not None:
            self._cap_deadlines(tenant, self._clock() + policy.ttl_s)
        for tier in policy.quota_bytes:
            if tier in self.tiers:
                self._place.fit_quota(tenant, tier)

    def _cap_deadlines(self, tenant: str, cap: float) -> int:
        """No block of ``tenant`` outlives ``cap``: the later deadlines (and none) of its blocks
        are moved there, in the index and in their NVMe records, and (with a remote tier) its
        copies there are capped through the writer; returns how many local blocks moved.
        Caller holds the lock and an NVMe batch."""
        moved = self._cap_local(self._index.of_tenant(tenant), cap)
        if self._remote is not None:
            # NOTE: under the lock: a block spilled from now on carries its capped deadline,
            # and the demotions queued before are capped in the queue
            self._remote.cap_ttl(tenant, cap)
        if moved:
            self.counters.add("ttl_capped", moved)
        return moved

    def _cap_local(self, metas: Iterable[BlockMeta], cap: float) -> int:
        """Move the deadlines of ``metas`` later than ``cap`` (or none) to ``cap``, in the index
        and in their NVMe records; returns how many moved. Caller holds the lock and a batch."""
        moved = 0
        for m in metas:
            if m.ttl_deadline is not None and m.ttl_deadline <= cap:
                continue
            m.ttl_deadline = cap
            self._index.deadline_moved(m)
            if self._nvme is not None and (m.persisted or m.tier == Tier.NVME):
                self._nvme.update_record(self._place.record(m))  # NOTE: a restart reads it there
            moved += 1
        return moved

    def set_model_ttl(self, fingerprint: bytes, ttl_s: float | None, *, enforce: bool = True) -> None:
        """A TTL for every block of the model ``fingerprint`` (``ModelSpec.fingerprint``), every
        tenant's: the most a put, a re-put or a promotion gives one of its blocks is now + the
        lesser of this and its tenant's TTL (``set_tenant_policy``); and at once (unless
        ``enforce=False``: then :meth:`enforce_model_ttl`), every stored block of the model is
        capped at now + TTL, in the index, its NVMe record and its copies in Redis, any
        server's (:meth:`RemoteTier.cap_model_ttl`, in the background), as a tenant's TTL caps
        the tenant's. None removes it; raising or removing it extends no deadline. Why: a
        rollout could only purge the old model's blocks at once, not age them out while the
        new model's cache warms. InvalidArgument for a fingerprint not of
        ``FINGERPRINT_BYTES`` bytes or a TTL out of range (:func:`check_ttl`)."""
        self._check_fingerprint(fingerprint)
        ttl_s = check_ttl(ttl_s)
        with self._lock, self._batch():
            self._check_open()
            if ttl_s is None:
                self._model_ttl.pop(fingerprint, None)
            else:
                self._model_ttl[fingerprint] = ttl_s
            if enforce:
                self._enforce_model_ttl(fingerprint)

    def model_ttl(self, fingerprint: bytes) -> float | None:
        """The TTL of the model ``fingerprint`` in force here (:meth:`set_model_ttl`), None: none."""
        self._check_fingerprint(fingerprint)
        with self._lock:
            return self._model_ttl.get(fingerprint)

    def enforce_model_ttl(self, fingerprint: bytes) -> int:
        """Cap every stored block of the model at now + its TTL (set with ``enforce=False``);
        returns how many local blocks moved."""
        self._check_fingerprint(fingerprint)
        with self._lock, self._batch():
            self._check_open()
            return self._enforce_model_ttl(fingerprint)

    def _enforce_model_ttl(self, fingerprint: bytes) -> int:
        """(Lock held, in a batch.) :meth:`enforce_model_ttl`."""
        ttl_s = self._model_ttl.get(fingerprint)
        if ttl_s is None:
            return 0
        cap = self._clock() + ttl_s
        # NOTE: a scan of the index (it is not kept by model): an operator's call, rare
        moved = self._cap_local([m for m in self._index if m.fingerprint == fingerprint], cap)
        if self._remote is not None:
            self._remote.cap_model_ttl(fingerprint, cap)  # under the lock, as _cap_deadlines
        if moved:
            self.counters.add("ttl_capped", moved)
        return moved

    def set_model_quantization(self, fingerprint: bytes, quantization: str | None) -> None:
        """Format of a model's blocks written to NVMe from now on (see set_tenant_policy; a
        tenant's own rule wins); None removes the model rule."""
        from kvstore.quantization import Quantization

        self._check_fingerprint(fingerprint)
        quant = Quantization.parse(quantization) if quantization is not None else None
        with self._lock:
            self._check_open()  # NOTE: a rule set on a closed store was taken and lost
            if quantization is None:  # NOTE: "none" (quant None) is an explicit lossless rule
                self.quant_policy.clear(model=fingerprint)
            else:
                self.quant_policy.set(quant, model=fingerprint)

    def session_ids(self, tenant: str | None = None) -> list[tuple[str, str]]:
        """The open sessions as ``(namespace, session id)``, sorted; only ``tenant``'s when given."""
        with self._lock:
            ids = [k for k in self._sessions if tenant is None or k[0] == tenant]
        return sorted(ids)

    def session_info(self, tenant: str, session: str) -> SessionInfo | None:
        """The session as it is now, None when no such session is open. No use of it: its
        idle time (and so its idle expiry) stays as it was."""
        with self._lock:
            sess = self._sessions.peek(tenant, session)
            return None if sess is None else self._session_info(tenant, sess)

    def _session_info(self, tenant: str, sess: Session) -> SessionInfo:
        blocks = self._session_blocks(tenant, sess)
        nbytes = sum(m.nbytes for m in blocks)
        pinning = sess.pinning
        # NOTE: not ``m.pins == 1``: pins also counts read leases (a Get streaming the block),
        # which made a session alone on its blocks say they stayed pinned by other sessions
        only = [m for m in blocks if not self._pinned_elsewhere(tenant, sess.sid, m)] if pinning else []
        return SessionInfo(tenant, sess.sid, sess.state, len(blocks), nbytes,
                           len(blocks) if pinning else 0, nbytes if pinning else 0,
                           max(0.0, self._clock() - sess.last_used), len(only), sum(m.nbytes for m in only))

    def _pinned_elsewhere(self, tenant: str, sid: str, meta: BlockMeta) -> bool:
        """Whether a session of ``tenant`` other than ``sid`` pins ``meta`` (ACTIVE or RESUMED)."""
        for other in meta.sessions:
            if other != sid:
                sess = self._sessions.peek(tenant, other)
                if sess is not None and sess.pinning:
                    return True
        return False

    def end_session(self, tenant: str, session: str) -> SessionInfo:
        """Close a session for an operator, as its engine's ``close_session`` would (its blocks
        unpinned, kept as prefix cache under the policy), and return it as it was just before:
        what the close released. NotFound when no such session is open. Counted:
        ``sessions_admin_closed``."""
        self._check_tenant(tenant)
        with self._lock:
            self._check_open()
            sess = self._sessions.peek(tenant, session)
            if sess is None:
                # NOTE: a second close said only "no open session", where the engine is told
                # how and when it was closed
                ended = self._sessions.how_ended(tenant, session)
                raise NotFound(f"no open session {session!r} in {tenant!r}" + (f": it {ended}" if ended else "")
                               + " (`kvstore session list` shows the open ones)")
            info = self._session_info(tenant, sess)
            self._end_session(tenant, session, "closed by an operator (kvstore session close)")
            self.counters.add("sessions_admin_closed")
            return info

    def expire(self) -> int:
        """Delete every expired block from every tier; returns how many."""
        with self._lock, self._batch():
            self._check_open()
            return self._expire_due(self._clock())

    def _expire_due(self, now: float) -> int:
        """Drop every block past its deadline, with its subtree (pinned or not, as a walk over
        it would); the number of blocks dropped. Caller holds the lock."""
        n = 0
        for m in self._index.expired(now):
            if self._index.get(m.tenant, m.key) is m:  # not in the subtree of one dropped before
                n += self._place.drop(m, reason="expired")
        return n
