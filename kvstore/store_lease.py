"""Read leases of the Store: serve a prefix as views of the tiers' own memory, without a copy.

The in-band gRPC Get builds each frame straight from a block's bytes in its memory tier instead
of copying the prefix into staging buffers first (:meth:`LeasedGets.lease_prefix`). A mixin of
:class:`kvstore.store.Store`, like :mod:`kvstore.store_reserve`: it uses the Store's lock, chain
walk, placement and tiers, and finds and serves exactly what :meth:`Store.get_into` would (the
longest usable prefix of the tenant's chain, promotions and counters included).

While a :class:`ReadLease` is held:

* its blocks in a host memory tier (HBM on a CPU machine, DRAM) are pinned: never evicted or
  demoted, so a reader that is slow (or gone) cannot lose the cache its blocks;
* their slots are never reused: a block deleted, expired, dropped with its tenant or promoted
  meanwhile leaves its tier at once (nobody else finds it there), but its memory is freed only
  when the last lease on it ends (:meth:`tiers.memory.MemoryTier.lease`), so the bytes under the
  reader never change;
* every other block (NVMe and remote values, which must be decoded, and HBM on an accelerator,
  whose memory is a device tensor) was copied into a host buffer the caller provided, as
  ``get_into`` does.

End it with :meth:`ReadLease.release` (idempotent; the lease is also a context manager) in a
``finally``: a lease never released keeps its blocks pinned. The Store's lock is held only to take
and to end the lease, never while the reader reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy as np

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from kvstore.keys import check_keys
from kvstore.spec import ModelSpec
from kvstore.store_reserve import _parent
from tiers.memory import MemoryTier


class ReadLease:
    """The served prefix of a :meth:`LeasedGets.lease_prefix`: ``views[i]`` holds the bytes of
    block i (a flat uint8 array, to be read only: a view of tier memory, or the caller's buffer
    the block was copied into); ``len(views)`` blocks were served. The views are valid until
    :meth:`release`."""

    __slots__ = ("_held", "_released", "_store", "views")

    def __init__(self, store: LeasedGets) -> None:
        self.views: list[np.ndarray] = []
        self._store = store
        self._held: list[tuple[BlockMeta, MemoryTier, int]] = []  # (block, tier, tier's token)
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Unpin the blocks and give their slots back to their tiers (idempotent, thread-safe)."""
        self._store._end_lease(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeasedGets:
    """Store methods of the read lease (see the module docstring)."""

    def lease_prefix(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes],
                     stage: Callable[[int], np.ndarray], *, parent: bytes | None = None,
                     keys_after: int = 0) -> ReadLease:
        """Serve the longest usable prefix of ``keys`` (as :meth:`get_into` does) under a read
        lease: block i's bytes stay where they are when its tier is host memory, else they are
        copied into ``stage(i)`` (a writable flat uint8 host array of ``spec.block_nbytes`` the
        caller owns; it may be asked for blocks past the prefix that end up unused).

        ``keys_after``: keys of the same get after ``keys`` that the caller reads in later
        pieces (the service cuts a long Get at its stream limit; a client reads a long chain
        in pieces): counted as misses too when the prefix ends within ``keys``, so the pieces
        count what one get of them all would.

        Release the returned lease in a ``finally``. Errors surface here, with nothing held."""
        self._check_tenant(tenant)
        keys = check_keys(keys)
        parent0 = _parent(parent)
        keys_after = _check_keys_after(keys_after)
        lease = ReadLease(self)
        plan = None
        outs: dict[int, np.ndarray] = {}
        with self._lock, self._batch():
            self._check_open()
            now = self._clock()
            chain = self._chain(tenant, spec, keys, now, parent0)
            protected = self._place.protected
            idents = self._place.hold_chain(chain)  # the parent's lineage too: see hold_chain
            views = lease.views
            try:
                for m in chain:
                    found = self._place.bring_up(m)
                    if found is None:
                        break
                    view = self._lease_block(lease, m)
                    if view is None:
                        view = _staged(stage, len(views), spec)
                        if not self._place.copy_out(m, view):
                            break
                    self._place.hit(found)
                    self._place.touch(m, now)
                    views.append(view)
                if self._remote_asked(tenant, keys, len(views), chain):

                    def out(i: int) -> np.ndarray:
                        outs[i] = _staged(stage, i, spec)
                        return outs[i]

                    plan = self._remote_plan(tenant, spec, keys, len(views), out, chain, parent0)
            except BaseException:
                self._end_lease(lease)
                raise
            finally:
                protected.difference_update(idents)
            if plan is None:
                self._count_get(len(views), len(keys), keys_after)
                return lease
        # NOTE: the remote continuation is fetched with the lock released, as get's is (a
        # service Get stuck on a hung Redis held every other call); the leased blocks stay
        # pinned meanwhile, and the staged ones are the caller's buffers
        start = len(lease.views)
        try:
            got = self._remote_continue(plan, start, len(keys), "lease", keys_after)
        except BaseException:
            self._end_lease(lease)
            raise
        lease.views += [outs[start + i] for i in range(got)]
        return lease

    def lease_roots(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes],
                    stage: Callable[[int], np.ndarray]) -> tuple[ReadLease, list[bool]]:
        """Serve each of ``keys`` that is stored as an independent root (see
        ``Store.lookup_roots``) under one read lease: ``(lease, present)``, ``present[i]``
        whether key i was served; ``lease.views`` holds the served blocks in key order (one per
        True). Each key is served as :meth:`lease_prefix` of that key alone would, ``stage(i)``
        being key i's staging buffer; every key of the call found here is protected for the
        whole call (as ``Store.get_roots_into``: serving one never evicts another of the call).
        Release the lease in a ``finally``; errors surface here, with nothing held.

        NOTE: each key was one lease_prefix, protecting only itself: promoting the first keys
        of a batch evicted later ones of the same batch off the last tier."""
        self._check_tenant(tenant)
        self._check_spec(spec)
        keys = check_keys(keys)
        lease = ReadLease(self)
        served: dict[int, np.ndarray] = {}
        plans: list[tuple[int, Any]] = []
        try:
            with self._lock, self._batch():
                self._check_open()
                with self._held_roots(tenant, spec, keys) as (metas, now):
                    for i, m in enumerate(metas):
                        if m is None:
                            continue
                        found = self._place.bring_up(m)
                        if found is None:
                            continue
                        view = self._lease_block(lease, m)
                        if view is None:
                            view = _staged(stage, i, spec)
                            if not self._place.copy_out(m, view):
                                continue
                        self._place.hit(found)
                        self._place.touch(m, now)
                        served[i] = view
                plans = self._roots_remote_plans(tenant, spec, keys, metas, lambda i: _staged(stage, i, spec))
                self._count_get(len(served), len(keys) - len(plans))
            # NOTE: the remote keys are fetched with the lock released, as lease_prefix's are
            for i, plan in plans:
                if self._remote_continue(plan, 0, 1, "lease") == 1:
                    served[i] = plan.outs[0]
        except BaseException:
            self._end_lease(lease)
            raise
        lease.views += [served[i] for i in sorted(served)]
        return lease, [i in served for i in range(len(keys))]

    def _lease_block(self, lease: ReadLease, meta: BlockMeta) -> np.ndarray | None:
        """Lease ``meta``'s bytes in place (lock held); None when its tier is not host memory."""
        tier = self._mem.get(meta.tier)
        got = tier.lease(self._place.ref(meta)) if tier is not None else None
        if got is None:
            return None
        token, view = got
        meta.pins += 1
        lease._held.append((meta, tier, token))
        return view

    def _end_lease(self, lease: ReadLease) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            held, lease._held, lease.views = lease._held, [], []
            for meta, tier, token in held:
                meta.pins -= 1  # NOTE: harmless on a block deleted meanwhile (no longer indexed)
                if not self._closed:  # a closed tier dropped its leases (and its slots) already
                    tier.unlease(token)


def _check_keys_after(keys_after: object) -> int:
    """``keys_after`` of :meth:`LeasedGets.lease_prefix`: an int >= 0, else InvalidArgument."""
    if isinstance(keys_after, bool) or not isinstance(keys_after, int) or keys_after < 0:
        raise InvalidArgument(f"keys_after must be an int >= 0, got {keys_after!r}")
    return keys_after


def _staged(stage: Callable[[int], np.ndarray], i: int, spec: ModelSpec) -> np.ndarray:
    buf = stage(i)
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.shape == (spec.block_nbytes,), \
        "stage(i) must return a flat uint8 array of one block"
    return buf
