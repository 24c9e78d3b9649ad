"""Block records: tier names, session states and the metadata of one block.

These are plain records shared by ``tiers`` (which store bytes), ``policy`` (which ranks
metadata) and the Store (which owns them). Nothing here touches tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore.errors import InvalidArgument, UnknownTier

V = TypeVar("V")


class Tier(enum.IntEnum):
    """Storage tiers, fastest first: a lower value is a faster tier."""

    HBM = 0
    DRAM = 1
    NVME = 2
    REMOTE = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str | Tier) -> Tier:
        if isinstance(name, Tier):
            return name
        try:
            return cls[str(name).upper()]
        except KeyError:
            raise UnknownTier(
                f"unknown tier {name!r}; tiers are {[t.label for t in cls]}"
            ) from None

    @classmethod
    def each_once(cls, pairs: Iterable[tuple[str | Tier, V]], what: str = "quota for tier") -> dict[Tier, V]:
        """``(tier name, value)`` pairs keyed by tier; InvalidArgument (``what`` names the
        setting) when two spellings name one tier (``hbm`` and ``HBM``): folded into one dict,
        one of the values was kept silently. The Store, the Admin service and the CLI use it."""
        out: dict[Tier, V] = {}
        spelled: dict[Tier, str | Tier] = {}
        for name, value in pairs:
            tier = cls.parse(name)
            if tier in out:
                raise InvalidArgument(f"{what} {tier.label!r} given twice ({spelled[tier]!r} and {name!r})")
            out[tier], spelled[tier] = value, name
        return out


class SessionState(enum.Enum):
    ACTIVE = "active"  # blocks pinned in HBM
    PAUSED = "paused"  # demoted to DRAM, kept
    RESUMED = "resumed"  # prefetched back to HBM (pinned again, like ACTIVE)
    CLOSED = "closed"  # unpinned; blocks stay as shareable prefix cache


@dataclass(slots=True)
class BlockMeta:
    """Metadata of one resident block.

    ``tier`` is the fastest tier holding the block's bytes; ``persisted`` says NVMe also holds a
    committed copy (a block promoted out of NVMe keeps it, so a crash does not lose it). ``in_flight`` is True between the prepare and
    complete phases of a move: such a block is neither a hit nor evictable. ``pins`` counts the
    sessions that pin it (ACTIVE or RESUMED, named in ``sessions``) and the read leases on it
    (a Get stream or a GetLocal copying it out): pinned blocks are never evicted. Times come from the Store's
    injected clock (seconds).
    """

    key: bytes
    tenant: str
    fingerprint: bytes
    parent: bytes
    depth: int
    nbytes: int
    tokens: int
    tier: Tier
    created: float
    last_access: float
    access_count: int = 0
    pins: int = 0
    paused: int = 0  # PAUSED sessions that hold it (they are expected back)
    in_flight: bool = False
    persisted: bool = False  # an NVMe copy exists too (kept when promoted out of NVMe)
    ttl_deadline: float | None = None
    sessions: set[str] = field(default_factory=set)
    children: int = 0  # resident children in the prefix tree

    @property
    def pinned(self) -> bool:
        return self.pins > 0
