"""Accounting of the remote tier: the blocks this server wrote, their bytes per tenant.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's lock (every structure here is
under it), client, config, clocks, capacity, counters, ``redis_key``, ``_call``/``_batch`` of
:mod:`tiers.remote_calls`, ``_px`` of :mod:`tiers.remote_put` and the writer's
``_queued_held`` (a block written or forgotten while a demotion of it is queued counts once);
``_init_accounting`` makes its state.

* ``usage`` / ``tenant_bytes`` — raw block bytes this server wrote, accounted locally: the
  server's own eviction shows up as misses, and the accounting forgets those blocks then; a
  block past its (capped) deadline is forgotten at the next ask.
* ``holds(ref, deadline)`` — whether this server's copy of a block is in Redis as far as it
  knows (written by it, not deleted, expired, purged or found missing since, and written or
  moved for a deadline at least as late): a spill of it would write what is there already.
* ``_verify_held(ref, deadline)`` — one round trip (``PTTL``) that checks what ``holds`` only
  knows: the copy is in Redis and expires no sooner than this server left it (less
  ``copy_verify_margin_s``). Another server's put of the same block (its ``SET ... PX``
  replaces value and expiry), its ``update_ttl``, or Redis' eviction under ``maxmemory`` may have
  shortened or removed it; the background writer then writes the block (see
  :meth:`tiers.remote_writer.DemotionQueue.submit`, ``skip_held``).
* ``_cap_held(tenant, deadline)`` — a tenant's TTL set or lowered: the copies of it this server
  wrote are accounted as living until ``deadline`` at most (``_px`` of :mod:`tiers.remote_put`);
  ``_cap_held_model(fingerprint, deadline)`` the same for a model's TTL (every tenant's copies).
* ``resync`` — forgets every accounted block Redis no longer holds (``EXISTS``, pipelined, under
  the breakers): a write refused for capacity or quota asks the background writer for one, at
  most once every ``accounting_resync_s``, so blocks that vanished unseen (a ``FLUSHALL``, a
  purge by another server) stop counting.

Quotas and capacity are per server: each server counts the blocks it wrote itself (see
``RemoteConfig.capacity_bytes``), so servers sharing one Redis together may hold up to their
number times a tenant's remote quota there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvstore.block import Tier
from tiers.base import BlockRef, TierUsage


class Held(NamedTuple):
    """A block this node wrote: raw bytes, local deadline (capped), model, Redis key, and the
    deadline it was written (or moved) for, before the cap (None: none)."""

    nbytes: int
    deadline: float | None
    fingerprint: bytes
    rkey: bytes
    wanted: float | None


def take_bytes(per_tenant: dict[str, int], tenant: str, nbytes: int) -> None:
    """Take ``nbytes`` off ``tenant``'s count in ``per_tenant`` (a tenant at 0 leaves it)."""
    left = per_tenant.get(tenant, 0) - nbytes
    if left > 0:
        per_tenant[tenant] = left
    else:
        per_tenant.pop(tenant, None)


