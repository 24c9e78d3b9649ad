"""The two-phase put of the Store: reserve tier slots, let the bytes arrive, then publish.

The in-band gRPC Put streams a block's chunks straight into a slot reserved for it in the
fastest memory tier with room (:meth:`ReservedPuts.reserve_put`), and the commit publishes the
slots as blocks without copying (:meth:`ReservedPuts.commit_put`); :meth:`ReservedPuts.abort_put`
gives every reserved byte back. A mixin of :class:`kvstore.store.Store`: it uses the Store's
lock, index, placement and tiers, and falls back to the ordinary ``Store._put`` whenever the
chain changed since the reservation, so a put is all or nothing either way. A put of roots
(``roots=True``: independent one-block prefixes) reserves no slot: its bytes wait outside the
tiers and the commit is the ordinary put of the roots.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.block import BlockMeta, Tier
from kvstore.block_buffers import block_views
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.expiry import check_ttl
from kvstore.keys import ROOT_KEY, check_chain, check_keys
from kvstore.spec import ModelSpec
from tiers.base import BlockRef


@dataclass(slots=True)
class PutReservation:
    """A put whose bytes arrive later (see :meth:`Store.reserve_put`).

    ``views[i]`` is a writable buffer of ``spec.block_nbytes`` inside a memory-tier slot reserved
    for block i (numpy on a host arena, a device tensor otherwise), or None: the block was
    already stored, or no memory tier had room; the caller keeps that block's bytes and hands
    them to :meth:`Store.commit_put`. Reserved slots belong to no block: nothing reads, moves or
    evicts them, and nothing is visible until the commit."""

    tenant: str
    spec: ModelSpec
    keys: list[bytes]
    parent: bytes
    views: list[Any]
    slots: list[tuple[Tier, int] | None]  # (tier, offset) of each reserved slot
    probe: BlockMeta  # charges the reserved bytes to the tenant
    charged: bool = True  # the reserved slots count for the tenant
    since: int = 0  # the Store's drop epoch the caller's right to write was checked at
    session: str | None = None  # the session the put pins its blocks in (checked at the reserve)
    done: bool = False
    roots: bool = False  # the keys are independent roots, not a chain (see Store.put)


def _parent(parent: bytes | None) -> bytes:
    if parent is None:
        return ROOT_KEY
    if not isinstance(parent, bytes) or len(parent) != len(ROOT_KEY):
        raise InvalidArgument(f"parent must be a {len(ROOT_KEY)}-byte block key")
    return parent


def check_roots(roots: object, parent: bytes) -> None:
    """InvalidArgument unless ``roots`` is a bool, and False when a call names a ``parent``
    (roots continue from nothing). ``parent`` as :func:`_parent` returns it."""
    if not isinstance(roots, bool):
        raise InvalidArgument(f"roots must be True or False, got {type(roots).__name__}")
    if roots and parent != ROOT_KEY:
        raise InvalidArgument("roots take no parent: each key is a block of its own, continuing from nothing")


class ReservedPuts:
    """Store methods of the two-phase put (see the module docstring)."""

    def reserve_put(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes], *,
                    parent: bytes | None = None, since: int | None = None,
                    session: str | None = None, roots: bool = False) -> PutReservation:
        """Prepare a put whose bytes arrive later (e.g. streamed over the network): reserve a
        slot in the fastest memory tier that can make room (the tier order along the chain
        kept) for each block not stored yet, up to the first that finds no room, so the caller
        writes the bytes straight into the tier instead of staging them for :meth:`put_bytes`
        to copy again.

        Finish with :meth:`commit_put` (all or nothing, like :meth:`put_bytes`) or
        :meth:`abort_put`. Reserved bytes count against the tier and the tenant's quota
        meanwhile (in-flight headroom), and making room for them may evict, as a put would;
        a ``parent`` that is not stored is refused first (ParentNotStored), nothing evicted.

        ``session``: the session the commit pins the blocks in (:meth:`commit_put` takes it
        from here). Checked before any room is made, as :meth:`put` checks it: an unknown one
        is NotFound, and a put whose blocks (with the ancestors it continues from) cannot all
        be made room for in HBM now (the rest pinned by sessions or in flight, or the tenant's
        HBM quota) is ResourceExhausted, nothing evicted. Its slots are reserved in HBM only
        (session blocks live there; where HBM has none, the commit places them), and only when
        no block of the chain is stored and every new block gets one: otherwise the commit is
        the ordinary put of the whole chain, which would need the room of the slots again.

        ``since``: :attr:`drop_epoch` read before the caller checked its right to write (the
        service: before it authenticated the token); when :meth:`drop_tenant` drops the tenant
        after that, this call or the commit fails (Unauthenticated; Aborted when only the
        namespace's blocks were dropped and it stays, a shared one) instead of storing blocks a
        tenant created later under the same name would read. Default: now.

        ``roots``: the keys are independent roots (:meth:`Store.put`); no slot is reserved (the
        commit is the ordinary put of the roots), the checks above are all made here."""
        self._check_tenant(tenant)
        self._check_spec(spec)  # NOTE: spec=None raised AttributeError
        keys = check_keys(keys)
        parent0 = _parent(parent)
        check_roots(roots, parent0)
        check_chain(keys, roots=roots)  # NOTE: a slot reserved twice tripped an assert at commit
        nbytes = spec.block_nbytes
        with self._lock, self._batch():
            self._check_open()
            since = self._drop_epoch if since is None else since
            self._check_not_dropped(tenant, since)
            self._register_spec(spec)
            now = self._clock()
            probe = BlockMeta(key=ROOT_KEY, tenant=tenant, fingerprint=spec.fingerprint,
                              parent=ROOT_KEY, depth=0, nbytes=nbytes, tokens=spec.block_tokens,
                              tier=self.tiers[0], created=now, last_access=now)
            # NOTE: the session was checked only at the commit, after making room for the slots
            # had evicted and demoted other tenants' blocks: an unknown session was NotFound, a
            # put HBM could not take (other sessions' pins) ResourceExhausted "nothing was
            # evicted", both after eviction; they are refused here first, as Store.put does
            sess = self._sessions.get(tenant, session) if session is not None else None
            res = PutReservation(tenant, spec, keys, parent0, [None] * len(keys), [None] * len(keys), probe,
                                 since=since, session=session, roots=roots)
            # NOTE: checked before any room is made: a put under a parent not stored was refused
            # only at the commit, after making room had evicted and demoted the tenant's blocks
            pm = self._stored_parent(tenant, spec, parent0, now) if parent0 != ROOT_KEY else None
            floor = pm.tier if pm is not None else self.tiers[0]
            pinned = sess is not None and sess.pinning  # a PAUSED session's put is placed as any put
            if sess is not None and not pinned:
                self._check_paused_put(tenant, sess, keys, nbytes)
            lift: list[bytes] = []  # the ancestors a session put brings up into HBM with it
            if pinned and pm is not None and Tier.HBM in self._mem and pm.tier > Tier.HBM:
                lift = [m.key for m in self._up_chain([pm], Tier.HBM)]
            self._refuse_what_cannot_fit(tenant, spec, [*lift, *keys], floor, pinned=pinned, parent=pm, roots=roots)
            tiers = [Tier.HBM] if pinned and Tier.HBM in self._mem else self.tiers
            # the stored blocks of the chain stay put while room is made for the others
            guarded = [(tenant, k) for k in (parent0, *keys)
                       if (tenant, k) not in self._place.protected and self._index.get(tenant, k) is not None]
            # NOTE: a session put whose chain holds stored blocks, or that did not get a slot for
            # every new block, is committed by the ordinary put of the whole chain, copying out
            # of its slots while they stay reserved: its blocks then needed HBM room twice, and
            # a put that fitted was refused at the commit after the reservation had evicted and
            # demoted blocks for slots it did not use. Such a put reserves no slot (or gives
            # back those it got): its bytes wait outside the tier for the commit.
            copied = roots or (pinned and any(self._index.get(tenant, k) is not None for k in keys))
            self._place.protected.update(guarded)
            try:
                for i, key in enumerate(() if copied else keys):
                    m = self._index.get(tenant, key)
                    if m is not None:
                        floor = max(floor, m.tier)
                        continue
                    slot = self._reserve_slot(probe, floor, tiers)
                    if slot is None:
                        if pinned:
                            self._release_reservation(res)  # (see the NOTE above)
                            res.done = False
                        break  # no memory tier has room: the rest is stored by copy at commit
                    tier, offset = res.slots[i] = slot
                    res.views[i] = self._mem[tier].pending_view(offset, nbytes)
                    floor = tier
            except BaseException:
                self._release_reservation(res)
                raise
            finally:
                self._place.protected.difference_update(guarded)
            return res

    def _reserve_slot(self, probe: BlockMeta, floor: Tier, tiers: Sequence[Tier]) -> tuple[Tier, int] | None:
        for tier in tiers:
            if tier < floor or tier not in self._mem:
                continue
            if not self._place.make_room(tier, probe):
                continue
            offset = self._mem[tier].reserve_pending(probe.nbytes)
            if offset is not None:
                self._place.charge(probe, tier, +1)
                return tier, offset
        return None

    def _release_reservation(self, res: PutReservation) -> None:
        """Free every slot of ``res`` no block adopted (lock held); the reservation is done."""
        res.done = True
        for i, slot in enumerate(res.slots):
            if slot is not None:
                res.slots[i] = None
                self._mem[slot[0]].release_pending(slot[1])
                if res.charged:
                    self._place.charge(res.probe, slot[0], -1)
        res.views = [None] * len(res.views)

    def abort_put(self, res: PutReservation) -> None:
        """Give up a reserved put: its slots are freed, nothing was visible (idempotent)."""
        with self._lock:
            self._release_reservation(res)

    def commit_put(self, res: PutReservation, data: Callable[[int], Any], *,
                   session: str | None = None, ttl_s: float | None = None) -> None:
        """Publish a reserved put once every slot holds its block's bytes, all or nothing, with
        :meth:`put_bytes`' semantics. ``data(i)``: the bytes of block i where ``res.views[i]``
        is None. The reservation is done either way (its unused slots freed). ``session``:
        the reservation's (see :meth:`reserve_put`) when not given; another one is InvalidArgument.

        The reserved blocks become visible in their slots, without a copy; the blocks around
        them that had no slot (stored already, or past the memory tiers) go through the
        ordinary put. If the chain changed since the reservation (a reserved block stored by
        another call, the parent moved to a slower tier), this is an ordinary put of the whole
        chain, copying out of the slots."""
        self._check_tenant(res.tenant)
        ttl_s = check_ttl(ttl_s)
        with self._lock:
            if res.done:
                raise FailedPrecondition("this reservation was already committed or aborted")
            try:
                # NOTE: the put's batch, as Store.put's: a commit that failed only for other
                # blocks the put pushed down to NVMe fails the put no longer (it answered
                # RESOURCE_EXHAUSTED for a put whose blocks were all stored and pinned)
                with self._put_batch(res.tenant) as placed:
                    self._check_open()
                    self._check_not_dropped(res.tenant, res.since)
                    if session is None:
                        session = res.session
                    elif res.session is not None and session != res.session:
                        raise InvalidArgument(f"this reservation was made for session {res.session!r}, "
                                              f"not {session!r}")
                    bufs = [v if v is not None else data(i) for i, v in enumerate(res.views)]
                    views = block_views(res.spec, bufs, len(res.keys), "buffer")
                    self._commit_reserved(res, views, session, ttl_s)
                    placed.blocks = [self._index.get(res.tenant, k) for k in res.keys]
            finally:
                self._release_reservation(res)

    def _commit_reserved(self, res: PutReservation, views: list[Any], session: str | None,
                         ttl_s: float | None) -> None:
        tenant, spec, keys, slots = res.tenant, res.spec, res.keys, res.slots
        n = len(keys)
        # the usual shape: [stored already][reserved slots][no room above NVMe], any part empty
        a = next((i for i, s in enumerate(slots) if s is not None), n)
        b = next((i for i in range(a, n) if slots[i] is None), n)
        if res.roots or a == b or any(s is not None for s in slots[b:]) or (session is not None and (a or b < n)):
            # NOTE: a session's pins on the blocks of a first ordinary put could not be undone
            # if a later part failed: session puts around the slots take the ordinary put
            self._put_from_slots(res, views, session, ttl_s)
            return
        get = self._index.tenant_blocks(tenant).get
        fresh = [k for k in keys[:a] if get(k) is None]  # removed again if the commit fails
        # the first put extends the deadlines of the stored blocks it covers: put back if a
        # later part fails. NOTE: safe for the DeadlineHeap (deadlines only move later) because
        # the lock is held throughout: no expiry step ran between the extension and the undo
        timed = [(m, m.ttl_deadline) for m in map(get, keys[:a]) if m is not None]
        adopted: list[BlockMeta] = []
        try:
            if a:
                self._put(tenant, spec, keys[:a], views.__getitem__, session, ttl_s, res.parent)
            adopted = self._adopt_reserved(res, a, b, session, ttl_s)
            if not adopted:  # the chain changed since the reservation
                self._put_from_slots(res, views, session, ttl_s)
                return
            if b < n:
                self._put(tenant, spec, keys[b:], lambda i: views[b + i], session, ttl_s, keys[b - 1])
        except BaseException:
            self._unput(adopted)
            for key in reversed(fresh):
                m = self._index.get(tenant, key)
                if m is not None:
                    for sub in self._index.subtree(m):
                        self._place.remove(sub)
            for m, deadline in timed:
                if m.ttl_deadline != deadline and self._remote is not None:
                    self._remote.submit_ttl(self._place.ref(m), deadline, parent=m.parent)
                m.ttl_deadline = deadline
            raise

    def _put_from_slots(self, res: PutReservation, views: list[Any], session: str | None,
                        ttl_s: float | None) -> None:
        """The ordinary put of the whole chain, copying out of the slots. NOTE: the slots stay
        reserved meanwhile (nothing may reuse them while they are read), but stop counting for
        the tenant: the put charges its own blocks."""
        for slot in res.slots:
            if slot is not None:
                self._place.charge(res.probe, slot[0], -1)
        res.charged = False
        self._put(res.tenant, res.spec, res.keys, views.__getitem__, session, ttl_s, res.parent, roots=res.roots)

    def _adopt_reserved(self, res: PutReservation, a: int, b: int, session: str | None,
                        ttl_s: float | None) -> list[BlockMeta]:
        """Publish blocks ``a:b`` of ``res`` in their reserved slots (no copy) when the chain is
        as reserved; [] (nothing changed) when the ordinary put has to run instead."""
        tenant, spec, keys, slots = res.tenant, res.spec, res.keys, res.slots
        get = self._index.tenant_blocks(tenant).get
        if any(get(k) is not None for k in keys[a:b]):
            return []
        now = self._clock()
        parent = keys[a - 1] if a else res.parent
        base_depth = 0
        if parent != ROOT_KEY:
            pm = get(parent)
            if (pm is None or pm.in_flight or pm.fingerprint != spec.fingerprint
                    or self._place.expired(pm, now) or pm.tier > slots[a][0]):
                return []
            base_depth = pm.depth + 1
        sess = self._sessions.get(tenant, session) if session is not None else None
        if sess is not None and sess.pinning and Tier.HBM in self._mem and any(s[0] != Tier.HBM for s in slots[a:b]):
            return []  # session blocks live in HBM: the ordinary put places them
        deadline = self._ttl_deadline(tenant, ttl_s, now, spec.fingerprint)
        adopted: list[BlockMeta] = []
        try:
            for i in range(a, b):
                tier, offset = slots[i]
                meta = BlockMeta(key=keys[i], tenant=tenant, fingerprint=spec.fingerprint,
                                 parent=keys[i - 1] if i else res.parent, depth=base_depth + i - a,
                                 nbytes=spec.block_nbytes, tokens=spec.block_tokens, tier=tier,
                                 created=now, last_access=now, access_count=1, ttl_deadline=deadline)
                self._mem[tier].adopt(offset, BlockRef(tenant, keys[i], spec))
                slots[i] = None  # the block owns the slot (and its charge) now
                self._index.add(meta)
                adopted.append(meta)
                self.policy.on_insert(meta, now)
            if sess is not None:
                for m in adopted:
                    self._session_add(sess, m)
        except BaseException:
            self._unput(adopted)
            raise
        self._published(adopted)
        if sess is not None and not sess.pinning:
            self._park(adopted)  # a paused session's blocks wait in DRAM, as Store.put's
        return adopted
