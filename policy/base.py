"""The interface between the Store (mechanism) and a placement policy (decisions).

Contract:

* ``rank(tier, candidates, now)`` orders eviction candidates of one tier, first = evict first.
  The Store only offers candidates that are unpinned, not in flight, and have no resident child
  in the same or a faster tier (leaf-first), so any order the policy returns is legal.
  It must return a permutation of a subset of ``candidates`` (it may hold some back) and change
  nothing.
* ``demote_to(meta, src, available, now)`` says where an evicted block goes: one of
  ``available`` (slower tiers that exist and keep the tier order, in order), or ``None`` to
  drop it. When the tier it names cannot take the block (no room there, or ``admit``
  refuses), the caller asks again for the same victim, at the same ``now``, with the tiers
  after that one; a policy learns from one eviction once.
* ``admit(meta, tier, now)`` lets a lower tier refuse a block unlikely to come back.
* ``on_insert / on_access / on_remove`` keep whatever statistics the policy needs.

Policies get time from the Store's injected clock (``now`` arguments) and never read a global
clock, so tests control decay and recency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvstore.block import BlockMeta, Tier
from kvstore.keys import ROOT_KEY
from kvstore.spec import ModelSpec

SpecLookup = Callable[[bytes], "ModelSpec | None"]


def parent_key(meta: BlockMeta) -> bytes:
    """``meta``'s parent key, ``b""`` for a root block.

    NOTE: the Store gives a root ``parent=ROOT_KEY`` (32 zero bytes) and the replay ``b""``;
    read as a truth value, every Store root had a parent, and the reuse estimate classed each
    new prompt's first block as extending a cached prefix (the replay: as a new prompt). Every
    policy test of "has a parent" goes through here."""
    parent = meta.parent
    return b"" if parent == ROOT_KEY else parent


def life_left(meta: BlockMeta, now: float) -> float | None:
    """Seconds until ``meta``'s TTL deadline (``<= 0``: expired, as the Store's
    ``now >= ttl_deadline``), or None for a block without a deadline."""
    deadline = meta.ttl_deadline
    return None if deadline is None else deadline - now


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, meta: BlockMeta, now: float) -> None: ...

    def on_access(self, meta: BlockMeta, now: float) -> None: ...

    def on_remove(self, meta: BlockMeta) -> None: ...

    def rank(self, tier: Tier, candidates: Sequence[BlockMeta], now: float) -> list[BlockMeta]: ...

    def demote_to(
        self, meta: BlockMeta, src: Tier, available: Sequence[Tier], now: float
    ) -> Tier | None: ...

    def admit(self, meta: BlockMeta, tier: Tier, now: float) -> bool: ...


PolicyFactory = Callable[[SpecLookup], EvictionPolicy]
#: registry name -> factory(spec_lookup). Modules register themselves on import (see below).
POLICIES: dict[str, PolicyFactory] = {}


def register(name: str, factory: PolicyFactory) -> None:
    POLICIES[name] = factory


def make_policy(name: str, spec_lookup: SpecLookup | None = None) -> EvictionPolicy:
    """Build a registered policy by name (``lru`` always exists)."""
    from policy import lru  # noqa: F401  (registers the baseline)

    try:
        import policy.registry  # noqa: F401  (registers the others when present)
    except ImportError:
        pass
    try:
        factory = POLICIES[name]
    except KeyError:
        from kvstore.errors import InvalidArgument

        raise InvalidArgument(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return factory(spec_lookup or (lambda fp: None))
