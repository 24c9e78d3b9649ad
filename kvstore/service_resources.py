"""Bounded resources the service hands out per call; each class has one lock and one job.

* :class:`InflightBudget` — bytes each tenant has buffered in unfinished Put streams
  (``limits.max_inflight_bytes_per_tenant``); past it -> ResourceExhausted naming the limit.
* :class:`RegionTable` — shared-memory regions registered by principals; a region is usable
  only by the principal that registered it. Each region has a :class:`SlotUse`, the calls
  using its slots now, for the client's fence (below).
* :class:`StagingPool` — reusable block-sized buffers for the in-band streams. A fresh large
  buffer per call costs page faults (a first touch runs at ~2 GB/s against ~10 GB/s for a warm
  copy), more than the copy itself; buffers given back are kept up to ``cache_bytes``.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    UnknownRegion,
)
from kvstore.shm_attach import Region, attach_region
from kvstore.shm_sweep import sweep_dead_segments

log = logging.getLogger(__name__)


class InflightBudget:
    """Bytes in flight per tenant, bounded by ``limit``."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            used = self._used.get(tenant, 0)
            if used + nbytes > self._limit:
                raise ResourceExhausted(
                    f"tenant {tenant!r} would have {used + nbytes} bytes in flight, over "
                    f"limits.max_inflight_bytes_per_tenant={self._limit}",
                    resource="limits.max_inflight_bytes_per_tenant",
                )
            self._used[tenant] = used + nbytes

    def give(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            left = self._used.get(tenant, 0) - nbytes
            assert left >= 0, "in-flight accounting went negative"
            if left:
                self._used[tenant] = left
            else:
                self._used.pop(tenant, None)


class SlotUse:
    """The PutLocal/GetLocal calls using one region's slots now, so that a client can learn
    when the server is done with the slots of a call it gave up on.

    Why: a call that ends without an answer from the server (the client's deadline passed, it
    was cancelled, the connection broke) may still be running here. The client used to give
    its slots back at once, and another call reused them while this one still copied: a put
    stored the other call's bytes, a get wrote into the other call's memory (wrong bytes
    served, with no error). Now the client keeps such slots out of use until :meth:`fence`
    says the call has ended or will never start.

    Each call carries the client's sequence number ``seq`` (0: a client that sends none, not
    fenceable). :meth:`fence` waits until the call ``seq`` is not running and marks it, so
    that if it arrives later (still queued here when the client gave up) it is refused before
    it touches a slot."""

    #: fenced sequence numbers kept per region (a fenced call that never arrives leaves its
    #: number here; the oldest are forgotten past this many)
    KEEP_FENCED = 4096

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running: set[int] = set()
        self._fenced: OrderedDict[int, None] = OrderedDict()

    @contextmanager
    def using(self, seq: int) -> Iterator[None]:
        with self._cond:
            if seq in self._fenced:
                del self._fenced[seq]
                raise FailedPrecondition(f"call {seq} on this region was given up by its client (fenced)")
            if seq:
                self._running.add(seq)
        try:
            yield
        finally:
            if seq:
                with self._cond:
                    self._running.discard(seq)
                    self._cond.notify_all()

    def fence(self, seq: int, timeout: float | None) -> bool:
        """True once call ``seq`` is not running and cannot start; False if it still runs
        after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: seq not in self._running, timeout):
                return False
            self._fenced[seq] = None
            while len(self._fenced) > self.KEEP_FENCED:
                self._fenced.popitem(last=False)
            return True


@dataclass(slots=True, eq=False)
class _Entry:
    """A registered region: its principal, the calls using it, when it was last used."""

    owner: str
    region: Region
    use: SlotUse
    last_used: float
    active: int = 0  # calls using its slots now
    dropped: bool = False  # out of the table while a call used it: its last call closes it


class RegionTable:
    """Shared-memory regions registered by principals (at most ``max_per_principal`` each).

    A region is closed only once no call uses it (dropped meanwhile: by the call that ends
    last), so that no copy runs on a closed file or mapping. Regions of clients that are gone
    are dropped (:meth:`prune`) and their ``/dev/shm`` segments unlinked when their creator is
    known to be gone; at the limit, the principal's least recently used region that no call
    uses and that has been idle for ``idle_evict_s`` seconds makes room for a new one (a live
    client registers it again at its next call). See :mod:`kvstore.shm_sweep` for the rules."""

    #: seconds between two sweeps of ``/dev/shm`` for segments of clients that are gone
    SWEEP_EVERY_S = 60.0

    def __init__(self, max_per_principal: int, max_bytes: int, *, idle_evict_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max_per, self._max_bytes = max_per_principal, max_bytes
        self.idle_evict_s = idle_evict_s
        self._clock = clock
        self._regions: dict[int, _Entry] = {}
        self._registering: dict[str, int] = {}  # registrations under way, per principal
        self._lock = threading.Lock()
        self._swept_at: float | None = None

    def register(self, owner: str, kind: str, name: str, size: int, handle: bytes = b"",
                 nonce: bytes = b"") -> tuple[int, Region]:
        """Map and register a client's region. ``nonce``: what the client read at the head of its
        region (:attr:`kvstore.shm.ShmRegion.nonce`); a region whose head holds anything else is
        refused (a caller that only knows the name cannot know it), and so is an empty or
        all-zero nonce, and a region another principal registered (even with the right nonce:
        a caller of the same uid can read it). What :func:`~kvstore.shm_attach.attach_region` maps
        at all: see :mod:`kvstore.shm_checks`."""
        if self._max_per == 0:
            # FAILED_PRECONDITION: a client that chose shared memory itself goes on with streams
            raise FailedPrecondition("the local data plane is disabled on this server (local_data_plane = "
                                     "false, or limits.max_regions_per_principal = 0): use the in-band "
                                     "streams (Client(local=False))")
        if size <= 0 or size > self._max_bytes:
            raise InvalidArgument(f"region size {size} must be in (0, limits.max_region_bytes={self._max_bytes}]")
        self.prune(owner)  # regions of this principal's clients that are gone
        evicted = None
        with self._lock:
            # NOTE: registrations under way count too: checked here and inserted after the
            # region is mapped, concurrent registrations all passed the check (5 of limit 2)
            mine = [(rid, e) for rid, e in self._regions.items() if e.owner == owner]
            if len(mine) + self._registering.get(owner, 0) >= self._max_per:
                evicted = self._evict_idle(mine)
                if evicted is None:
                    raise ResourceExhausted(
                        f"{owner!r} has limits.max_regions_per_principal={self._max_per} regions, none of "
                        f"them idle for {self.idle_evict_s:g} s",
                        resource="limits.max_regions_per_principal",
                    )
            self._check_not_taken(owner, name)
            self._registering[owner] = self._registering.get(owner, 0) + 1
        if evicted is not None:
            evicted.region.close()
        try:
            region = attach_region(kind, name, size, handle)
            try:
                if not any(nonce):  # NOTE: a zeroed head is common in foreign segments
                    raise PermissionDenied("an empty or all-zero nonce proves nothing: send the nonce at the "
                                           "head of the region this client created")
                if not hmac.compare_digest(getattr(region, "nonce", b""), nonce):
                    raise PermissionDenied("the region does not hold the nonce given: register a region "
                                           "this client created")
                with self._lock:
                    # NOTE: again, now under the lock that inserts: two principals registering
                    # the same name at once both passed the first check (and the same file may
                    # go by two names: a memfd in two processes)
                    self._check_not_taken(owner, name, getattr(region, "ident", None))
                    # NOTE: random, never a counter: ids restarting at 1 with the server gave a
                    # client that registered before a restart the id of another client's region
                    # registered after it (same principal): its puts read that region, its gets
                    # wrote into it. A stale id must be unknown (UnknownRegion), so the client
                    # registers again.
                    rid = secrets.randbits(63) or 1
                    while rid in self._regions:
                        rid = secrets.randbits(63) or 1
                    self._regions[rid] = _Entry(owner, region, SlotUse(), self._clock())
            except BaseException:
                region.close()
                raise
        finally:
            with self._lock:
                left = self._registering[owner] - 1
                if left:
                    self._registering[owner] = left
                else:
                    del self._registering[owner]
        return rid, region

    def _evict_idle(self, mine: list[tuple[int, _Entry]]) -> _Entry | None:
        """Take out of the table the least recently used of ``mine`` that no call uses and that
        has been idle for :attr:`idle_evict_s`; None when there is none. Caller holds the lock
        (and closes the entry's region after it let go of it)."""
        now = self._clock()
        idle = [(e.last_used, rid) for rid, e in mine if not e.active and now - e.last_used >= self.idle_evict_s]
        if not idle:
            return None
        _, rid = min(idle)
        entry = self._regions.pop(rid)
        entry.dropped = True
        log.info("region %s of %r idle for %.0f s: dropped to make room for a new one (its client registers "
                 "it again if it is still there)", getattr(entry.region, "name", rid), entry.owner,
                 now - entry.last_used)
        return entry

    def _check_not_taken(self, owner: str, name: str, ident: object = None) -> None:
        """PermissionDenied when another principal registered the region ``name`` (or the file
        ``ident``), not saying which. Caller holds the lock."""
        for e in self._regions.values():
            if e.owner != owner and (e.region.name == name
                                     or (ident is not None and getattr(e.region, "ident", None) == ident)):
                raise PermissionDenied("that region is registered by another principal: register the region "
                                       "this client created")

    def _entry(self, owner: str, region_id: int) -> _Entry:
        entry = self._regions.get(region_id)
        if entry is None or entry.owner != owner:
            raise UnknownRegion(f"{UnknownRegion.PREFIX} {region_id}: not registered by this caller "
                                "(a server restart forgets every region, and an idle one may be dropped "
                                "to make room: register it again)")
        return entry

    def get(self, owner: str, region_id: int) -> Region:
        return self._entry(owner, region_id).region

    @contextmanager
    def using(self, owner: str, region_id: int, seq: int) -> Iterator[Region]:
        """The caller's region, for the duration of one call ``seq`` using its slots (it stays
        open until the call ends, even if it is dropped meanwhile)."""
        with self._lock:
            entry = self._entry(owner, region_id)
            entry.active += 1
            entry.last_used = self._clock()
        try:
            with entry.use.using(seq):
                yield entry.region
        finally:
            with self._lock:
                entry.active -= 1
                entry.last_used = self._clock()
                close = entry.dropped and not entry.active
            if close:
                entry.region.close()

    def fence(self, owner: str, region_id: int, seq: int, timeout: float | None) -> bool:
        """:meth:`SlotUse.fence` of the caller's region (UnknownRegion for a region this
        server does not know: a restarted server runs none of the calls of before)."""
        with self._lock:
            use = self._entry(owner, region_id).use
        return use.fence(seq, timeout)

    def unregister(self, owner: str, region_id: int) -> None:
        with self._lock:
            self._entry(owner, region_id)
            entry = self._regions.pop(region_id)
        self._close([entry])

    def prune(self, owner: str | None = None) -> int:
        """Drop the regions (of ``owner``, or everyone's) whose client is gone: closed without
        unregistering, or dead (``Region.alive``); a ``/dev/shm`` segment whose creator is known
        to be gone is unlinked too. Without this, a client that crashed kept its region here,
        and one that crashed ``max_regions_per_principal`` times locked its principal out of
        the local data plane until the server restarted. Everyone's (the server's periodic
        sweep) also sweeps ``/dev/shm`` at most every :data:`SWEEP_EVERY_S`. The number dropped."""
        if owner is None:
            now = self._clock()
            if self._swept_at is None or now - self._swept_at >= self.SWEEP_EVERY_S:
                self.sweep()
        return self._drop(lambda o, r: (owner is None or o == owner) and not r.alive(), unlink=True)

    def sweep(self) -> list[str]:
        """Unlink the ``/dev/shm`` segments of clients known to be gone, registered or not
        (:func:`kvstore.shm_sweep.sweep_dead_segments`; the server runs it at start)."""
        self._swept_at = self._clock()
        swept = sweep_dead_segments()
        if swept:
            log.info("unlinked %d shared-memory segments of clients that are gone: %s", len(swept),
                     ", ".join(swept[:8]) + (" ..." if len(swept) > 8 else ""))
        return swept

    def drop_owner(self, owner: str) -> int:
        """Forget every region of ``owner`` (a deleted principal); the number dropped."""
        return self._drop(lambda o, _: o == owner)

    def _drop(self, doomed: Callable[[str, Region], bool], unlink: bool = False) -> int:
        with self._lock:
            entries = list(self._regions.items())
        ids = [rid for rid, e in entries if doomed(e.owner, e.region)]  # NOTE: alive() outside the lock
        with self._lock:
            dropped = [e for rid in ids if (e := self._regions.pop(rid, None)) is not None]
        for e in dropped:
            if unlink:
                gone = getattr(e.region, "unlink_if_gone", None)
                if gone is not None and gone():
                    log.info("unlinked shared-memory region %s of %r: its client is gone", e.region.name, e.owner)
        self._close(dropped)
        return len(dropped)

    def _close(self, entries: list[_Entry]) -> None:
        """Close the regions of ``entries`` (out of the table) now, or as their last call ends."""
        now = []
        with self._lock:
            for e in entries:
                e.dropped = True
                if not e.active:
                    now.append(e)
        for e in now:
            e.region.close()

    def close(self) -> None:
        with self._lock:
            entries, self._regions = list(self._regions.values()), {}
        self._close(entries)


class StagingPool:
    """Reusable uint8 buffers, handed out by exact size and kept up to ``cache_bytes`` in all.

    ``take(nbytes)`` returns a buffer nobody else holds (contents undefined); ``give(buf)``
    returns it; the caller must not touch it afterwards."""

    def __init__(self, cache_bytes: int) -> None:
        self._cap = cache_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._cached = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            stack = self._free.get(nbytes)
            if stack:
                self._cached -= nbytes
                return stack.pop()
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        n = buf.nbytes
        if n > self._cap:
            return
        with self._lock:
            # make room by dropping buffers of other sizes (block sizes change with the model)
            for size in [s for s in self._free if s != n]:
                while self._cached + n > self._cap and self._free[size]:
                    self._free[size].pop()
                    self._cached -= size
            if self._cached + n <= self._cap:
                self._free.setdefault(n, []).append(buf)
                self._cached += n

    @property
    def cached_bytes(self) -> int:
        return self._cached
