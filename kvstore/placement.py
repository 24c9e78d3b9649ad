"""Placement: the Store's mechanism for where block bytes live and how they move.

It owns no policy (the :class:`policy.base.EvictionPolicy` ranks and decides) and no public
API (the Store validates, locks and calls it). Primitives and what each guarantees:

* ``insert_new`` — places a new block in the fastest allowed tier that can make room; never in
  a faster tier than its parent (tier order along every path).
* ``make_room``  — quota first (a tenant over quota evicts its own blocks only), then the
  tier's watermarks: past ``high`` it evicts the policy's choices down to ``low``.
* ``evict``      — demotes a leaf to the tier the policy names (if admitted and there is room),
  else to the next one it names among the tiers after that, never below a tier holding one
  of its children; else drops it with its subtree; pinned or in-flight blocks are never
  touched.
* ``move``       — two-phase: the block is in flight (not a hit, not evictable) while its bytes
  are copied; then published in the destination, or left where it was. Moving up out of NVMe
  keeps the NVMe copy (``persisted``) so a crash cannot lose a committed block.
* closure        — what NVMe holds is closed under parents: a block goes to NVMe (demoted, or
  put there) only once each of its ancestors is there or keeps an NVMe copy (``make_room``
  writes the missing copies first), and a copy is not evicted while a descendant is on NVMe.
  Recovery drops a block whose parent is not on NVMe, so anything else is lost at a crash.
* ``serve``      — copies one block out (promoting it first when its parent is already in the
  top tier); a failed integrity check deletes the block and its dependants and counts it.

Unsafe unless the caller holds the Store's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from kernels.copy import copy_bytes
from kvstore.block import BlockMeta, Tier
from kvstore.config import StoreConfig
from kvstore.errors import NVMeWriteFailed, ResourceExhausted
from kvstore.index import Ident, PrefixIndex
from kvstore.keys import ROOT_KEY
from kvstore.sessions import SessionTable
from kvstore.sizes import format_size
from kvstore.spec import ModelSpec
from kvstore.stats import Counters
from kvstore.victims import CloseVictims, VictimQueue
from policy.base import EvictionPolicy
from policy.quantization import QuantizationPolicy
from policy.registry import KeyedPolicy, TieredPolicy
from tiers.base import BlockRef
from tiers.memory import MemoryTier
from tiers.nvme import NVMeRecord, NVMeTier
from tiers.nvme_ahead import AheadJob
from tiers.remote import RemoteTier

#: ``refuse(tenant, bound, tier, message)``: the error of a put :meth:`Placement.insert_new`
#: could not place (see there)
Refuse = Callable[[str, Tier | None, Tier, str], ResourceExhausted]


class Placement:
    def __init__(self, *, config: StoreConfig, clock: Callable[[], float], index: PrefixIndex,
                 specs: dict[bytes, ModelSpec], mem: dict[Tier, MemoryTier],
                 nvme: NVMeTier | None, policy: EvictionPolicy, counters: Counters,
                 sessions: SessionTable, quotas: Callable[[str, Tier], int | None],
                 quant_policy: QuantizationPolicy, remote: RemoteTier | None = None,
                 priorities: dict[str, int] | None = None) -> None:
        self.config = config
        self._clock = clock
        self._index = index
        self._specs = specs
        self._mem = mem
        self._nvme = nvme
        self.policy = policy
        self.counters = counters
        self._sessions = sessions
        self._quota_of = quotas
        #: tenant -> priority (0 when absent): a lower priority's blocks are evicted first
        self.priorities = priorities if priorities is not None else {}
        self.remote = remote
        self.quant_policy = quant_policy
        self.tiers: list[Tier] = sorted([*mem, *([Tier.NVME] if nvme else [])])
        if isinstance(policy, TieredPolicy):  # its values weigh where victims really go
            policy.bind_tiers(self.tiers)
        #: blocks a running operation holds (its chain): never eviction candidates meanwhile
        self.protected: set[Ident] = set()
        self.tenant_usage: dict[tuple[str, Tier], int] = {}
        #: the tenant whose quota is making room now (:meth:`fit_quota`): the blocks it pushes
        #: down find room in lower tiers from free space and that tenant's blocks only
        self._quota_scope: str | None = None
        #: while a pause parks its session (``SessionPins._park``): a paused block in the last
        #: local tier is no eviction candidate (evicting it there drops it)
        self.keep_paused = False

    def ref(self, meta: BlockMeta) -> BlockRef:
        return BlockRef(meta.tenant, meta.key, self._specs[meta.fingerprint])

    def backend(self, tier: Tier) -> Any:
        if tier == Tier.NVME and self._nvme is not None:
            return self._nvme
        return self._mem[tier]

    def charge(self, meta: BlockMeta, tier: Tier, sign: int) -> None:
        k = (meta.tenant, tier)
        self.tenant_usage[k] = self.tenant_usage.get(k, 0) + sign * meta.nbytes

    @staticmethod
    def expired(meta: BlockMeta, now: float) -> bool:
        return meta.ttl_deadline is not None and now >= meta.ttl_deadline

    def insert_new(self, tenant: str, spec: ModelSpec, key: bytes, parent: bytes, depth: int,
                    data: Any, now: float, deadline: float | None, parent_tier: Tier,
                    pinned: bool, refuse: Refuse | None = None) -> BlockMeta:
        """The new block, placed (see the module docstring); ResourceExhausted when no allowed
        tier can make room. ``refuse(tenant, bound, tier, message)`` makes that error when
        given (the Store's put: it labels and counts it): ``bound`` is the first tier whose
        quota refused the block (None: capacity did), ``tier`` the fastest allowed."""
        meta = BlockMeta(key=key, tenant=tenant, fingerprint=spec.fingerprint, parent=parent,
                         depth=depth, nbytes=spec.block_nbytes, tokens=spec.block_tokens,
                         tier=parent_tier, created=now, last_access=now, access_count=1,
                         ttl_deadline=deadline)
        ref = BlockRef(tenant, key, spec)
        # Session blocks must live in HBM (when there is one); others may spill down.
        choices = [t for t in self.tiers if t >= parent_tier]
        if pinned and Tier.HBM in self._mem:
            if parent_tier != Tier.HBM:
                raise ResourceExhausted(
                    f"session blocks live in hbm, but the block they continue from is in "
                    f"{parent_tier.label} and could not be brought up", resource="hbm")
            choices = [Tier.HBM]
        bound: Tier | None = None
        for tier in choices:
            meta.tier = tier
            if not self.make_room(tier, meta):
                # make_room tries the quota first and then only frees bytes: still over it
                # here means the quota refused (NOTE: this refusal was labelled and counted as
                # the tier's capacity, and the metrics said NVMe was full when a quota bound)
                need = meta.nbytes + (sum(a.nbytes for a in self._uncommitted_ancestors(meta))
                                      if tier == Tier.NVME else 0)  # the copies it needs first
                if bound is None and not self.within_quota(tenant, tier, need):
                    bound = tier
                continue
            if self.write(tier, ref, meta, data):
                self._index.add(meta)
                self.charge(meta, tier, +1)
                self.policy.on_insert(meta, now)
                return meta
        where = f"no room for a {spec.block_nbytes}-byte block of tenant {tenant!r} in {[t.label for t in choices]}"
        if bound is not None:
            quota = self._quota_of(tenant, bound) or 0
            message = (f"{where}: its quota {bound.label}={format_size(quota)} is reached and none of its "
                       f"blocks there can make room (the chain this put continues holds them); raise its "
                       f"quota (kvstore policy set)")
        else:
            message = f"{where}: capacity is held by pinned or in-flight blocks"
            copies = len(self._uncommitted_ancestors(meta)) if Tier.NVME in choices else 0
            if copies:  # see _nvme_room
                message += (f" (a block goes to NVMe only with its ancestors: NVMe had no room for the copies of "
                            f"the {copies} blocks above it in memory)")
        if refuse is not None:
            raise refuse(tenant, bound, choices[0], message)
        raise ResourceExhausted(message, resource=choices[0].label)

    def most_blocks(self, tenant: str, nbytes: int, floor: Tier, pinned: bool = False) -> int:
        """How many new blocks of ``nbytes`` one put could ever place from ``floor`` down
        (session blocks: HBM alone) were nothing else stored: the memory tiers' capacity
        together, or NVMe's, whichever holds more (within the tenant's quota in each). A put of
        more can only fail, after evicting all it could.

        NOTE: it was the sum of every tier, NVMe included; but a put's blocks fit in the memory
        tiers or in NVMe, never in their sum (:meth:`room_now`: once one goes to NVMe every one
        placed above it gets an NVMe copy). A put between the two passed this check and was
        refused by the room check, whose message blamed pinned or in-flight blocks, in an empty
        store, and told the caller to retry."""
        tiers = [Tier.HBM] if pinned and Tier.HBM in self._mem else [t for t in self.tiers if t >= floor]
        fits = {t: self._fit(tenant, t, nbytes, self.backend(t).capacity, 0) for t in tiers}
        return max([sum(n for t, n in fits.items() if t in self._mem), *(n for t, n in fits.items() if t not in self._mem)])

    def room_now(self, tenant: str, nbytes: int, floor: Tier, pinned: bool, need: int,
                 held: Iterable[BlockMeta] = (), under: BlockMeta | None = None,
                 quotas: bool = True) -> int:
        """How many of ``need`` new blocks of ``nbytes`` one put could place from ``floor``
        down (session blocks: HBM alone) if it evicted everything it may, at most ``need``: in
        each memory tier the bytes not held by pinned, in-flight or protected blocks (nor by
        the ancestors they keep in their tier), within the tenant's quota; NVMe at capacity
        less what the chain holds there. An upper bound: a put of more can only fail.

        ``held``: the stored blocks the operation holds while it runs (a put's chain, a
        resume's session blocks): they and all their ancestors (:meth:`lineage`) are held
        where they are, as if protected already. ``under``: the stored block the put's first
        new block continues from: it and its ancestors with no NVMe copy must get one before
        a block of the put goes to NVMe (:meth:`uncommitted`, :meth:`_nvme_room`).

        NOTE: closure makes NVMe all or nothing: once one new block goes there, every new block
        placed above it gets an NVMe copy too, as do those of ``under``; so the put fits in the
        memory tiers or in NVMe (every new block and those copies), never in their sum.
        Counting the sum, and the chain's own blocks as room, let puts through that could only
        be refused after they had evicted and demoted other tenants' blocks. A put whose NVMe
        part cannot have those copies (NVMe room, or the tenant's NVMe quota: DESIGN counts
        every byte on a tier in it) is refused up front rather than written without them: its
        NVMe blocks would be committed and then dropped as orphans by the next recovery
        (invariant 6), and the memory tiers cannot hold it.

        ``quotas``: False counts capacity alone (which refusal a quota caused). Walks the chain
        only when the memory tiers' free room cannot take ``need`` blocks, and scans a memory
        tier's blocks only when NVMe cannot either."""
        tiers = [Tier.HBM] if pinned and Tier.HBM in self._mem else [t for t in self.tiers if t >= floor]
        mem = [t for t in tiers if t in self._mem]

        def fit(t: Tier, room: int, quota_used: int) -> int:
            if quotas:
                return self._fit(tenant, t, nbytes, room, quota_used)
            return max(room, 0) // max(self.backend(t).charge(nbytes), 1)

        free = sum(fit(t, self.backend(t).capacity - self.backend(t).used_bytes,
                       self.tenant_usage.get((tenant, t), 0)) for t in mem)
        if free >= need:
            return need
        chain = self.lineage(held)
        nvme = 0
        if Tier.NVME in tiers:
            used, own = self._held(Tier.NVME, tenant, chain)
            copies = len(self.uncommitted(under))
            nvme = max(fit(Tier.NVME, self.backend(Tier.NVME).capacity - used, own) - copies, 0)
            if nvme >= need:
                return need
        room = 0
        for t in mem:
            used, own = self._held(t, tenant, chain)
            room += fit(t, self.backend(t).capacity - used, own)
        return min(need, max(room, nvme))

    def fits_now(self, tenant: str, sizes: Sequence[int], tier: Tier,
                 held: Iterable[BlockMeta] = (), quotas: bool = True) -> bool:
        """Whether new blocks of ``sizes`` (bytes each) could all go into ``tier`` now if it
        evicted everything it may: their charges within its capacity less what no eviction
        can free (:meth:`_held`, ``held`` as in :meth:`room_now`), their bytes within the
        tenant's quota there (``quotas``). An upper bound, as room_now's.

        NOTE: room_now sizes every block alike; a resume of a session holding blocks of two
        models (a target and its draft) sized them all as the smallest, passed, and evicted
        other tenants' blocks before it was refused."""
        backend = self.backend(tier)
        need, own_need = sum(backend.charge(n) for n in sizes), sum(sizes)
        quota = self._quota_of(tenant, tier) if quotas else None

        def fits(used: int, own: int) -> bool:
            return need <= backend.capacity - used and (quota is None or own_need <= quota - own)

        if fits(backend.used_bytes, self.tenant_usage.get((tenant, tier), 0)):
            return True
        return fits(*self._held(tier, tenant, self.lineage(held)))

    def _fit(self, tenant: str, tier: Tier, nbytes: int, room: int, quota_used: int) -> int:
        """Blocks of ``nbytes`` that ``room`` bytes of ``tier`` take, within what the tenant's
        quota leaves after ``quota_used``."""
        fit = room // max(self.backend(tier).charge(nbytes), 1)
        quota = self._quota_of(tenant, tier)
        if quota is not None:
            fit = min(fit, (quota - quota_used) // max(nbytes, 1))
        return max(fit, 0)

    def _held(self, tier: Tier, tenant: str, chain: Collection[BlockMeta] = ()) -> tuple[int, int]:
        """Bytes of ``tier`` that no eviction can free now (all tenants', and ``tenant``'s own
        within them): pinned, in-flight and protected blocks, and their ancestors in the same
        tier (leaf-first eviction, and a parent never sits in a slower tier than its child);
        and the blocks of ``chain`` there (see :meth:`room_now`), in NVMe their copies too.
        Only ``chain`` is looked at in NVMe: nothing there is pinned, and no operation but
        the caller's runs under the lock."""
        backend = self.backend(tier)
        seen: set[tuple[str, bytes]] = set()
        # NOTE: the slots other calls reserved for blocks still arriving (a Put stream's) are
        # used and held by no block: left out, a session put passed the check with another
        # tenant's stream in flight, brought its blocks up evicting others', and was refused
        held, own = getattr(backend, "pending_bytes", 0), 0

        def there(m: BlockMeta) -> bool:
            return m.tier == tier or (tier == Tier.NVME and m.persisted)

        starts = [m for m in chain if there(m)]
        if tier in self._mem:
            starts += [m for m in self._index.in_tier(tier)
                       if m.pins or m.in_flight or (m.tenant, m.key) in self.protected]
        for m in starts:
            cur: BlockMeta | None = m
            while cur is not None and there(cur) and (cur.tenant, cur.key) not in seen:
                seen.add((cur.tenant, cur.key))
                held += backend.charge(cur.nbytes)
                own += cur.nbytes if cur.tenant == tenant else 0
                cur = self._index.get(cur.tenant, cur.parent)
        return held, own

    def lineage(self, blocks: Iterable[BlockMeta]) -> list[BlockMeta]:
        """``blocks`` and every ancestor of theirs in the index, each once."""
        out: dict[tuple[str, bytes], BlockMeta] = {}
        for m in blocks:
            cur: BlockMeta | None = m
            while cur is not None and (cur.tenant, cur.key) not in out:
                out[(cur.tenant, cur.key)] = cur
                cur = self._index.get(cur.tenant, cur.parent) if cur.parent != ROOT_KEY else None
        return list(out.values())

    def hold_chain(self, chain: list[BlockMeta]) -> list[Ident]:
        """Protect ``chain`` (a read's prefix, each block the child of the one before) and every
        ancestor of its first block; the idents this added, for the caller to discard.

        NOTE: the read paths protected only the chain: a get or lease continuing from a
        ``parent`` in HBM whose children were all below it (a leaf there) evicted that parent
        to make room for promoting the chain's first block, which then sat in HBM under a
        parent in DRAM (lookups of the whole chain stopped at the parent); :meth:`promote`
        protects the lineage the same way."""
        protected = self.protected
        idents = [(m.tenant, m.key) for m in chain if (m.tenant, m.key) not in protected]
        if chain and chain[0].parent != ROOT_KEY:
            up = self._index.get(chain[0].tenant, chain[0].parent)
            if up is not None:
                idents += [(m.tenant, m.key) for m in self.lineage([up])
                           if (m.tenant, m.key) not in protected]
        protected.update(idents)
        return idents

    def write(self, tier: Tier, ref: BlockRef, meta: BlockMeta, data: Any) -> bool:
        if tier == Tier.NVME:
            assert self._nvme is not None
            host = data.cpu().numpy() if isinstance(data, torch.Tensor) else data
            ok = self._nvme.put_record(ref, host, self.record(meta),
                                       quant=self.quant_policy.for_block(ref.tenant, ref.spec))
            if ok:
                meta.persisted = True
                if meta.tier != Tier.NVME:  # a copy of a memory block (a put into NVMe is no move)
                    # NOTE: counted here, the one way into NVMe: a move, an ancestor's copy
                    # (_nvme_room) and a flush each write; only the first was counted
                    self.counters.add(f"bytes_{meta.tier.label}_to_nvme", meta.nbytes)
            return ok
        return self._mem[tier].put(ref, data)

    def nvme_ahead(self, blocks: Sequence[tuple[BlockRef, Any]]) -> AbstractContextManager[None]:
        """While the returned context is open, the NVMe tier encodes ``blocks`` ((ref, host
        bytes) in the order they will be written) ahead of :meth:`write`. Only for blocks bound
        for NVMe: an encoding nobody writes is wasted work. The bytes must stay unchanged
        until the context ends."""
        if self._nvme is None or not blocks:
            return nullcontext()
        quant = self.quant_policy.for_block
        return self._nvme.pipelined([AheadJob(ref, data, quant(ref.tenant, ref.spec))
                                     for ref, data in blocks if isinstance(data, np.ndarray)])

    @staticmethod
    def record(meta: BlockMeta) -> NVMeRecord:
        return NVMeRecord(meta.tenant, meta.key, meta.parent, meta.depth, meta.tokens,
                          meta.nbytes, meta.created, meta.ttl_deadline, meta.fingerprint)

    def make_room(self, tier: Tier, meta: BlockMeta) -> bool:
        """Evict until ``meta`` fits in ``tier`` within capacity, watermark and quota. For NVMe,
        first commits an NVMe copy of each ancestor of ``meta`` that has none (see
        :meth:`_nvme_room`); False, as for no room, when one cannot be had."""
        if tier == Tier.NVME:
            return self._nvme_room(meta)
        return self._make_room(tier, meta)

    def _uncommitted_ancestors(self, meta: BlockMeta) -> list[BlockMeta]:
        """``meta``'s ancestors with no NVMe copy, shallowest first: those above the deepest
        one on NVMe (or keeping a copy there). One look-up when the parent has its copy."""
        return self.uncommitted(self._index.get(meta.tenant, meta.parent))

    def uncommitted(self, meta: BlockMeta | None) -> list[BlockMeta]:
        """``meta`` (if given) and its ancestors, up to the first on NVMe or keeping a copy
        there, shallowest first: the NVMe copies a block put under ``meta`` into NVMe needs."""
        out: list[BlockMeta] = []
        p = meta
        while p is not None and p.tier != Tier.NVME and not p.persisted:
            out.append(p)
            p = self._index.get(p.tenant, p.parent)
        out.reverse()
        return out

    def _nvme_room(self, meta: BlockMeta) -> bool:
        """Write NVMe copies of ``meta``'s ancestors that have none (shallowest first; they stay
        where they live, marked persisted, like a promoted block's kept copy), then make room
        in NVMe for ``meta``; False when a copy or ``meta`` finds no room or quota.

        NOTE: a block was written to NVMe with its ancestors in HBM or DRAM only (a system
        prompt kept hot in HBM while leaf-first eviction demoted every conversation's tail):
        committed, and dropped as an orphan by the next open after a crash (every block under
        the prompt). The copies go in the caller's NVMe batch before ``meta`` (ancestor first:
        a commit that stores a block stores its ancestors' copies, or a commit before it did).
        The copies written stay when a later one fails: they are closed under parents too.
        Meanwhile they and the ancestor copy they hang from are protected: a copy with no
        descendant on NVMe yet is evictable, and making room for ``meta`` (the quota's own
        victims first) dropped its parent's copy just before ``meta`` was written."""
        missing = self._uncommitted_ancestors(meta)
        anchor = self._index.get(meta.tenant, (missing[0] if missing else meta).parent)
        idents = [(m.tenant, m.key) for m in (*missing, anchor)
                  if m is not None and m.tier < Tier.NVME and (m.tenant, m.key) not in self.protected]
        self.protected.update(idents)
        try:
            for a in missing:
                if a.tier not in self._mem or not self._make_room(Tier.NVME, a):
                    return False
                ref = self.ref(a)
                if not self.write(Tier.NVME, ref, a, self._mem[a.tier].host_bytes(ref)):
                    return False
                self._index.set_persisted(a, True)
                self.charge(a, Tier.NVME, +1)
                self.counters.add("nvme_ancestor_copies")
            return self._make_room(Tier.NVME, meta)
        finally:
            self.protected.difference_update(idents)

    def _make_room(self, tier: Tier, meta: BlockMeta) -> bool:
        """:meth:`make_room` for ``meta`` alone (its ancestors' NVMe copies are not looked at)."""
        backend = self.backend(tier)
        need = backend.charge(meta.nbytes)
        if not self.fit_quota(meta.tenant, tier, meta.nbytes):
            return False
        cap = backend.capacity
        if need > cap:
            return False
        if self._quota_scope is not None and self._quota_scope == meta.tenant:
            # NOTE: a block demoted by its own tenant's quota made room here with the store-wide
            # victims: a tenant over quota pushed another tenant's blocks out of DRAM/NVMe
            own = self.victims(tier, meta.tenant)
            while not (backend.used_bytes + need <= cap and backend.can_fit(meta.nbytes)):
                if not self.evict_some(tier, own):
                    return False
            return True
        high, low = self.config.high_watermark * cap, self.config.low_watermark * cap
        if backend.used_bytes + need <= high and backend.can_fit(meta.nbytes):
            return True
        # NOTE: the target was min(low, cap - need), tested against used + need: room for
        # ``need`` was made twice, and a full tier with low = high = 1.0 evicted two blocks for
        # one (with low > cap - need, down to cap - 2 need instead of low - need)
        target = min(low, cap)
        queue = self.victims(tier)
        while backend.used_bytes + need > target or not backend.can_fit(meta.nbytes):
            if not self.evict_some(tier, queue):
                break
        return backend.used_bytes + need <= cap and backend.can_fit(meta.nbytes)

    def fit_quota(self, tenant: str, tier: Tier, extra: int = 0) -> bool:
        """Evict ``tenant``'s own blocks from ``tier`` until ``extra`` more bytes fit within its
        quota there (none: True); False when they cannot (not counted: the caller that refuses
        a put for it counts it). A block it demotes finds room below in free space or by
        pushing down the same tenant's blocks, else is dropped: never by evicting another
        tenant's."""
        quota = self._quota_of(tenant, tier)
        if quota is None:
            return True
        if extra > quota:
            return False
        own = self.victims(tier, tenant)
        scope, self._quota_scope = self._quota_scope, tenant
        try:
            while not self.within_quota(tenant, tier, extra):
                if not self.evict_some(tier, own):
                    # NOTE: counted here, a quota lowered under pinned blocks (set_tenant_policy)
                    # and a reservation that got no slot counted rejections that refused nothing
                    return False
        finally:
            self._quota_scope = scope
        return True

    def within_quota(self, tenant: str, tier: Tier, extra: int = 0) -> bool:
        """Whether ``extra`` more bytes of ``tenant`` fit its quota in ``tier`` as things stand
        (nothing is evicted for them; see :meth:`fit_quota`)."""
        quota = self._quota_of(tenant, tier)
        return quota is None or self.tenant_usage.get((tenant, tier), 0) + extra <= quota

    def victims(self, tier: Tier, tenant: str | None = None) -> VictimQueue:
        """The eviction order of ``tier``'s evictable leaves (of one tenant only, if given) for
        one make-room loop; NVMe's includes the NVMe copies of blocks living above."""

        # NOTE: a pause dropped another paused session's blocks (of any tenant: DRAM, the last
        # tier, full of them; or its own, its DRAM quota full of them) to park its own, which
        # stay kept in HBM, unpinned, when they cannot move: one kept session lost for nothing
        keep = self.keep_paused and tier == self.tiers[-1]

        def candidates() -> list[BlockMeta]:
            cands = self._index.candidates(tier, self.protected, tenant)
            if keep:
                cands = [m for m in cands if not m.paused]
            if tier == Tier.NVME:
                cands += [m for m in self._index.persisted_copies() if self._nvme_copy_evictable(m, tenant)]
            return cands

        def valid(m: BlockMeta) -> bool:
            if tier == Tier.NVME and m.tier < Tier.NVME:
                return self._nvme_copy_evictable(m, tenant)
            return self._index.is_candidate(m, tier, self.protected, tenant) and not (keep and m.paused)

        prio = self.priorities
        if tier != self.tiers[-1]:
            return VictimQueue(self.policy, tier, candidates, valid, self._clock(),
                               (lambda m: prio.get(m.tenant, 0)) if prio else None)

        # NOTE: the last local tier drops what it evicts (or spills it to the remote tier), so
        # what goes first is not only the policy's call: (1) the NVMe copies of blocks living
        # above go before any block (dropping one loses nothing: a tenant under an NVMe quota
        # lost its NVMe-only blocks just by reading others, whose promoted copies kept their
        # NVMe copy and stayed, the recent ones, under LRU), those with no descendant on NVMe
        # only (:meth:`_nvme_copy_evictable`); (2) a paused session's blocks go
        # after every other block (they are what pause promises to keep: under lru and gdsf,
        # other traffic dropped them, and the session resumed with nothing)
        def order(m: BlockMeta) -> tuple[int, int]:
            kind = 0 if m.tier < tier else (2 if m.paused else 1)
            return kind, prio.get(m.tenant, 0)
        return VictimQueue(self.policy, tier, candidates, valid, self._clock(), order)

    def _nvme_copy_evictable(self, m: BlockMeta, tenant: str | None) -> bool:
        """Whether ``m``'s NVMe copy (``m`` living above NVMe) may be evicted now.

        NOTE: dropping the copy of a block with a descendant on NVMe (a hot prompt's copy,
        under conversations demoted there) loses nothing now, but every such descendant at
        the next crash (recovery drops a block whose parent is not on NVMe). Such a copy is
        skipped, as a block with a child in its tier is: the copies go leaf-first, each once
        its last descendant left NVMe (:meth:`evict_some` offers the parent again). Dropping
        the descendants with it would throw away blocks only NVMe holds to save one copy of
        a block memory still holds; skipping keeps NVMe's usage the same as leaf-first
        eviction of NVMe's own blocks, which come next in the order."""
        return (m.persisted and m.tier < Tier.NVME and self._index.get(m.tenant, m.key) is m
                and not m.in_flight and (m.tenant, m.key) not in self.protected
                and (tenant is None or m.tenant == tenant)
                and not (m.children and any(c.tier == Tier.NVME or c.persisted
                                            for c in self._index.children(m))))

    def close_victims(self) -> CloseVictims:
        """NVMe's own evictable leaves, coldest first by :meth:`close_key`'s order, for a close
        that commits memory blocks (see :class:`kvstore.victims.CloseVictims`)."""
        return CloseVictims(self._index.candidates(Tier.NVME, self.protected), self._close_order,
                            lambda m: self._index.is_candidate(m, Tier.NVME, self.protected))

    def close_key(self, meta: BlockMeta) -> Any | None:
        """The value of memory block ``meta`` as a block of NVMe (``meta`` leaves memory at
        close: NVMe or nowhere), in the order of :meth:`close_victims`; None when the policy
        would drop it rather than write it to NVMe (``demote_to`` names no tier).

        NOTE: a memory block's own key is its value in its tier (cost and gdsf stamp
        ``H = L_t + value`` per tier), not comparable with NVMe's blocks; ``demote_to`` with
        NVMe offered values it there, as a demotion into NVMe does (and is learnt from once,
        as one). A policy without :class:`policy.registry.KeyedPolicy` keys has no value that
        compares across blocks: recency (``last_access``, deepest first on ties) orders them.
        As in :meth:`victims`, a paused session's blocks go after every other block (what
        pause promises to keep) and a tenant of lower priority goes first."""
        if self.policy.demote_to(meta, meta.tier, [Tier.NVME], self._clock()) is None:
            return None
        return self._close_order(meta)

    def _close_order(self, meta: BlockMeta) -> tuple[int, int, Any]:
        kind, prio = (1 if meta.paused else 0), self.priorities.get(meta.tenant, 0)
        if isinstance(self.policy, KeyedPolicy):
            return kind, prio, self.policy.evict_key(meta, Tier.NVME, self._clock())
        return kind, prio, (meta.last_access, -meta.depth)

    def evict_some(self, tier: Tier, queue: VictimQueue) -> bool:
        """Evict the next victim of ``queue`` (a :meth:`victims` of ``tier``) that can go;
        False if none can."""
        while (victim := queue.pop()) is not None:
            if tier == Tier.NVME and victim.tier < Tier.NVME:
                self.drop_copy(victim)
                # its parent's copy may be evictable now (see _nvme_copy_evictable)
                queue.evicted(self._index.get(victim.tenant, victim.parent) if victim.parent else None)
                return True
            if self.evict(victim, tier, self._clock()):
                queue.evicted(self._index.get(victim.tenant, victim.parent) if victim.parent else None)
                return True
        return False

    def evict(self, meta: BlockMeta, tier: Tier, now: float) -> bool:
        """Demote ``meta`` (a leaf of ``tier``) to the tier the policy names, else the next one
        it names among the slower tiers, else drop it with its subtree; False when it cannot
        go (its subtree holds a pinned or in-flight block).

        NOTE: only the first tier the policy named was tried: a victim whose first choice could
        not make room (DRAM full of the blocks a read holds) was dropped while NVMe had room.
        Now the policy is asked again with the tiers after the one that failed (or refused it,
        ``admit``). Offered are only the tiers that keep the tier order, none below the fastest
        tier holding one of its children (a parent never sits in a slower tier than its child;
        the remote tier, a copy, is offered last as before); a move into NVMe gets the NVMe
        copies of the victim's ancestors first (:meth:`make_room`, closure)."""
        slower = self._demotable(meta, [t for t in self.tiers if t > tier])
        if self.remote is not None:
            slower.append(Tier.REMOTE)
        dest = self.policy.demote_to(meta, tier, slower, now)  # also with none: the policy learns
        while dest is not None:
            if dest == Tier.REMOTE:
                if self.policy.admit(meta, dest, now):
                    self.spill_remote(meta)
                    if self._index.get(meta.tenant, meta.key) is not meta:
                        return True  # it failed its integrity check while being read: gone
                break  # the local copy goes either way
            if self.policy.admit(meta, dest, now):
                if meta.persisted and dest == Tier.NVME:
                    if meta.paused and self._nvme is not None and self._nvme.uncommitted((meta.tenant, meta.key)):
                        # NOTE: its copy was written in this batch (an ancestor copy, for a block
                        # below it going to NVMe): a paused session's block is committed before its
                        # memory copy goes, as move() does; released first, a commit that then
                        # failed lost it (the copy gone, the memory freed). A commit that fails
                        # here raises before the release: the Store's batch then takes the copy off
                        # (Placement.lost) and the block stays where it is.
                        self._nvme.commit_now()
                    self.release(meta, tier)  # the NVMe copy is committed
                    self._index.set_tier(meta, Tier.NVME)
                    # a move with no write (no bytes_*): NOTE: it was in ``demotions`` only, and
                    # the moved_* counters downwards summed to less
                    self.counters.add(f"moved_{tier.label}_to_nvme")
                    self.counters.add("demotions")
                    return True
                if self.move(meta, dest):
                    self.counters.add("demotions")
                    return True
            # looked at again: making room may have moved a child
            slower = self._demotable(meta, slower[slower.index(dest) + 1:] if dest in slower else [])
            dest = self.policy.demote_to(meta, tier, slower, now) if slower else None
        sub = self._index.subtree(meta)
        if any(m.pins or m.in_flight for m in sub):
            return False
        for m in sub:
            self.remove(m)
        self.counters.add("evictions", len(sub))
        self.counters.add("paused_evictions", sum(1 for m in sub if m.paused))  # pause could not keep them
        return True

    def _demotable(self, meta: BlockMeta, tiers: list[Tier]) -> list[Tier]:
        """Those of ``tiers`` that ``meta`` may be demoted to: none below the fastest local tier
        holding one of its children (the remote tier, a copy, stays)."""
        if not meta.children:
            return tiers
        kids = [c.tier for c in self._index.children(meta)]
        if not kids:
            return tiers
        return [t for t in tiers if t == Tier.REMOTE or t <= min(kids)]

    def move(self, meta: BlockMeta, dest: Tier) -> bool:
        """Move ``meta``'s bytes to ``dest``: prepare (in flight), copy, complete or abort.

        Moving up out of NVMe copies (the NVMe copy stays); every other move frees the source.
        """
        src = meta.tier
        ref = self.ref(meta)
        meta.in_flight = True
        ident = (meta.tenant, meta.key)
        guard = ident not in self.protected  # NOTE: callers may hold their own protection
        if guard:
            self.protected.add(ident)
        try:
            if not self.make_room(dest, meta):
                return False
            if not self.copy(meta, ref, src, dest):
                return False
            if dest == Tier.NVME and meta.paused and self._nvme is not None:
                # a paused session's block is kept: committed before its memory copy goes, so
                # a commit that fails (a full disk) leaves it where it was
                try:
                    self._nvme.commit_now()
                except NVMeWriteFailed:
                    meta.persisted = False
                    raise
        finally:
            meta.in_flight = False
            if guard:
                self.protected.discard(ident)
        keep_src = src == Tier.NVME
        if not keep_src:
            self.release(meta, src)
        self.charge(meta, dest, +1)
        self._index.set_tier(meta, dest)
        self.counters.add(f"moved_{src.label}_to_{dest.label}")
        if dest != Tier.NVME:  # bytes written into NVMe are counted by write()
            self.counters.add(f"bytes_{src.label}_to_{dest.label}", meta.nbytes)
        if dest < src:  # NOTE: no promotions counter existed; the metrics name one
            self.counters.add("promotions")
        return True

    def copy(self, meta: BlockMeta, ref: BlockRef, src: Tier, dest: Tier) -> bool:
        if dest == Tier.NVME:
            return self.write(Tier.NVME, ref, meta, self._mem[src].host_bytes(ref))
        dst = self._mem[dest]
        if not dst.reserve(ref):
            return False
        out = dst.buffer(ref)
        if src == Tier.NVME:
            assert self._nvme is not None
            on_host = isinstance(out, np.ndarray)
            host = out if on_host else np.empty(ref.nbytes, np.uint8)
            if not self._nvme.get_into(ref, host):
                dst.delete(ref)
                self.lost(meta)
                return False
            if not on_host:
                copy_bytes(out, host)
            return True
        copy_bytes(out, self._mem[src].buffer(ref))
        return True

    def host_copy(self, meta: BlockMeta) -> np.ndarray | None:
        """A fresh host copy of the block's bytes (None when its NVMe value is damaged)."""
        ref = self.ref(meta)
        host = np.empty(ref.nbytes, dtype=np.uint8)
        if meta.tier == Tier.NVME:
            assert self._nvme is not None
            if not self._nvme.get_into(ref, host):
                self.lost(meta)
                return None
        else:
            copy_bytes(host, self._mem[meta.tier].buffer(ref))
        return host

    def spill_remote(self, meta: BlockMeta) -> bool:
        """Queue a copy of ``meta`` to the remote tier (asynchronous; False when refused),
        quantized when the tenant's or model's rule says so (as for NVMe). A block whose copy,
        as far as this server knows, is in Redis already (it wrote it) is queued to be checked,
        not written (counted ``remote_copy_kept``, not ``demotions_remote``): the writer writes
        it only when Redis does not confirm the copy.

        NOTE: with ``remote_write="through"`` every block was queued at its put, and again
        when the last local tier evicted it: encoded and written over the copy Redis held. A
        copy the tier knows to be there (:meth:`~tiers.remote.RemoteTier.holds`: its write
        succeeded, nothing deleted or expired it since, written for this deadline or a later
        one; quantized or not) was then kept without a word to Redis, but ``holds`` knows only
        this server's own last write: another server's put of the block with a shorter TTL
        (its ``SET ... PX`` replaces the expiry), its deadline move, or Redis' eviction took the
        copy away, and the block evicted here on its word was lost from every tier. Now such a
        spill is queued with ``skip_held`` like a spill of a copy still queued: the writer
        checks the copy with one ``PTTL`` (there, expiring no sooner than written: skipped,
        counted ``remote_queue_skipped_held`` and ``remote_copy_verified``) and writes it as a
        demotion when not (``remote_copy_not_verified``). The bytes are taken now, as for any
        spill: the local copy goes. When the queue refuses the check (full), the copy is
        trusted as before (``remote_copy_check_refused``). A write refused (queue, quota) or failed
        is not a copy: the block is queued again."""
        assert self.remote is not None
        if self.remote.under_deletion(meta.tenant, meta.fingerprint, lambda: self._chain_keys(meta)):
            self.counters.add("remote_skipped_deleted")
            return False
        ref = self.ref(meta)
        held = self.remote.holds(ref, meta.ttl_deadline)
        host = self.host_copy(meta)
        if host is None:
            return False
        # NOTE: the tenant's remote quota is enforced here, by the tier (it was accepted and
        # ignored: a tenant with a 256-byte remote quota held 1,536 bytes there)
        ok = self.remote.submit(ref, host, ttl_deadline=meta.ttl_deadline,
                                quant=self.quant_policy.for_block(ref.tenant, ref.spec),
                                quota=self._quota_of(meta.tenant, Tier.REMOTE), created=meta.created,
                                parent=meta.parent, skip_held=True)
        if held:
            self.counters.add("remote_copy_kept")
            if not ok:
                self.counters.add("remote_copy_check_refused")
            return True
        self.counters.add("demotions_remote" if ok else "remote_queue_full")
        return ok

    def _chain_keys(self, meta: BlockMeta) -> Iterator[bytes]:
        """``meta``'s key, its local ancestors' keys and the parent key of the first of them."""
        cur: BlockMeta | None = meta
        while cur is not None:
            yield cur.key
            if cur.parent == ROOT_KEY:
                return
            parent = cur.parent
            cur = self._index.get(cur.tenant, parent)
            if cur is None:
                yield parent

    def release(self, meta: BlockMeta, tier: Tier) -> None:
        """Free ``meta``'s bytes in ``tier`` (not its NVMe copy unless ``tier`` is NVMe)."""
        ref = self.ref(meta)
        self.backend(tier).delete(ref)
        self.charge(meta, tier, -1)

    def drop_copy(self, meta: BlockMeta) -> None:
        assert self._nvme is not None and meta.persisted and meta.tier < Tier.NVME
        self._nvme.delete(self.ref(meta))
        self.charge(meta, Tier.NVME, -1)
        self._index.set_persisted(meta, False)
        self.counters.add("nvme_copies_dropped")

    def lost(self, meta: BlockMeta, reason: str = "integrity_failures") -> None:
        """``meta``'s NVMe value is gone (the tier already forgot it): it failed its integrity
        check, or the commit that would have stored it failed (``reason`` is counted). A block
        living in NVMe goes with its subtree; one above keeps its memory copy."""
        self.counters.add(reason)
        if self._index.get(meta.tenant, meta.key) is not meta:
            return
        self.charge(meta, Tier.NVME, -1)
        self._index.set_persisted(meta, False)
        if meta.tier == Tier.NVME or meta.in_flight:
            meta.in_flight = False
            for m in self._index.subtree(meta):
                self.remove(m, nvme_gone=(m is meta))

    def remove(self, meta: BlockMeta, nvme_gone: bool = False) -> None:
        """Delete ``meta`` from every tier and the index (callers handle its subtree)."""
        ref = self.ref(meta)
        if meta.tier != Tier.NVME:
            self.release(meta, meta.tier)
        if meta.persisted and not nvme_gone and self._nvme is not None:
            self._nvme.delete(ref)
            self.charge(meta, Tier.NVME, -1)
        elif meta.tier == Tier.NVME and not nvme_gone:
            self._nvme.delete(ref)  # type: ignore[union-attr]
            self.charge(meta, Tier.NVME, -1)
        self._sessions.forget_block(meta)
        self._index.remove(meta)
        self.policy.on_remove(meta)

    def drop(self, meta: BlockMeta, reason: str) -> int:
        sub = self._index.subtree(meta)
        for m in sub:
            self.remove(m)
        self.counters.add(reason, len(sub))
        return len(sub)

    def touch(self, meta: BlockMeta, now: float) -> None:
        meta.last_access = now
        meta.access_count += 1
        self.policy.on_access(meta, now)

    def serve(self, meta: BlockMeta, dst: Any, now: float) -> bool:
        found = self.bring_up(meta)
        if found is None or not self.copy_out(meta, dst):
            return False
        self.hit(found)
        self.touch(meta, now)
        return True

    def hit(self, found: Tier) -> None:
        """Count a block served from ``found`` (the tier :meth:`bring_up` found it in). NOTE:
        counted by bring_up before, a block that then failed its integrity check was counted
        as a hit there and a miss overall (the tiers' hits summed to more than ``hits``)."""
        self.counters.add(f"hits_{found.label}")

    def bring_up(self, meta: BlockMeta) -> Tier | None:
        """The first half of :meth:`serve`: promote ``meta`` to the top tier when its parent is
        there (best effort); the tier it was found in (count it with :meth:`hit` once it is
        served), None when the block was lost to an integrity failure meanwhile."""
        first = self.tiers[0]
        # NOTE: counted after the promotion, every hit was an HBM hit: hits_dram and hits_nvme
        # stayed 0 whatever the tiers served
        found = meta.tier
        if meta.tier != first and meta.tier in (Tier.DRAM, Tier.NVME):
            parent = self._index.get(meta.tenant, meta.parent)
            if parent is None or parent.tier == first:
                self.move(meta, first)  # promotion is best effort: serve from below if no room
            if self._index.get(meta.tenant, meta.key) is not meta:
                return None  # lost to an integrity failure while promoting
        return found

    def copy_out(self, meta: BlockMeta, dst: Any) -> bool:
        """The second half of :meth:`serve`: copy (decode) the block's bytes into ``dst``; False
        when its NVMe value failed its integrity check (the block is gone then)."""
        ref = self.ref(meta)
        if meta.tier == Tier.NVME:
            assert self._nvme is not None
            is_np = isinstance(dst, np.ndarray)
            host = dst if is_np else (dst.numpy() if dst.device.type == "cpu"
                                      else np.empty(ref.nbytes, np.uint8))
            if not self._nvme.get_into(ref, host):
                self.lost(meta)
                return False
            if not is_np and dst.device.type != "cpu":
                copy_bytes(dst, host)
        else:
            self._mem[meta.tier].get_into(ref, dst)
        return True

    def promote(self, chain: list[BlockMeta], tier: Tier | None = None) -> int:
        """Move a chain (ancestors first) up to ``tier``; stops at the first block that cannot
        move, so the tier order holds at every step. The chain and every ancestor of it are
        protected meanwhile.

        NOTE: only the chain was: an ancestor already in ``tier`` (left out of the chain) whose
        children were all below it was a leaf there, and making room for the chain's first
        block evicted it; the block then sat in ``tier`` under a parent below (a session
        resumed under a prefix in HBM: ['dram', 'dram', 'hbm'], and lookups stopped at the
        prefix)."""
        target = tier if tier is not None else self.tiers[0]
        moved = 0
        idents = [(m.tenant, m.key) for m in self.lineage(chain) if (m.tenant, m.key) not in self.protected]
        self.protected.update(idents)
        try:
            for m in chain:
                if m.tier <= target:
                    continue
                parent = self._index.get(m.tenant, m.parent)
                if parent is not None and parent.tier > target:
                    break
                if not self.move(m, target):
                    break
                moved += 1
        finally:
            self.protected.difference_update(idents)
        return moved
