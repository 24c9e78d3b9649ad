"""The client's side of the shared-memory data plane: its registered region, the allocator of
block slots in it, and the blocks an engine fills there directly (:class:`LocalBlocks`: a
put or get on them moves the bytes once). :class:`kvstore.client.Client` owns one
:class:`LocalPlane` when its server is on the same host."""

from __future__ import annotations

import threading
from typing import Self

import numpy as np
import torch

from kvstore.errors import InvalidArgument
from kvstore.shm import ShmRegion
from kvstore.spec import ModelSpec
from tiers.arena import ExtentAllocator


class LocalPlane:
    """The client's shared-memory region, registered with the server, and its slot allocator."""

    def __init__(self, region: ShmRegion, region_id: int) -> None:
        self.region = region
        self.region_id = region_id
        self.arena = np.frombuffer(region.view(0, region.usable), dtype=np.uint8)
        self.base = self.arena.ctypes.data
        self.alloc = ExtentAllocator(region.usable, alignment=4096)
        self.lock = threading.Lock()

    def offsets_of(self, arr: np.ndarray) -> int | None:
        """Offset of a contiguous array inside the region, or None when it lives elsewhere."""
        addr = arr.ctypes.data
        if self.base <= addr and addr + arr.nbytes <= self.base + self.arena.size:
            return addr - self.base
        return None

    def reserve(self, nbytes: int) -> int | None:
        with self.lock:
            return self.alloc.alloc(nbytes)

    def reserve_blocks(self, n: int, nbytes: int) -> tuple[int, int]:
        """Slots for as many of ``n`` blocks as fit (halving until they do): ``(offset, count)``;
        count 0 when not even one block fits."""
        count = n
        while count:
            off = self.reserve(count * nbytes)
            if off is not None:
                return off, count
            count //= 2
        return -1, 0

    def release(self, offset: int) -> None:
        with self.lock:
            self.alloc.free(offset)

    def close(self) -> None:
        del self.arena
        self.region.close()


class LocalBlocks:
    """Blocks allocated in the client's shared region; ``tensor`` is the view to fill or read.
    Call :meth:`free` (or use as a context manager) to give the slots back."""

    def __init__(self, plane: LocalPlane, spec: ModelSpec, n: int) -> None:
        self._plane = plane
        nbytes = spec.block_nbytes * n
        off = plane.reserve(nbytes)
        if off is None:
            raise InvalidArgument(f"{nbytes} bytes do not fit in the free part of the shared region")
        self.offset = off
        flat = torch.from_numpy(plane.arena[off : off + nbytes])
        self.tensor = flat.view(spec.torch_dtype).view(n, *spec.block_shape)

    def free(self) -> None:
        if self.offset >= 0:
            self.tensor = None  # type: ignore[assignment]
            self._plane.release(self.offset)
            self.offset = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
