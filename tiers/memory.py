"""Memory tiers: HBM (device block pool) and DRAM (host slab pool).

Both are one preallocated flat uint8 arena with an :class:`~tiers.arena.ExtentAllocator`
handing out contiguous slots; a block's bytes live at ``arena[offset : offset + nbytes]``.

* HBM: the arena is on the accelerator (``cuda``) when there is one, a CPU tensor otherwise —
  the same code path.
* DRAM: a host arena, page-locked (pinned) when CUDA is present so device copies are async DMA.

Read leases (:meth:`MemoryTier.lease` / :meth:`MemoryTier.unlease`) let a reader outside the
owner's lock read a block's bytes in place (a host arena only): while a slot is leased its memory
is never reused. Deleting a leased block removes it from the tier at once (it is no longer here)
but frees its slot only at the last unlease, so a block moved or deleted meanwhile cannot change
the bytes under the reader.

Not thread-safe by itself: the Store is the one owner and serialises calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kernels.copy import PAGE_BYTES, copy_bytes, host_copy
from kvstore.block import Tier
from kvstore.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.sizes import format_size
from tiers.arena import ExtentAllocator
from tiers.base import BlockRef, TierUsage


class MemoryTier:
    def __init__(self, tier: Tier, capacity: int, device: str | torch.device = "cpu",
                 pin: bool = False, alignment: int = 256) -> None:
        self.tier = tier
        self.device = torch.device(device)
        self._alloc = ExtentAllocator(capacity, alignment)
        self.capacity = self._alloc.capacity
        self.pinned = bool(pin and self.device.type == "cpu" and torch.cuda.is_available())
        try:
            self._arena = _arena(self.capacity, self.device, self.pinned)
        except (MemoryError, RuntimeError) as exc:  # torch's OutOfMemoryError is a RuntimeError
            why = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ResourceExhausted(
                f"cannot allocate the {tier.label} tier: {tier.label}_bytes = {self.capacity} "
                f"({format_size(self.capacity)}) on {self.device} failed ({why}); "
                f"lower {tier.label}_bytes", resource=tier.label) from None
        #: the arena as numpy when it is host memory: slicing and copying a numpy view costs
        #: a fraction of a microsecond where a torch slice costs several (per-put overhead).
        self._host: np.ndarray | None = self._arena.numpy() if self.device.type == "cpu" else None
        self._slots: dict[tuple[str, bytes], tuple[int, int]] = {}  # ident -> (offset, nbytes)
        self._leases: dict[int, int] = {}  # offset -> read leases held on that slot
        self._orphans: set[int] = set()  # leased slots whose block was deleted: freed at the last unlease
        self._pending: dict[int, int] = {}  # offset -> bytes of a slot reserved for a block not adopted yet

    # -- allocation (the prepare half of a move) ----------------------------------------------
    def reserve(self, ref: BlockRef) -> bool:
        """Allocate a slot for ``ref``; False when no free extent is large enough."""
        assert ref.ident not in self._slots, "reserve of a block the tier already holds"
        off = self._alloc.alloc(ref.nbytes)
        if off is None:
            return False
        self._slots[ref.ident] = (off, ref.nbytes)
        return True

    def view(self, ref: BlockRef) -> torch.Tensor:
        """The block's bytes inside the arena (a view; valid until the block is deleted)."""
        off, n = self._slots[ref.ident]
        return self._arena[off : off + n]

    def buffer(self, ref: BlockRef) -> np.ndarray | torch.Tensor:
        """Like :meth:`view`, as numpy when the arena is host memory (slicing a tensor costs
        microseconds per block; numpy, a fraction of one)."""
        off, n = self._slots[ref.ident]
        return self._host[off : off + n] if self._host is not None else self._arena[off : off + n]

    def host_bytes(self, ref: BlockRef) -> np.ndarray:
        """The block's bytes as host numpy: :meth:`buffer` itself for a host arena, else a copy
        off the device."""
        buf = self.buffer(ref)
        return buf if isinstance(buf, np.ndarray) else buf.cpu().numpy()

    # -- read leases (readers outside the owner's lock) -----------------------------------------
    def lease(self, ref: BlockRef) -> tuple[int, np.ndarray] | None:
        """A read-only host view of the block's bytes and the lease's token (for :meth:`unlease`);
        None when the block is not here or the arena is not host memory (copy it out instead).
        Until the lease ends, the slot's memory is never reused, whatever happens to the block."""
        slot = self._slots.get(ref.ident)
        if slot is None or self._host is None:
            return None
        off, n = slot
        self._leases[off] = self._leases.get(off, 0) + 1
        view = self._host[off : off + n]
        view.flags.writeable = False
        return off, view

    def unlease(self, token: int) -> None:
        """End one lease taken by :meth:`lease`; the last one frees a slot deleted meanwhile."""
        left = self._leases[token] - 1  # KeyError on an unlease without a lease: a bug, let it surface
        if left:
            self._leases[token] = left
            return
        del self._leases[token]
        if token in self._orphans:
            self._orphans.discard(token)
            self._alloc.free(token)

    # -- pending slots (two-phase writes whose bytes arrive later) ----------------------------
    def reserve_pending(self, nbytes: int) -> int | None:
        """Allocate a slot owned by no block yet (its bytes are written later, e.g. as they
        arrive over the network): its offset, or None when no free extent is large enough.
        The slot counts as used. Finish with :meth:`adopt` or :meth:`release_pending`."""
        offset = self._alloc.alloc(nbytes)
        if offset is not None:
            self._pending[offset] = self._alloc.rounded(nbytes)
        return offset

    @property
    def pending_bytes(self) -> int:
        """Bytes of the slots reserved and not adopted yet: used, held by no block, and no
        eviction can free them (a put stream's, until its bytes have arrived)."""
        return sum(self._pending.values())

    def pending_view(self, offset: int, nbytes: int) -> Any:
        """A writable view of a pending slot: numpy for a host arena, else a device tensor."""
        view = self._arena[offset : offset + nbytes]
        return view.numpy() if view.device.type == "cpu" else view

    def adopt(self, offset: int, ref: BlockRef) -> None:
        """Make a pending slot (already holding the bytes) the slot of ``ref``: no copy."""
        assert ref.ident not in self._slots, "adopt of a block the tier already holds"
        self._pending.pop(offset, None)
        self._slots[ref.ident] = (offset, ref.nbytes)

    def release_pending(self, offset: int) -> None:
        """Free a pending slot that no block adopted."""
        self._pending.pop(offset, None)
        self._alloc.free(offset)

    # -- TierBackend --------------------------------------------------------------------------
    def put(self, ref: BlockRef, data: Any) -> bool:
        if not self.reserve(ref):
            return False
        off, n = self._slots[ref.ident]
        if (self._host is not None and type(data) is np.ndarray and data.dtype == np.uint8
                and data.shape == (n,)):
            host_copy(self._host[off : off + n], data)  # the common case: one memcpy
        else:
            try:
                copy_bytes(self._arena[off : off + n], data)
            except BaseException:
                self.delete(ref)
                raise
        return True

    def get_into(self, ref: BlockRef, out: Any) -> bool:
        slot = self._slots.get(ref.ident)
        if slot is None:
            return False
        off, n = slot
        if (self._host is not None and type(out) is np.ndarray and out.dtype == np.uint8
                and out.shape == (n,)):
            host_copy(out, self._host[off : off + n])  # the common case: one memcpy, no tensor view
        else:
            copy_bytes(out, self._arena[off : off + n])
        return True

    def delete(self, ref: BlockRef) -> bool:
        slot = self._slots.pop(ref.ident, None)
        if slot is None:
            return False
        if slot[0] in self._leases:
            self._orphans.add(slot[0])  # NOTE: a reader holds it: freed at its last unlease
        else:
            self._alloc.free(slot[0])
        return True

    def contains(self, ref: BlockRef) -> bool:
        return ref.ident in self._slots

    def can_fit(self, nbytes: int) -> bool:
        return self._alloc.can_fit(nbytes)

    def charge(self, nbytes: int) -> int:
        """Bytes a block of ``nbytes`` occupies here (after slot alignment)."""
        return self._alloc.rounded(nbytes) if self.capacity else nbytes

    @property
    def used_bytes(self) -> int:
        return self._alloc.used

    def usage(self) -> TierUsage:
        return TierUsage(self.tier, self._alloc.used, self.capacity, len(self._slots))

    def close(self) -> None:
        """Drop every block; views still leased keep the old arena's memory alive."""
        self._slots.clear()
        self._leases.clear()
        self._orphans.clear()
        self._pending.clear()
        self._arena = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._host = None


