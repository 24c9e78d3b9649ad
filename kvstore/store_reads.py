"""The read path of the Store: find the longest usable prefix of a chain, and serve its bytes.

A mixin of :class:`kvstore.store.Store`, like :mod:`kvstore.store_reserve`: it uses the Store's
lock, clock, index, placement, tiers, remote tier, device and counters, its helpers
(``_check_tenant``, ``_check_open``, ``_batch``, ``_ttl_deadline``, ``_register_spec``) and
``_expire_due`` of :mod:`kvstore.store_admin`.

* ``lookup`` answers the longest usable prefix and the tier of each block by bisection over the
  chain (:meth:`ReadPath._usable_len`), continuing into the remote tier where the local chain ends
  (a chain continuing from a ``parent`` held neither here nor remotely has no remote part: as get).
* ``lookup_roots`` and ``get_roots_into`` do the same for keys that are independent roots (each
  a one-block prefix: parent ROOT_KEY, depth 0), answering and serving each key on its own,
  exactly as a call per key would (the remote tier is asked about the keys absent here in one
  pipelined batch; a get serves each key as a get of that key alone).
* The remote tier is asked only about keys absent here (a key held here, unusable, is no other
  block there), and a remote copy is served, counted and promoted only when it records the
  parent the caller's chain or roots imply (:mod:`tiers.remote_envelope`): a copy of a chain's
  link is no root, and a copy that records no parent (written before it was recorded) is a
  miss.
* ``get`` and ``get_into`` walk the chain link by link (:meth:`ReadPath._chain`, which the
  sessions and read leases use too), serve each block from its tier (promoting it), then serve
  the rest from the remote tier and promote what came back (:meth:`ReadPath._remote_plan`,
  :meth:`ReadPath._remote_fetch`, :meth:`ReadPath._remote_promote`; the read lease of
  :mod:`kvstore.store_lease` uses the same three steps).

Remote I/O runs without the Store's lock (a Redis that hangs must not stall every other call:
a local HBM get of another tenant waited out the remote timeouts): ``lookup`` asks the remote
tier after it let go of the lock; ``get`` serves the local prefix under the lock, fetches the
continuation into the caller's buffers without it, and takes it again to promote what came back,
checking again what it saw before (:meth:`ReadPath._remote_promote`). A get racing a delete,
drop_tenant or purge_model may return the blocks or not (each block served is exactly the bytes
put under its key, read while it existed), but never promotes them after the removal.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kernels.copy import copy_bytes
from kvstore.block import BlockMeta, Tier
from kvstore.block_buffers import block_views
from kvstore.errors import InvalidArgument, NVMeWriteFailed, ResourceExhausted, ShapeMismatch
from kvstore.index import Ident
from kvstore.keys import ROOT_KEY, PackedKeys, check_keys
from kvstore.spec import ModelSpec
from kvstore.store_reserve import _parent
from tiers.base import BlockRef
from tiers.memory import holding_data, usable_device
from tiers.remote import RemoteInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest usable prefix: ``num_blocks`` blocks, ``tiers[i]`` the tier name of block i."""

    num_blocks: int
    tiers: list[str]


_LABELS = tuple(t.label for t in Tier)


