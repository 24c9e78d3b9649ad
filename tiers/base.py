"""The one small interface every tier implements, and the records it uses.

A tier stores, loads, deletes and reports usage of keyed blocks; it decides nothing (which
block goes where is the Store's and the policy's business). Moves between tiers are driven
by the Store in two phases (prepare: mark the block in flight; complete: publish or abort),
so a tier only needs plain operations that either fully happen or raise.

``BlockRef`` names a block inside a tier: the tenant namespace, the 32-byte block key and the
ModelSpec that gives its size, dtype and shape (the NVMe codec binds all three into the stored
value's authenticated header).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvstore.block import Tier
from kvstore.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class BlockRef:
    tenant: str
    key: bytes
    spec: ModelSpec

    @property
    def ident(self) -> tuple[str, bytes]:
        return (self.tenant, self.key)

    @property
    def nbytes(self) -> int:
        return self.spec.block_nbytes


@dataclass(frozen=True, slots=True)
class TierUsage:
    tier: Tier
    used_bytes: int
    capacity_bytes: int
    blocks: int


class TierBackend(Protocol):
    """Keyed block storage. ``data``/``out`` are 1-D uint8 numpy arrays of ``ref.nbytes``."""

    tier: Tier
    capacity: int

    def put(self, ref: BlockRef, data: np.ndarray) -> bool:
        """Store the bytes; False when there is no room (nothing is written then)."""
        ...

    def get_into(self, ref: BlockRef, out: np.ndarray) -> bool:
        """Copy the block into ``out``; False on a miss (including a failed integrity check,
        after which the tier has deleted the value)."""
        ...

    def delete(self, ref: BlockRef) -> bool: ...

    def contains(self, ref: BlockRef) -> bool: ...

    def usage(self) -> TierUsage: ...

    def close(self) -> None: ...


def as_bytes_view(data: Any) -> np.ndarray:
    """A 1-D uint8 numpy view of a contiguous CPU buffer or tensor (no copy)."""
    if hasattr(data, "detach"):  # torch tensor
        t = data.detach()
        if t.device.type != "cpu":
            raise ValueError("as_bytes_view needs a CPU tensor")
        import torch

        return t.contiguous().view(torch.uint8).reshape(-1).numpy()
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if arr.dtype != np.uint8:
        arr = arr.view(np.uint8)
    return arr.reshape(-1)