#: where a host arena starts within a page. Block buffers elsewhere start at a page (shared
#: memory, mmap), 16 bytes past one (numpy, glibc's mmap'd chunks) or 64 (torch); halfway
#: keeps every copy between them and a slot out of the streaming-copy window of
#: ``kernels.copy.host_copy`` in both directions (slot sizes are whole pages).
HOST_ARENA_PAGE_OFFSET = 2048


def _arena(capacity: int, device: torch.device, pinned: bool) -> torch.Tensor:
    """The flat uint8 arena. Neither allocation touches the pages: untouched capacity costs no
    RSS. NOTE: an unpinned host arena comes from numpy, which asks the kernel for transparent
    huge pages on large allocations (torch.empty does not): fewer TLB misses per memcpy."""
    if device.type != "cpu":
        return torch.empty(capacity, dtype=torch.uint8, device=device)
    pad = PAGE_BYTES  # the start below moves at most PAGE_BYTES - 1 into it
    if pinned:
        raw = torch.empty(capacity + pad, dtype=torch.uint8, pin_memory=True)
    else:
        raw = torch.from_numpy(np.empty(capacity + pad, dtype=np.uint8))
    start = (HOST_ARENA_PAGE_OFFSET - raw.data_ptr()) % PAGE_BYTES
    return raw[start : start + capacity]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def usable_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device: InvalidArgument for a name torch does not know,
    FailedPrecondition for a CUDA device this build or machine does not have (torch itself
    raises a bare AssertionError or RuntimeError at the first allocation)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(f"unknown device {device!r}: {exc}") from None
    if dev.type == "meta":
        raise InvalidArgument("the meta device holds no data: name a real device (cpu, cuda:N)")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not n:
            raise FailedPrecondition(f"device {str(dev)!r} asked for, but this torch "
                                     f"({torch.__version__}) sees no CUDA device")
        if dev.index is not None and dev.index >= n:
            raise FailedPrecondition(f"device {str(dev)!r} asked for, but there are {n} CUDA devices")
    return dev