class ReadPath:
    """Store methods of lookup and get (see the module docstring)."""

    def _chain(self, tenant: str, spec: ModelSpec, keys: list[bytes], now: float,
               parent: bytes = ROOT_KEY) -> list[BlockMeta]:
        """The usable prefix of ``keys`` (a chain continuing from ``parent``). Caller holds the
        lock. Blocks past their deadline are dropped first (with their subtrees), and a chain
        continuing from a ``parent`` that is not usable here (absent, expired, in flight, of
        another model) has no usable prefix: a block is only useful with all its ancestors."""
        out: list[BlockMeta] = []
        found = out.append
        self._expire_due(now)
        get = self._index.tenant_blocks(tenant).get
        fp = spec.fingerprint
        if parent != ROOT_KEY:
            pm = get(parent)
            if pm is None or pm.in_flight or pm.fingerprint != fp:
                return out
        prev = parent
        # NOTE: one tight loop that creates nothing per key: a 128K-token prompt is 8,192 keys
        # (no deadline check per key: _expire_due above dropped every block due, as lookup's
        # probes rely on too)
        for key in keys:
            m = get(key)
            if m is None or m.in_flight or m.fingerprint != fp or m.parent != prev:
                break
            found(m)
            prev = key
        return out

    def lookup(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes], *,
               parent: bytes | None = None) -> LookupResult:
        """Longest usable prefix of ``keys`` for ``tenant`` and the tier of each block.
        ``parent``: the key ``keys[0]`` continues from (a chain split across calls).

        The answer costs O(log n) index probes, not a walk: every key is the hash of its parent
        key and its tokens (:func:`kvstore.keys.block_keys`), a block is indexed only under its
        parent, and expired blocks are dropped before the probes, so whether block i is usable
        decides it for every block before it. Each probed block's parent link, depth and
        fingerprint are checked; blocks between probes are taken on the chain's word, so a
        list that is not a key chain (keys spliced from different prompts) may be answered
        longer than it is usable. :meth:`get` checks every link and serves only what is.
        The remote tier is asked with the lock released; a chain continuing from a ``parent``
        this server does not hold continues there only while the remote tier holds the parent.
        """
        self._check_tenant(tenant)
        self._check_spec(spec)
        parent0 = _parent(parent)
        if not isinstance(keys, PackedKeys):
            keys = check_keys(keys)
        with self._lock:
            self._check_open()
            self._expire_due(self._clock())
            blocks = self._index.tenant_blocks(tenant)
            n = self._usable_len(blocks, spec, keys, parent0)
            self.counters.add("lookups")
            # a block is never in a faster tier than its parent: the tiers come in sorted runs
            tier_of = lambda i: blocks[keys[i]].tier
            tiers: list[str] = []
            start = 0
            while start < n:
                tier = tier_of(start)
                end = bisect_right(range(n), tier, lo=start, key=tier_of)
                tiers += [_LABELS[tier]] * (end - start)
                start = end
            remote = self._remote
            # as get: a chain continuing from a parent this server does not hold continues
            # remotely only while the remote tier holds that parent; and only from a key this
            # server does not hold (one it holds, unusable here, is no other block remotely)
            via_parent = not n and parent0 != ROOT_KEY and blocks.get(parent0) is None
            ask = n < len(keys) and keys[n] not in blocks
        if remote is not None and ask:
            # NOTE: outside the lock: a lookup stuck on a hung Redis held every other call
            refs = [BlockRef(tenant, k, spec) for k in keys[n:]]
            parents = _parents(keys, n, parent0)  # each copy must record the parent the chain implies
            if via_parent:
                more = max(0, remote.prefix_len([BlockRef(tenant, parent0, spec), *refs],
                                                parents=[None, *parents]) - 1)
            else:
                more = remote.prefix_len(refs, parents=parents)
            tiers += ["remote"] * more
        return LookupResult(len(tiers), tiers)

    def lookup_roots(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes]) -> list[str | None]:
        """The tier name of each of ``keys`` as an independent root block (see ``Store.put(roots=
        True)``), None where it is not usable: absent, expired, in flight, of another model, or
        stored as a link of a chain (a root is a one-block prefix). What a :meth:`lookup` of
        each key alone answers; the remote tier is asked about the keys absent here, with the
        lock released, in one pipelined batch, and answers those its copies record as roots
        (see :mod:`tiers.remote_envelope`). Counted as one lookup per key."""
        self._check_tenant(tenant)
        self._check_spec(spec)
        keys = keys[:] if isinstance(keys, PackedKeys) else check_keys(keys)
        with self._lock:
            self._check_open()
            tiers = [None if m is None else _LABELS[m.tier] for m in self._roots(tenant, spec, keys, self._clock())]
            self.counters.add("lookups", len(keys))
            remote = self._remote
            held = self._index.tenant_blocks(tenant)
            # NOTE: only keys absent here: one held here (a chain's link, one in flight) was
            # answered "remote" when Redis held a copy, as a root
            missing = [i for i, t in enumerate(tiers) if t is None and keys[i] not in held]
        if remote is not None and missing:
            # NOTE: outside the lock, as lookup asks it; a copy must record no parent (a root)
            found = remote.contains_many([BlockRef(tenant, keys[i], spec) for i in missing],
                                         parents=[ROOT_KEY] * len(missing), strict=True)
            for i, hit in zip(missing, found):
                if hit:
                    tiers[i] = "remote"
        return tiers

    def get_roots_into(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes],
                       outs: Sequence[Any]) -> list[bool]:
        """Copy each of ``keys`` that is stored as an independent root (see :meth:`lookup_roots`)
        into its buffer of ``outs`` (one of ``block_nbytes`` per key); whether each was. Each
        key is served as :meth:`get_into` of that key alone would (promotions, counters); the
        buffer of a miss is left as it was.

        Every key of the call found here is protected for the whole call, as a chain get holds
        its chain: promoting one never evicts (nor drops) another of the same call; a key that
        finds no room above is served from where it is.

        NOTE: each key was served as its own get, protecting only itself: promoting the first
        keys of a batch pushed later ones down until they fell off the last tier, so a batch
        that :meth:`lookup_roots` answered present came back with holes, the keys gone."""
        self._check_spec(spec)
        self._check_tenant(tenant)
        keys = check_keys(keys)
        views = block_views(spec, outs, len(keys), "output buffer", writable=True)
        got = [False] * len(keys)
        plans: list[tuple[int, _RemoteRead]] = []
        try:
            with self._lock, self._batch():
                self._check_open()
                with self._held_roots(tenant, spec, keys) as (metas, now):
                    for i, m in enumerate(metas):
                        if m is not None:
                            got[i] = self._place.serve(m, views[i], now)
                plans = self._roots_remote_plans(tenant, spec, keys, metas, views.__getitem__)
                self._count_get(sum(got), len(keys) - len(plans))
        except NVMeWriteFailed as exc:
            # NOTE: as _get: the blocks served are in the caller's buffers
            if not any(got):
                raise
            log.warning("get of roots served %d blocks, but %s", sum(got), exc)
        for i, plan in plans:  # NOTE: no lock here, as _get
            got[i] = self._remote_continue(plan, 0, 1, "get") == 1
        return got

    def _roots_remote_plans(self, tenant: str, spec: ModelSpec, keys: list[bytes],
                            metas: list[BlockMeta | None], out: Callable[[int], Any]) -> list[tuple[int, _RemoteRead]]:
        """The remote reads of a roots call's keys absent here (lock held; ``out(i)``: key i's
        buffer): one plan per key, whose copy must record that it is a root. A key held here
        but unusable (a chain's link, in flight) is no other block remotely."""
        if self._remote is None:
            return []
        held = self._index.tenant_blocks(tenant)
        return [(i, self._remote_plan(tenant, spec, [keys[i]], 0, lambda _, i=i: out(i), [], ROOT_KEY, roots=True))
                for i, m in enumerate(metas) if m is None and keys[i] not in held]

    def _roots(self, tenant: str, spec: ModelSpec, keys: list[bytes], now: float) -> list[BlockMeta | None]:
        """Each of ``keys``' block when it is usable as an independent root, else None (lock
        held; blocks past their deadline are dropped first)."""
        self._expire_due(now)
        get = self._index.tenant_blocks(tenant).get
        fp = spec.fingerprint
        out: list[BlockMeta | None] = []
        for key in keys:
            m = get(key)
            usable = (m is not None and not m.in_flight and m.fingerprint == fp and m.depth == 0
                      and m.parent == ROOT_KEY)
            out.append(m if usable else None)
        return out

    @contextmanager
    def _held_roots(self, tenant: str, spec: ModelSpec, keys: list[bytes]) -> Iterator[tuple[list[BlockMeta | None], float]]:
        """``(metas, now)``: each of ``keys``' block usable as a root (:meth:`_roots`), every one
        protected while the body runs, as :meth:`Placement.hold_chain` does a chain's (lock held)."""
        now = self._clock()
        metas = self._roots(tenant, spec, keys, now)
        protected = self._place.protected
        idents = list({(m.tenant, m.key) for m in metas
                       if m is not None and (m.tenant, m.key) not in protected})
        protected.update(idents)
        try:
            yield metas, now
        finally:
            protected.difference_update(idents)

    @staticmethod
    def _usable_len(blocks: dict[bytes, BlockMeta], spec: ModelSpec, keys: Sequence[bytes],
                    parent0: bytes) -> int:
        """How many leading ``keys`` are usable, by bisection over "block i is usable" (see
        :meth:`lookup`); expired blocks must have been dropped already."""
        n = len(keys)
        if not n:
            return 0
        if parent0 == ROOT_KEY:
            base = 0
        else:
            pm = blocks.get(parent0)
            if pm is None or pm.in_flight or pm.fingerprint != spec.fingerprint:
                return 0
            base = pm.depth + 1
        fp = spec.fingerprint

        def usable(i: int) -> bool:
            m = blocks.get(keys[i])
            return (m is not None and not m.in_flight and m.fingerprint == fp and m.depth == base + i
                    and m.parent == (keys[i - 1] if i else parent0))

        if usable(n - 1):  # the common answer when the whole prompt is cached: one probe
            return n
        lo, hi = 0, n - 1  # usable(lo - 1) holds (or lo == 0); usable(hi) does not
        while lo < hi:
            mid = (lo + hi) // 2
            if usable(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def get(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes], *,
            device: str | torch.device | None = None, out: torch.Tensor | None = None,
            parent: bytes | None = None) -> torch.Tensor:
        """The blocks of the longest usable prefix of ``keys``: a tensor
        ``[n, 2, L, H, T, D]`` (n ≤ len(keys); n < len(keys) means the rest missed).

        ``out`` (shape ``[len(keys), 2, L, H, T, D]``, the spec's dtype) is filled and a view of
        it returned: reusing it avoids first-touch page faults of a fresh tensor per call."""
        self._check_spec(spec)
        keys = check_keys(keys)
        want = (len(keys), *spec.block_shape)
        if out is None:
            dev = usable_device(device) if device is not None else self.device
            out = torch.empty(want, dtype=spec.torch_dtype, device=dev)
        elif not isinstance(out, torch.Tensor):
            raise InvalidArgument(f"out must be a torch tensor, got {type(out).__name__} (get_into takes buffers)")
        elif out.device.type == "meta" or out.is_neg() or out.is_conj():
            # NOTE: a meta tensor, filled with nothing, was returned as served
            holding_data(out, "out", writable=True)
        elif tuple(out.shape) != want or out.dtype != spec.torch_dtype or not out.is_contiguous():
            raise ShapeMismatch(f"out must be a contiguous {spec.torch_dtype} tensor of shape "
                                f"{want}, got {out.dtype} {tuple(out.shape)}")
        if not keys:
            return out
        flat = out.view(torch.uint8).reshape(len(keys), -1)
        n = self._get(tenant, spec, keys, lambda i: flat[i], _parent(parent))
        return out[:n]

    def get_into(self, tenant: str, spec: ModelSpec, keys: Sequence[bytes],
                 outs: Sequence[Any], *, parent: bytes | None = None) -> int:
        """Copy the longest usable prefix into ``outs`` (one buffer of ``block_nbytes`` per key,
        numpy/memoryview/tensor); returns the number of leading blocks written."""
        self._check_spec(spec)
        keys = check_keys(keys)
        views = block_views(spec, outs, len(keys), "output buffer", writable=True)
        return self._get(tenant, spec, keys, views.__getitem__, _parent(parent))

    def _get(self, tenant: str, spec: ModelSpec, keys: list[bytes],
             out: Callable[[int], Any], parent: bytes) -> int:
        """Serve the local prefix under the lock, then the remote continuation with the lock
        released (the fetch writes only into the caller's buffers), then promote what came back
        under the lock again (:meth:`_remote_promote` re-validates what the first part saw)."""
        self._check_tenant(tenant)
        local: list[tuple[int, _RemoteRead | None]] = []
        try:
            with self._lock, self._batch():
                local.append(self._get_local(tenant, spec, keys, out, parent))
        except NVMeWriteFailed as exc:
            # NOTE: the blocks served are in the caller's buffers; a commit that failed after
            # (blocks pushed down to NVMe to make room for promotions: dropped, counted) does
            # not undo the read
            if not local:
                raise
            log.warning("get served %d blocks, but %s", local[0][0], exc)
        served, plan = local[0]
        if plan is None:
            return served
        # NOTE: no lock here: a get or lookup stuck on a hung Redis held every other call
        # (a local HBM get of another tenant waited out the remote timeouts and retries)
        return served + self._remote_continue(plan, served, len(keys), "get")

    def _count_get(self, served: int, n_keys: int, keys_after: int = 0) -> None:
        """Count a get of ``n_keys`` keys that served its ``served`` leading blocks (lock held).
        ``keys_after``: keys of the same get after these that this call was not given (a long
        chain read in pieces: the service's Get cut at its stream limit, a client's pieces):
        a prefix that ended within these misses them too, so the pieces count what one get of
        every key would; one that ran to their end leaves them to the next piece.

        NOTE: only the piece's own keys were counted: a 40-key Get served in pieces of 8 whose
        prefix ended at 5 counted 3 misses where Store.get counts 35."""
        self.counters.add("hits", served)
        self.counters.add("misses", n_keys - served + (keys_after if served < n_keys else 0))

    def _remote_continue(self, plan: _RemoteRead, served: int, n_keys: int, what: str,
                         keys_after: int = 0) -> int:
        """Fetch ``plan`` with the lock released, then count the read (``served`` local blocks
        of ``n_keys``, ``keys_after`` as :meth:`_count_get` takes it) and promote what came back
        under the lock; the remote blocks served. A store closed under the fetch makes it a
        miss, and promotes nothing."""
        try:
            self._remote_fetch(plan)
        except Exception:
            if not self._closed:
                raise
            plan.n = 0  # the store closed (and the remote tier with it) under the fetch: a miss
        n = served + plan.n
        with self._lock:
            self._count_get(n, n_keys, keys_after)
            self.counters.add("hits_remote", plan.n)
            if self._closed:  # closed meanwhile: what was served stands, nothing is promoted
                return plan.n
            promoted: list[Ident] = []
            try:
                with self._batch():
                    self._remote_promote(plan, promoted)
            except NVMeWriteFailed as exc:
                log.warning("%s served %d blocks, but %s", what, n, exc)
            finally:
                self._place.protected.difference_update(promoted)
        return plan.n

    def _get_local(self, tenant: str, spec: ModelSpec, keys: list[bytes],
                   out: Callable[[int], Any], parent: bytes) -> tuple[int, _RemoteRead | None]:
        """The local part of a get (lock held): the blocks served, and the remote continuation
        to fetch once the lock is released (None when there is none; the counters are then
        counted here, else by the caller once the continuation is done)."""
        self._check_open()
        now = self._clock()
        chain = self._chain(tenant, spec, keys, now, parent)
        served = 0
        idents = self._place.hold_chain(chain)  # the parent's lineage too: see hold_chain
        try:
            for m in chain:
                if not self._place.serve(m, out(served), now):
                    break
                served += 1
        finally:
            self._place.protected.difference_update(idents)
        if self._remote_asked(tenant, keys, served, chain):
            return served, self._remote_plan(tenant, spec, keys, served, out, chain, parent)
        self._count_get(served, len(keys))
        return served, None

    def _remote_asked(self, tenant: str, keys: list[bytes], served: int, chain: list[BlockMeta]) -> bool:
        """Whether a get that served ``served`` blocks of its local prefix ``chain`` goes on
        into the remote tier (lock held): when it served the whole prefix and the next key is
        absent here. NOTE: a key held here but unusable (a link of another chain asked as a
        root, one in flight) was asked remotely, and its copy promoted under the parent the
        caller assumed (a link as a root)."""
        return (self._remote is not None and served == len(chain) < len(keys)
                and self._index.get(tenant, keys[served]) is None)

    def _remote_plan(self, tenant: str, spec: ModelSpec, keys: list[bytes], start: int,
                     out: Callable[[int], Any], chain: list[BlockMeta],
                     parent: bytes, roots: bool = False) -> _RemoteRead:
        """The remote continuation of a get whose local prefix is ``chain`` (lock held);
        ``roots``: of a roots call's key (its copy must record that it is a root)."""
        assert self._remote is not None
        self._register_spec(spec)
        rest = keys[start:]
        outs = [out(start + i) for i in range(len(rest))]
        hosts = [o if isinstance(o, np.ndarray) else
                 (o.numpy() if o.device.type == "cpu" else np.empty(spec.block_nbytes, np.uint8))
                 for o in outs]
        # a chain continuing from a parent this server does not hold is served only while the
        # remote tier holds that parent (a deleted parent takes its descendants with it)
        check = not chain and parent != ROOT_KEY and self._index.get(tenant, parent) is None
        return _RemoteRead(tenant, spec, rest, outs, hosts, chain, parent, check, self._removals, roots=roots)

    def _remote_fetch(self, plan: _RemoteRead) -> None:
        """Fetch ``plan``'s blocks into the caller's buffers (no lock needed: it reads no Store
        state and writes none). Any fault of the remote tier is a miss."""
        remote = self._remote
        assert remote is not None
        tenant, spec = plan.tenant, plan.spec
        if plan.check_parent and not remote.contains_many([BlockRef(tenant, plan.parent, spec)])[0]:
            return
        first = plan.chain[-1].key if plan.chain else plan.parent
        n = remote.get_prefix_into([BlockRef(tenant, k, spec) for k in plan.rest], plan.hosts[:],
                                   info=plan.info, parents=[first, *plan.rest[:-1]], strict=plan.roots)
        for o, h in zip(plan.outs[:n], plan.hosts[:n]):
            if not isinstance(o, np.ndarray) and o.device.type != "cpu":
                copy_bytes(o, h)
        plan.n = n

    def _remote_promote(self, plan: _RemoteRead, guard: list[Ident]) -> None:
        """Promote the fetched blocks into the local tiers (lock held, store open; best effort:
        a block that finds no room is still served). A promoted block keeps the TTL deadline
        and creation time its remote copy was written with (it got the tenant's default TTL,
        and a re-spill the remote cap, before), but no later than now + the tenant's TTL
        (``set_tenant_policy(ttl_s)``) or its model's (``set_model_ttl``), as a put gets (a
        copy written without a deadline, by a server without the policy, came in with none),
        and a copy so capped has its deadline in Redis moved there too (queued); ``guard``
        receives the promoted blocks, which stay protected until the caller lets them go.

        The lock may have been released since the plan was made, so what it saw is checked
        again: nothing is promoted when a delete, drop_tenant or purge_model ran meanwhile (it
        may have removed these very blocks, remote copies included: promoting them would bring
        them back), nor under a parent that is no longer usable here (evicted, deleted,
        expired, in flight); promotion stops at a block a concurrent put or get stored first.
        The bytes fetched are still served: a get racing a delete returns either result, and
        each block was read, authenticated under its key, while it existed."""
        n = plan.n
        if not n or self._removals != plan.removals:
            return
        tenant, spec, rest, info = plan.tenant, plan.spec, plan.rest, plan.info
        now = self._clock()
        # promotion: only under a parent that is resident here, so the tree stays whole
        prev: BlockMeta | None
        if plan.chain:
            prev = plan.chain[-1]
            if self._index.get(tenant, prev.key) is not prev:
                return
        elif plan.parent != ROOT_KEY:
            prev = self._index.get(tenant, plan.parent)
            if prev is None or prev.fingerprint != spec.fingerprint:
                return
        else:
            prev = None
        if prev is not None and (prev.in_flight or self._place.expired(prev, now)):
            return
        protected = self._place.protected
        # the local prefix stays put while room is made for the promotions
        held = [(m.tenant, m.key) for m in (plan.chain or ([prev] if prev is not None else []))
                if (m.tenant, m.key) not in protected]
        protected.update(held)
        try:
            default = self._ttl_deadline(tenant, None, now, spec.fingerprint)  # for a copy that says nothing
            ttl_cap = self._ttl_cap_s(tenant, spec.fingerprint)  # the tenant's and the model's TTL
            cap = now + ttl_cap if ttl_cap is not None else None
            for i in range(n):
                key, p = rest[i], (rest[i - 1] if i else (prev.key if prev else ROOT_KEY))
                if self._index.get(tenant, key) is not None:
                    break
                depth = (prev.depth + 1) if prev is not None else 0
                meta = info[i]
                deadline = meta.deadline if meta.known else default
                capped = cap is not None and (deadline is None or deadline > cap)
                if capped:
                    deadline = cap  # NOTE: the tenant's (and the model's) TTL caps every block it holds
                try:
                    prev = self._place.insert_new(
                        tenant, spec, key, p, depth, plan.hosts[i], now, deadline,
                        prev.tier if prev is not None else self.tiers[0], pinned=False)
                except ResourceExhausted:
                    break
                if capped:
                    # NOTE: and its remote copy, as a re-put moves it: every server read it there
                    # with the later deadline (or none), served it, and promoted it again
                    self._remote.submit_ttl(self._place.ref(prev), deadline, parent=p)
                if meta.created is not None and meta.created < prev.created:
                    # NOTE: its age goes with it: a block made before its tenant was deleted
                    # must not pass for a new one when it is spilled again (see tiers.remote)
                    prev.created = meta.created
                    if self._nvme is not None and (prev.persisted or prev.tier == Tier.NVME):
                        self._nvme.update_record(self._place.record(prev))
                if (tenant, key) not in protected:
                    protected.add((tenant, key))
                    guard.append((tenant, key))
                self.counters.add("promotions_remote")
        finally:
            protected.difference_update(held)


def _parents(keys: Sequence[bytes], n: int, parent0: bytes) -> list[bytes]:
    """The parent of each of ``keys[n:]`` in the chain ``keys`` continuing from ``parent0``."""
    return [keys[i - 1] if i else parent0 for i in range(n, len(keys))]


@dataclass(slots=True)
class _RemoteRead:
    """A get's remote continuation: planned under the Store's lock, fetched outside it,
    promoted under it again (see :meth:`ReadPath._remote_promote`)."""

    tenant: str
    spec: ModelSpec
    rest: list[bytes]  # the keys to fetch
    outs: list[Any]  # the caller's buffer of each
    hosts: list[np.ndarray]  # ... or a host buffer in front of a device one
    chain: list[BlockMeta]  # the local prefix served before
    parent: bytes  # the parent of the whole chain
    check_parent: bool  # serve only while the remote tier holds ``parent``
    removals: int  # the Store's removal count when planned
    n: int = 0  # how many leading blocks were fetched
    info: list[RemoteInfo] = field(default_factory=list)
    roots: bool = False  # a roots call's key: a copy recording no parent is a miss
