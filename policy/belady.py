"""Belady's offline optimum, adapted to tiers: the offline reference of the trace replay.

In every tier it evicts, among the leaf-first candidates, the block whose next use is farthest
(never-used-again first; ties deepest first). A victim that is never used again is dropped;
others are demoted to the next tier offered. It needs future knowledge, so it only works once
``bind_oracle(next_use)`` has been called (the replay does; the Store cannot) — before that
every call raises :class:`~kvstore.errors.FailedPrecondition`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore.block import BlockMeta, Tier
from kvstore.errors import FailedPrecondition
from policy.base import SpecLookup, register

INF = float("inf")


class BeladyPolicy:
    name = "belady"

    def __init__(self, spec_lookup: SpecLookup | None = None) -> None:
        self._next_use: Callable[[bytes], float] | None = None

    def bind_oracle(self, next_use: Callable[[bytes], float]) -> None:
        self._next_use = next_use

    def next_use(self, meta: BlockMeta) -> float:
        """When the block is next requested (the oracle's answer; inf for never)."""
        if self._next_use is None:
            raise FailedPrecondition("belady needs a next-use oracle; only the trace replay has one")
        return self._next_use(meta.key)

    def on_insert(self, meta: BlockMeta, now: float) -> None:
        pass

    def on_access(self, meta: BlockMeta, now: float) -> None:
        pass

    def on_remove(self, meta: BlockMeta) -> None:
        pass

    def evict_key(self, meta: BlockMeta, tier: Tier, now: float) -> tuple[float, int]:
        return (-self.next_use(meta), -meta.depth)

    def rank(self, tier: Tier, candidates: Sequence[BlockMeta], now: float) -> list[BlockMeta]:
        return sorted(candidates, key=lambda m: self.evict_key(m, tier, now))

    def demote_to(
        self, meta: BlockMeta, src: Tier, available: Sequence[Tier], now: float
    ) -> Tier | None:
        if not available or self.next_use(meta) == INF:
            return None
        return available[0]

    def admit(self, meta: BlockMeta, tier: Tier, now: float) -> bool:
        return self.next_use(meta) != INF


register("belady", BeladyPolicy)