def holding_data(t: torch.Tensor, what: str, *, writable: bool = False) -> torch.Tensor:
    """``t``, or InvalidArgument when it has no memory to read or write: a tensor on the meta
    device (shapes only, e.g. a model built before its weights are loaded). torch refuses it
    only deep inside a copy, with NotImplementedError, or copies nothing out of it.

    A lazily negated or conjugated view (``torch._neg_view``, ``.conj()`` of a complex tensor)
    does not hold its values in its memory: read from, it comes back resolved (a copy); to be
    written (``writable``) it is refused, as a write to its bytes would not be what it shows."""
    if t.device.type == "meta":
        raise InvalidArgument(f"{what} is on the meta device: it holds no data")
    if t.is_neg() or t.is_conj():
        if writable:
            # NOTE: raised torch's RuntimeError from a byte view deep in the copy
            raise InvalidArgument(f"{what} is a lazily negated/conjugated view: its memory does "
                                  f"not hold its values; pass a plain tensor (e.g. .clone())")
        return t.resolve_conj().resolve_neg()
    return t


def hbm_tier(capacity: int, device: str | torch.device | None = None) -> MemoryTier:
    return MemoryTier(Tier.HBM, capacity, device if device is not None else default_device())


def dram_tier(capacity: int) -> MemoryTier:
    return MemoryTier(Tier.DRAM, capacity, "cpu", pin=True)
