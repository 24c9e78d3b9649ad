"""The client's side of the shared-memory data plane: its registered region, the allocator of
block slots in it, and the blocks an engine fills there directly (:class:`LocalBlocks`: a
put or get on them moves the bytes once). :class:`kvstore.client.Client` owns one
:class:`LocalPlane` when its server is on the same host."""

from __future__ import annotations

import itertools
import operator
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Self

import numpy as np
import torch

from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.shm import ShmRegion
from kvstore.spec import ModelSpec
from tiers.arena import ExtentAllocator


class LocalPlane:
    """The client's shared-memory region, registered with the server, and its slot allocator.

    Slots of a call that ended without the server's answer (deadline, cancel, broken
    connection) are *held*: the server may still copy from or into them, so they are not
    reused until the server's fence confirms that call is over (:meth:`hold`,
    :meth:`settle_held`), or the region is registered with a new server process."""

    #: seconds between fence attempts for held slots
    FENCE_RETRY_S = 1.0

    def __init__(self, region: ShmRegion, region_id: int) -> None:
        self.region = region
        self.region_id = region_id
        self.arena = np.frombuffer(region.view(0, region.usable), dtype=np.uint8)
        self.base = self.arena.ctypes.data
        self.alloc = ExtentAllocator(region.usable, alignment=4096)
        self.lock = threading.Lock()
        self._seq = itertools.count(1)
        self._held: list[tuple[int, int, int]] = []  # (offset, region_id, seq) of calls in doubt
        self._fence_at = 0.0
        self._users = 0
        self._closing = False
        self._idle = threading.Condition(self.lock)

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """Around a call using the region: :meth:`close` waits for it. Why: a Client closed
        while other threads were in a put or get pulled the arena from under them, and they
        failed with AttributeError or ValueError instead of "this Client is closed"."""
        with self.lock:
            if self._closing:
                raise FailedPrecondition("this Client is closed")
            self._users += 1
        try:
            yield
        finally:
            with self.lock:
                self._users -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        """Refuse new calls and wait until the running ones have ended; False on timeout."""
        with self.lock:
            self._closing = True
            return self._idle.wait_for(lambda: not self._users, timeout)

    def next_seq(self) -> int:
        """A number for the next call on this region, unique in this client."""
        return next(self._seq)

    def hold(self, offset: int, region_id: int, seq: int) -> None:
        with self.lock:
            self._held.append((offset, region_id, seq))

    @property
    def held(self) -> int:
        return len(self._held)

    def settle_held(self, fence: Callable[[int, int], bool]) -> None:
        """Give back the held slots whose call ``fence(region_id, seq)`` says is over (at
        most one attempt each :data:`FENCE_RETRY_S`)."""
        with self.lock:
            if not self._held or time.monotonic() < self._fence_at:
                return
            self._fence_at = time.monotonic() + self.FENCE_RETRY_S
            held, self._held = self._held, []
        kept = []
        for entry in held:
            offset, region_id, seq = entry
            if region_id == self.region_id and not fence(region_id, seq):
                kept.append(entry)  # NOTE: a call on a region id of before is over: that
            else:  # server process is gone (the region was registered again)
                self.release(offset)
        if kept:
            with self.lock:
                self._held.extend(kept)

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


def _block_count(n: object) -> int:
    """``n`` as a count of blocks, or InvalidArgument before anything is reserved. Why: -1 gave
    a tensor over the whole rest of the region (other callers' slots, overwritten through it),
    and 1.5 left a float offset in the allocator, which broke every later call of the client."""
    if isinstance(n, bool):
        raise InvalidArgument(f"n must be a number of blocks, got {n!r}")
    try:
        count = operator.index(n)
    except TypeError:
        raise InvalidArgument(f"n must be a whole number of blocks, got {type(n).__name__} {n!r}") from None
    if count < 0:
        raise InvalidArgument(f"n must be a non-negative number of blocks, got {count}")
    return count


class LocalBlocks:
    """Blocks allocated in the client's shared region; ``tensor`` is the view to fill or read.
    Call :meth:`free` (or use as a context manager) to give the slots back."""

    def __init__(self, plane: LocalPlane, spec: ModelSpec, n: int) -> None:
        self._plane = plane
        n = _block_count(n)
        nbytes = spec.block_nbytes * n
        off = plane.reserve(nbytes) if n else 0  # NOTE: no blocks, no slots (offset -1: nothing to free)
        if off is None:
            raise InvalidArgument(f"{nbytes} bytes do not fit in the free part of the shared region")
        self.offset = off if n else -1
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
