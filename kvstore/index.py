"""PrefixIndex: the Store's tree of resident blocks, per tenant.

A block is identified by ``(tenant, key)``; its parent is the key of the preceding block of
the same prefix (``ROOT_KEY`` for the first). The index answers the questions the Store's
mechanism needs, in time proportional to the answer:

* the longest usable prefix of a key chain (every block present, visible, of the spec's
  fingerprint, and chained parent→child);
* eviction candidates of a tier: unpinned, not in flight, not protected, and with no child in
  the same or a faster tier (leaf-first, which keeps the tier order along every path);
* the subtree under a block (deepest first), for drops and deletions;
* the blocks past their TTL deadline (:class:`kvstore.expiry.DeadlineHeap`), without a scan.

Plain bookkeeping; the Store's lock serialises all calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvstore.block import BlockMeta, Tier
from kvstore.expiry import DeadlineHeap

Ident = tuple[str, bytes]


class PrefixIndex:
    def __init__(self) -> None:
        self._metas: dict[str, dict[bytes, BlockMeta]] = {}  # tenant -> key -> meta
        self._count = 0
        self._children: dict[Ident, set[bytes]] = {}
        self._by_tier: dict[Tier, dict[Ident, BlockMeta]] = {t: {} for t in Tier}
        self._persisted: dict[Ident, BlockMeta] = {}  # blocks above NVMe that keep an NVMe copy
        # NOTE: a deadline moved later is refiled when its old one comes due; one moved earlier
        # (a tenant's TTL lowered) is filed again by :meth:`deadline_moved`
        self._deadlines = DeadlineHeap()

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[BlockMeta]:
        return iter([m for per in self._metas.values() for m in per.values()])

    def get(self, tenant: str, key: bytes) -> BlockMeta | None:
        per = self._metas.get(tenant)
        return per.get(key) if per is not None else None

    def tenant_blocks(self, tenant: str) -> dict[bytes, BlockMeta]:
        """The tenant's key -> meta map (read-only for callers; fast chain walks)."""
        return self._metas.get(tenant) or {}

    def add(self, meta: BlockMeta) -> None:
        ident = (meta.tenant, meta.key)
        per = self._metas.setdefault(meta.tenant, {})
        assert meta.key not in per, "block added twice"
        per[meta.key] = meta
        self._count += 1
        self._by_tier[meta.tier][ident] = meta
        self._children.setdefault((meta.tenant, meta.parent), set()).add(meta.key)
        parent = per.get(meta.parent)
        if parent is not None:
            parent.children += 1
        meta.children = len(self._children.get(ident, ()))
        self._track_persisted(meta)
        self._deadlines.push(meta, self._count)

    def deadline_moved(self, meta: BlockMeta) -> None:
        """``meta``'s TTL deadline moved earlier: file it at the new one (the entry at the old
        one is discarded or refiled when it comes due)."""
        self._deadlines.push(meta, self._count)

    def remove(self, meta: BlockMeta) -> None:
        ident = (meta.tenant, meta.key)
        per = self._metas[meta.tenant]
        del per[meta.key]
        self._count -= 1
        del self._by_tier[meta.tier][ident]
        self._persisted.pop(ident, None)
        siblings = self._children.get((meta.tenant, meta.parent))
        if siblings is not None:
            siblings.discard(meta.key)
            if not siblings:
                del self._children[(meta.tenant, meta.parent)]
        parent = per.get(meta.parent)
        if parent is not None:
            parent.children -= 1
        if not per:
            del self._metas[meta.tenant]

    def set_tier(self, meta: BlockMeta, tier: Tier) -> None:
        ident = (meta.tenant, meta.key)
        del self._by_tier[meta.tier][ident]
        meta.tier = tier
        self._by_tier[tier][ident] = meta
        self._track_persisted(meta)

    def set_persisted(self, meta: BlockMeta, persisted: bool) -> None:
        meta.persisted = persisted
        self._track_persisted(meta)

    def _track_persisted(self, meta: BlockMeta) -> None:
        ident = (meta.tenant, meta.key)
        if meta.persisted and meta.tier < Tier.NVME:
            self._persisted[ident] = meta
        else:
            self._persisted.pop(ident, None)

    # -- queries ------------------------------------------------------------------------------
    def children(self, meta: BlockMeta) -> list[BlockMeta]:
        keys = self._children.get((meta.tenant, meta.key), ())
        per = self._metas.get(meta.tenant, {})
        return [per[k] for k in keys if k in per]

    def expired(self, now: float) -> list[BlockMeta]:
        """Indexed blocks whose TTL deadline has passed (``now >= deadline``), each reported once;
        the caller drops them (with their subtrees)."""
        if self._deadlines.needs_rebuild:
            self._deadlines.rebuild(self)
        # NOTE: a block filed again by deadline_moved may come due twice
        return list({id(m): m for m in self._deadlines.due(now, self._indexed)}.values())

    def _indexed(self, meta: BlockMeta) -> bool:
        per = self._metas.get(meta.tenant)
        return per is not None and per.get(meta.key) is meta

    def in_tier(self, tier: Tier) -> Iterable[BlockMeta]:
        return self._by_tier[tier].values()

    def persisted_copies(self) -> Iterable[BlockMeta]:
        """Blocks living above NVMe that also hold an NVMe copy."""
        return self._persisted.values()

    def candidates(self, tier: Tier, protected: set[Ident], tenant: str | None = None) -> list[BlockMeta]:
        """Evictable leaves of ``tier`` (optionally of one tenant only)."""
        return [m for m in self._by_tier[tier].values() if self._evictable(m, tier, protected, tenant)]

    def is_candidate(self, meta: BlockMeta, tier: Tier, protected: set[Ident],
                     tenant: str | None = None) -> bool:
        """Whether ``meta`` is indexed, in ``tier`` and one of its :meth:`candidates` now."""
        return (meta.tier == tier and self._indexed(meta)
                and self._evictable(meta, tier, protected, tenant))

    def _evictable(self, m: BlockMeta, tier: Tier, protected: set[Ident], tenant: str | None) -> bool:
        if m.pins or m.in_flight or (m.tenant, m.key) in protected:
            return False
        if tenant is not None and m.tenant != tenant:
            return False
        return not (m.children and any(c.tier <= tier for c in self.children(m)))

    def subtree(self, meta: BlockMeta) -> list[BlockMeta]:
        """``meta`` and all its descendants, deepest first."""
        order: list[BlockMeta] = []
        stack = [meta]
        while stack:
            m = stack.pop()
            order.append(m)
            stack.extend(self.children(m))
        order.sort(key=lambda m: -m.depth)
        return order

    def of_tenant(self, tenant: str) -> list[BlockMeta]:
        return list(self._metas.get(tenant, {}).values())
