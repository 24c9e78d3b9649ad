"""Leaf-first LRU: the baseline every system in the field uses.

Evicts the least recently accessed candidate first; demotes every victim to the next tier
that exists; admits everything.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import BlockMeta, Tier
from policy.base import SpecLookup, register


class LRUPolicy:
    name = "lru"

    def __init__(self, spec_lookup: SpecLookup | None = None) -> None:
        self._spec_lookup = spec_lookup

    def on_insert(self, meta: BlockMeta, now: float) -> None:
        pass  # recency lives in meta.last_access, which the Store maintains

    def on_access(self, meta: BlockMeta, now: float) -> None:
        pass

    def on_remove(self, meta: BlockMeta) -> None:
        pass

    def evict_key(self, meta: BlockMeta, tier: Tier, now: float) -> tuple[float, int]:
        """Sort key of :meth:`rank` (the replay's fast path, ``policy.registry.KeyedPolicy``)."""
        return (meta.last_access, -meta.depth)

    def rank(self, tier: Tier, candidates: Sequence[BlockMeta], now: float) -> list[BlockMeta]:
        # Ties (same access time) broken deepest first so a chain frees its tail first.
        return sorted(candidates, key=lambda m: (m.last_access, -m.depth))

    def demote_to(
        self, meta: BlockMeta, src: Tier, available: Sequence[Tier], now: float
    ) -> Tier | None:
        return available[0] if available else None

    def admit(self, meta: BlockMeta, tier: Tier, now: float) -> bool:
        return True


register("lru", LRUPolicy)
