"""GDSF (Greedy-Dual-Size-Frequency), leaf-first: the cost-aware baseline of the literature.

Each block carries ``H = L + frequency × recompute_seconds / bytes``, stamped when it is
inserted, read, or demoted into a tier; the candidate with the lowest ``H`` is evicted first
and ``L`` of that tier rises to the victim's ``H`` (aging: old blocks lose to fresh ones
unless they are read often or are expensive). Every victim is demoted to the next tier offered
and every tier admits everything — only the eviction order differs from LRU.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.block import BlockMeta, Tier
from policy.base import SpecLookup, register
from policy.cost_model import CostModelConfig, CostModels


class GDSFPolicy:
    name = "gdsf"

    def __init__(self, spec_lookup: SpecLookup | None = None,
                 costs: CostModelConfig | None = None) -> None:
        self._costs = CostModels(spec_lookup, costs)
        self._level = [0.0] * len(Tier)  # L per tier
        self._h: dict[bytes, float] = {}
        # per tier: (key, now) of the victim demote_to last learnt from (see there)
        self._leaving: list[tuple[bytes, float] | None] = [None] * len(Tier)

    def _value(self, meta: BlockMeta) -> float:
        model = self._costs.get(meta.fingerprint, meta.tokens)
        rec = model.recompute_seconds(meta.tokens, meta.depth)
        return max(meta.access_count, 1) * rec / max(meta.nbytes, 1)

    def _stamp(self, meta: BlockMeta, tier: Tier) -> None:
        self._h[meta.key] = self._level[tier] + self._value(meta)

    def on_insert(self, meta: BlockMeta, now: float) -> None:
        self._stamp(meta, meta.tier)

    def on_access(self, meta: BlockMeta, now: float) -> None:
        self._stamp(meta, Tier.HBM)  # a read brings the block to HBM

    def on_remove(self, meta: BlockMeta) -> None:
        self._h.pop(meta.key, None)

    def evict_key(self, meta: BlockMeta, tier: Tier, now: float) -> tuple[float, int]:
        h = self._h.get(meta.key)
        if h is None:
            h = self._level[tier] + self._value(meta)
        return (h, -meta.depth)

    def rank(self, tier: Tier, candidates: Sequence[BlockMeta], now: float) -> list[BlockMeta]:
        return sorted(candidates, key=lambda m: self.evict_key(m, tier, now))

    def demote_to(
        self, meta: BlockMeta, src: Tier, available: Sequence[Tier], now: float
    ) -> Tier | None:
        if self._leaving[src] != (meta.key, now):
            # NOTE: the Store asks again, with the tiers after the one named, when that one
            # could not take the victim (policy.base): the second ask read the H the first had
            # stamped for the destination, and raised ``src``'s level past the victim's
            self._leaving[src] = (meta.key, now)
            h = self._h.get(meta.key)
            if h is not None and h > self._level[src]:
                self._level[src] = h
        if not available:
            return None
        self._stamp(meta, available[0])
        return available[0]

    def admit(self, meta: BlockMeta, tier: Tier, now: float) -> bool:
        return True


register("gdsf", GDSFPolicy)
