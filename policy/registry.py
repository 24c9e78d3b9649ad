"""Registers the policies beyond the LRU baseline, and names two optional capabilities.

Importing this module registers ``gdsf``, ``cost`` and ``belady`` with
:func:`policy.base.register` (``make_policy`` imports it when present).

Optional capabilities (structural protocols; a policy need not import this module):

* :class:`KeyedPolicy` — ``evict_key(meta, tier, now)`` gives a sort key such that
  ``rank(tier, cands, now) == sorted(cands, key=evict_key)``, and the key of a block changes
  only when the policy is notified about that block (``on_insert``/``on_access``/
  ``demote_to``) or its metadata changes. A caller that keeps candidates in a heap (the trace
  replay) then never needs a full ``rank``.
* :class:`OraclePolicy` — ``bind_oracle(next_use)`` gives an offline policy the future:
  ``next_use(key)`` is when the block is next requested (``inf`` for never). Only the replay
  can provide it.
* :class:`TieredPolicy` — ``bind_tiers(tiers)`` tells a policy which local tiers exist
  (fastest first), so it values a block in a tier against the tier its victims really go to
  (none: they are dropped). The Store's placement and the replay call it before any block is
  inserted; a policy never told assumes HBM, DRAM and NVMe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvstore.block import BlockMeta, Tier


@runtime_checkable
class KeyedPolicy(Protocol):
    def evict_key(self, meta: BlockMeta, tier: Tier, now: float) -> Any: ...


@runtime_checkable
class OraclePolicy(Protocol):
    def bind_oracle(self, next_use: Callable[[bytes], float]) -> None: ...


@runtime_checkable
class TieredPolicy(Protocol):
    def bind_tiers(self, tiers: Sequence[Tier]) -> None: ...


from policy import belady, cost, gdsf, lru  # noqa: F401  (each registers itself)