class Accounting:
    """RemoteTier methods of the accounting (see the module docstring)."""

    def _init_accounting(self) -> None:
        self._held: dict[tuple[str, bytes], Held] = {}
        self._tenant_used: dict[str, int] = {}
        self._used = 0

    def _account(self, ref: BlockRef, deadline: float | None, rkey: bytes,
                 wanted: float | None) -> None:
        with self._lock:
            self._unheld(ref.ident)
            self._held[ref.ident] = Held(ref.nbytes, deadline, ref.spec.fingerprint, rkey, wanted)
            self._used += ref.nbytes
            self._tenant_used[ref.tenant] = self._tenant_used.get(ref.tenant, 0) + ref.nbytes
            self._queued_held(ref.ident, ref.nbytes, True)

    def _unheld(self, ident: tuple[str, bytes]) -> None:
        """Forget one block of the accounting. Caller holds ``_lock``."""
        old = self._held.pop(ident, None)
        if old is not None:
            self._used -= old.nbytes
            take_bytes(self._tenant_used, ident[0], old.nbytes)
            self._queued_held(ident, old.nbytes, False)

    def _unheld_where(self, hit: Callable[[tuple[str, bytes], Held], bool]) -> None:
        """Forget every block for which ``hit(ident, held)``. Caller holds ``_lock``."""
        for ident in [i for i, h in self._held.items() if hit(i, h)]:
            self._unheld(ident)

    def _forget(self, ident: tuple[str, bytes]) -> None:
        with self._lock:
            self._unheld(ident)

    def _held_deadline(self, ident: tuple[str, bytes], deadline: float | None,
                       wanted: float | None) -> None:
        """The (local, capped) deadline of a block this node wrote moved to ``deadline``
        (``wanted`` before the cap)."""
        with self._lock:
            h = self._held.get(ident)
            if h is not None:
                self._held[ident] = h._replace(deadline=deadline, wanted=wanted)

    def _cap_held(self, tenant: str, deadline: float) -> None:
        """``tenant``'s TTL was lowered: no copy of it this node wrote lives past ``deadline``
        (its local deadline, and the one it counts as written for, capped there)."""
        self._cap_held_where(lambda ident, _: ident[0] == tenant, deadline)

    def _cap_held_model(self, fingerprint: bytes, deadline: float) -> None:
        """A model's TTL was lowered: as :meth:`_cap_held`, for the copies of its blocks (every
        tenant's) this node wrote."""
        self._cap_held_where(lambda _, h: h.fingerprint == fingerprint, deadline)

    def _cap_held_where(self, hit: Callable[[tuple[str, bytes], Held], bool], deadline: float) -> None:
        _, local = self._px(deadline)
        with self._lock:
            for ident, h in [(i, h) for i, h in self._held.items() if hit(i, h)]:
                self._held[ident] = h._replace(deadline=local if h.deadline is None else min(h.deadline, local),
                                               wanted=deadline if h.wanted is None else min(h.wanted, deadline))

    def holds(self, ref: BlockRef, deadline: float | None) -> bool:
        """Whether this server's copy of ``ref`` is in Redis as far as it knows: a write of it
        (:meth:`put` or the background writer's) succeeded, and since then it was not deleted,
        purged (its tenant or model, here or by another server through the deletions stream),
        found missing or damaged by a read or a :meth:`resync`, and has not expired; and it was
        written (or its deadline moved) for ``deadline`` (None: no TTL) or later. Whatever
        quantization it was written with: a copy all the same. Redis' own eviction of it is
        not seen until a read misses it."""
        now = self._clock()
        with self._lock:
            h = self._held.get(ref.ident)
        return (h is not None and h.fingerprint == ref.spec.fingerprint
                and (h.deadline is None or now < h.deadline)
                and (h.wanted is None or (deadline is not None and h.wanted >= deadline)))

    def _verify_held(self, ref: BlockRef, deadline: float | None) -> bool:
        """Whether Redis confirms :meth:`holds` (call it once that is true, with the same
        ``deadline``: a block not accounted is False, uncounted): ``ref``'s key exists and its
        expiry (``PTTL``, one command under the breaker) covers the sooner of ``deadline`` and
        the (capped) deadline this server wrote or moved it for, less ``copy_verify_margin_s``
        (none of either: the key has no expiry). Counted ``copy_verified``, else
        ``copy_not_verified``; a copy found missing or shortened is forgotten (a write of it
        accounts it again), one not reached (a fault) stays accounted.

        NOTE: ``holds`` knows only this server's own last write: another server's ``SET`` of the
        same key (a put with a shorter TTL), or Redis' eviction, left it true while the copy went
        or was about to (a block evicted here on its word was lost from every tier)."""
        now = self._clock()
        with self._lock:
            h = self._held.get(ref.ident)
        if h is None:
            return False
        ends = [d for d in (deadline, h.deadline) if d is not None]
        key = self.redis_key(ref)
        left = self._call(key, lambda: self._client.pttl(key))
        if not isinstance(left, int) or isinstance(left, bool):  # a fault, or the breaker open
            self._count("copy_not_verified")
            return False
        if not ends:
            there = left == -1
        else:
            need_ms = (min(ends) - now - self.config.copy_verify_margin_s) * 1000
            there = left == -1 or (left >= 0 and left >= need_ms)
        if there:
            self._count("copy_verified")
            return True
        self._count("copy_not_verified")
        with self._lock:
            if self._held.get(ref.ident) is h:  # not written again meanwhile
                self._unheld(ref.ident)
        return False

    def _held_bytes_but(self, ref: BlockRef) -> int:
        """Bytes of ``ref``'s tenant this node holds, less those of ``ref``'s own copy (a write
        of it replaces them). Caller holds ``_lock``."""
        held = self._tenant_used.get(ref.tenant, 0)
        if ref.ident in self._held:  # written over: its old bytes go
            held -= self._held[ref.ident].nbytes
        return held

    def _prune_expired(self) -> None:
        now = self._clock()
        with self._lock:
            self._unheld_where(lambda _, h: h.deadline is not None and now >= h.deadline)

    def usage(self) -> TierUsage:
        self._prune_expired()
        with self._lock:
            return TierUsage(Tier.REMOTE, self._used, self.capacity, len(self._held))

    def tenant_bytes(self, tenant: str) -> int:
        """Raw bytes of ``tenant``'s blocks this node wrote that have not expired or gone."""
        self._prune_expired()
        with self._lock:
            return self._tenant_used.get(tenant, 0)

    def tenants_bytes(self) -> dict[str, int]:
        """:meth:`tenant_bytes` of every tenant that has any."""
        self._prune_expired()
        with self._lock:
            return {t: n for t, n in self._tenant_used.items() if n}

    def can_fit(self, nbytes: int) -> bool:
        with self._lock:
            return self._used + nbytes <= self.capacity

    def charge(self, nbytes: int) -> int:
        return nbytes

    def resync(self) -> int:
        """Forget every block this node accounted that Redis no longer holds (``EXISTS``,
        pipelined, under the breakers; a block not reached stays counted); returns how many."""
        with self._lock:
            snap = list(self._held.items())
        gone = 0
        for i in range(0, len(snap), 1024):
            part = snap[i:i + 1024]
            replies = self._batch("EXISTS", [h.rkey for _, h in part])
            with self._lock:
                for (ident, h), r in zip(part, replies):
                    if r == 0 and self._held.get(ident) is h:  # not written again meanwhile
                        self._unheld(ident)
                        gone += 1
        self._count("resyncs")
        self._count("resync_forgotten", gone)
        return gone


__all__ = ["Accounting", "Held", "take_bytes"]
