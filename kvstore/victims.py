"""VictimQueue: the policy's eviction order for one make-room loop, kept current as victims go.

A tier past its high watermark evicts down to its low one (10 % of the tier with the default
0.95 / 0.85). Asking the policy to rank every candidate for each victim made that loop cost
O(n log n) per victim, O(n² log n) per loop: with 8,000 small blocks in NVMe a put that crossed
the watermark averaged 30–60 ms per 8 blocks (scratch loop of 8-block puts into a Store with
100 / 300 / 8,000 blocks per tier, 2026-11-30), and the time grows with the tier.

For a policy with stable keys (:class:`policy.registry.KeyedPolicy`: a block's key changes only
when the policy is notified about that block) one ranking per loop yields the same victims as
re-ranking before each, up to the order among equal keys: within a loop the policy is notified
only about the victims themselves, and the only new candidates a loop creates are parents its
victims leave with no child in the tier, which :meth:`evicted` adds as they appear. Entries are checked again when
they come out (the block may have gone, been pinned or moved meanwhile) and re-queued if their
key moved. Other policies are re-ranked before each victim, as before.

:class:`CloseVictims` is the order a graceful close gives NVMe's blocks up in for warmer memory
blocks being committed (:meth:`kvstore.store.Store.close`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvstore.block import BlockMeta, Tier
from policy.base import EvictionPolicy
from policy.registry import KeyedPolicy


class VictimQueue:
    """Victims of one tier, best first, for one make-room loop (under the Store's lock).

    ``candidates()`` lists the tier's evictable blocks now; ``valid(meta)`` says whether one
    still is. Call :meth:`pop` for the next victim to try, and :meth:`evicted` after a victim
    left the tier (with its parent, if it has one in the index)."""

    def __init__(self, policy: EvictionPolicy, tier: Tier, candidates: Callable[[], list[BlockMeta]],
                 valid: Callable[[BlockMeta], bool], now: float,
                 priority: Callable[[BlockMeta], int] | None = None) -> None:
        """``priority(meta)``: its tenant's priority; a lower one goes first, whatever the
        policy's order (which orders the blocks of equal priority)."""
        self._policy = policy
        self._priority = priority
        self._keyed = policy if isinstance(policy, KeyedPolicy) else None
        self._tier = tier
        self._candidates = candidates
        self._valid = valid
        self._now = now
        self._heap: list[tuple[Any, int, BlockMeta]] | None = None
        self._order: Iterator[BlockMeta] | None = None
        self._seq = itertools.count()

    def _key(self, meta: BlockMeta) -> Any:
        assert self._keyed is not None
        key = self._keyed.evict_key(meta, self._tier, self._now)
        return key if self._priority is None else (self._priority(meta), key)

    def pop(self) -> BlockMeta | None:
        """The next victim to try, or None when no candidate is left."""
        if self._keyed is None:
            if self._order is None:
                ranked = self._policy.rank(self._tier, self._candidates(), self._now)
                if self._priority is not None:
                    ranked = sorted(ranked, key=self._priority)  # NOTE: stable: policy order within
                self._order = iter(ranked)
            return next(self._order, None)
        if self._heap is None:
            # NOTE: the sequence number breaks ties in candidate order, as a stable sort would;
            # a parent added later by evicted() goes after the blocks with its key
            self._heap = [(self._key(m), next(self._seq), m) for m in self._candidates()]
            heapq.heapify(self._heap)
        while self._heap:
            key, _, meta = heapq.heappop(self._heap)
            if not self._valid(meta):
                continue
            now_key = self._key(meta)
            if now_key != key:
                heapq.heappush(self._heap, (now_key, next(self._seq), meta))
                continue
            return meta
        return None

    def evicted(self, parent: BlockMeta | None) -> None:
        """A victim left the tier; ``parent`` (its parent block, if indexed) may now be a
        candidate."""
        if self._keyed is None:
            self._order = None  # re-rank before the next victim
        elif self._heap is not None and parent is not None and self._valid(parent):
            heapq.heappush(self._heap, (self._key(parent), next(self._seq), parent))


class CloseVictims:
    """NVMe's own blocks that a close may give up for warmer memory blocks, coldest first.

    At close every block ends where NVMe keeps it or nowhere, so a memory block being committed
    and an NVMe block are valued alike, as blocks of NVMe: ``key(meta)`` orders them (lower =
    colder). Only the leaves of NVMe's own blocks are offered (``valid``: unpinned, not in
    flight, no child in the index), never a memory block's NVMe copy: those are the memory
    blocks being kept. A parent becomes a candidate once its last child went (:meth:`offer`).
    Under the Store's lock, at close (nothing reads meanwhile, so the keys stand still; each is
    checked again as it comes out all the same)."""

    def __init__(self, candidates: Iterable[BlockMeta], key: Callable[[BlockMeta], Any],
                 valid: Callable[[BlockMeta], bool]) -> None:
        self._key = key
        self._valid = valid
        self._seq = itertools.count()
        self._heap = [(key(m), next(self._seq), m) for m in candidates]
        heapq.heapify(self._heap)

    def pop_below(self, bound: Any, tenant: str | None = None) -> BlockMeta | None:
        """The coldest candidate (of ``tenant`` only, if given) whose key is below ``bound``,
        taken out; None when there is none."""
        aside: list[tuple[Any, int, BlockMeta]] = []
        found = None
        while self._heap:
            key, seq, meta = self._heap[0]
            if not self._valid(meta):
                heapq.heappop(self._heap)
                continue
            now_key = self._key(meta)
            if now_key != key:
                heapq.heapreplace(self._heap, (now_key, next(self._seq), meta))
                continue
            if not key < bound:
                break
            heapq.heappop(self._heap)
            if tenant is not None and meta.tenant != tenant:
                aside.append((key, seq, meta))  # NOTE: another tenant's bytes free no quota
                continue
            found = meta
            break
        for entry in aside:
            heapq.heappush(self._heap, entry)
        return found

    def offer(self, meta: BlockMeta | None) -> None:
        """``meta`` (a victim's parent) may have become a candidate."""
        if meta is not None and self._valid(meta):
            heapq.heappush(self._heap, (self._key(meta), next(self._seq), meta))
