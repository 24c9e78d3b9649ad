"""The remote tier's background writer: asynchronous demotions and deadline moves, in a queue.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's config, monotonic clock, lock and
counters, its accounting (:mod:`tiers.remote_accounting`: ``_held_bytes_but``, ``resync``,
``_verify_held``), its
writes (:mod:`tiers.remote_put`: ``_put_with``, ``update_ttl``) and the deletions' ``_unlink``;
``_init_queue`` makes its state and starts the writer thread.

* ``submit(ref, data, ...)`` — queues a demotion and answers True, or False at once when the
  queue is full (depth or bytes), closed, or the tenant's blocks here, written and queued (each
  block once, however many demotions of it are queued, and once if written already), would
  pass ``quota``: it never blocks. ``data`` then belongs to the tier (the caller must not change
  it). ``skip_held``: the writer skips it (counted ``queue_skipped_held``) when, by its turn,
  this server's copy of the block is in Redis (``holds``: a write of it queued before landed,
  or an earlier one) and one ``PTTL`` confirms it is there, expiring no sooner than written
  (``_verify_held`` of :mod:`tiers.remote_accounting`); else it is written as any demotion.
* ``submit_ttl(ref, deadline, ...)`` — queues a move of a block's deadline, written after every
  demotion queued before it.
* ``cap_ttl(tenant, deadline)`` — a tenant's TTL was set or lowered: its queued demotions and
  deadline moves are capped at ``deadline`` at once, and the writer lowers every later deadline
  of its copies in Redis (any server's, :meth:`tiers.remote_put.Writes._cap_tenant`) to it,
  after the write in flight (which may land with the old one); counted ``ttl_capped`` (copies
  moved) and ``ttl_cap_failures`` (a cap that could not reach every copy: logged, not retried
  until the policy is set again or the server restarts, which sets it again).
  ``cap_model_ttl(fingerprint, deadline)``: the same for a model's TTL, every tenant's copies of
  its blocks (:meth:`tiers.remote_put.Writes._cap_model`).
* ``flush(timeout)`` — waits until every queued item (and re-count, and cap) was attempted.
* ``_cancel(idents)`` / ``_doomed_subtree(tenant, keys)`` — what deletion uses: a queued
  demotion of a deleted block (or, while a subtree deletion holds its filter — one set of keys
  per deletion, several may run at once — of a block under one) is taken out of the queue; the one being written is waited for (one write's timeouts at most) and unlinked
  again once written. ``_drop_tenant_queue(tenant)``: every demotion of the tenant queued so far
  is dropped when its turn comes.
* ``_want_resync()`` — has the writer re-count the accounting (``resync``), at most once every
  ``accounting_resync_s``.
* ``_recent`` (:class:`RecentWrites`) — every demotion the writer completed (not one cancelled
  meanwhile), kept ``rewrite_window_s`` (at most ``rewrite_window_blocks``): when another
  server's deletion is applied here, the ones that landed after it are deleted again
  (:meth:`tiers.remote_invalidate.SharedDeletions.delete_rewritten`); a deletion made here
  forgets what it deleted.

One writer thread drains the queue, in order; it outlives any item's failure (counted). All the
queue's state is under ``_cond``.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from kvstore.quantization import QuantArg
from tiers.base import BlockRef, as_bytes_view
from tiers.remote_accounting import take_bytes

log = logging.getLogger(__name__)


class Job(NamedTuple):
    """One queued item: a demotion — the block, its bytes (owned by the tier), TTL deadline, the
    tenant's epoch when queued, quantization, creation time and parent key (None: not known),
    whether it is skipped when the block is held by then (:meth:`DemotionQueue.submit`) — or a
    move of a block's deadline (``data`` None: :meth:`DemotionQueue.submit_ttl`)."""

    ref: BlockRef
    data: np.ndarray | None
    deadline: float | None
    epoch: int
    quant: QuantArg
    created: float | None
    parent: bytes | None
    skip_held: bool = False

    @property
    def nbytes(self) -> int:
        """Raw bytes it holds in the queue (0 for a deadline move)."""
        return 0 if self.data is None else self.ref.nbytes


class Written(NamedTuple):
    """One write the writer completed: when (the tier's monotonic clock), the block, its model
    and its parent's key (None: not known)."""

    at: float
    tenant: str
    key: bytes
    fingerprint: bytes
    parent: bytes | None


class RecentWrites:
    """The writes this server's writer completed in the last ``window_s`` seconds, the
    ``most`` latest at most (either 0: none is kept), indexed by block and by parent, so a
    deletion another server made can find the ones that landed in Redis after it (see
    :meth:`tiers.remote_invalidate.SharedDeletions.delete_rewritten`). Thread-safe.

    Memory: about 0.6 KiB a write (the record, its two index entries, its keys). A write forgotten
    (deleted since) stays in the time-ordered queue until it ages out, so the count bound holds
    for both."""

    def __init__(self, window_s: float, most: int, clock: Callable[[], float]) -> None:
        self._window_s = window_s
        self._most = most if window_s > 0 else 0
        self._clock = clock
        self._lock = threading.Lock()
        self._order: deque[Written] = deque()
        self._by_key: dict[tuple[str, bytes], list[Written]] = {}
        self._by_parent: dict[tuple[str, bytes], list[Written]] = {}

    def add(self, ref: BlockRef, parent: bytes | None) -> None:
        """Record a write of ``ref`` (under ``parent``) completed now."""
        if not self._most:
            return
        now = self._clock()
        w = Written(now, ref.tenant, ref.key, ref.spec.fingerprint, parent)
        with self._lock:
            self._order.append(w)
            self._by_key.setdefault((w.tenant, w.key), []).append(w)
            if parent is not None:
                self._by_parent.setdefault((w.tenant, parent), []).append(w)
            self._trim(now)

    def _trim(self, now: float) -> None:
        """Forget the writes older than the window, and the oldest past the count. Caller
        holds the lock."""
        old = now - self._window_s
        while self._order and (len(self._order) > self._most or self._order[0].at < old):
            self._unindex(self._order.popleft())

    def _unindex(self, w: Written) -> bool:
        """Take ``w`` out of the indexes; False when it was not there (forgotten before).
        Caller holds the lock."""
        found = _remove(self._by_key, (w.tenant, w.key), w)
        if found and w.parent is not None:
            _remove(self._by_parent, (w.tenant, w.parent), w)
        return found

    def tenants(self) -> set[str]:
        """The tenants of the writes recorded now."""
        with self._lock:
            self._trim(self._clock())
            return {t for t, _ in self._by_key}

    def under(self, tenant: str, keys: Iterable[bytes]) -> list[Written]:
        """The recorded writes of ``tenant`` whose block is one of ``keys`` (under any model)
        or, through the parents recorded, under one of them."""
        todo = list(keys)
        seen = set(todo)
        out: list[Written] = []
        with self._lock:
            self._trim(self._clock())
            while todo:
                k = todo.pop()
                out.extend(self._by_key.get((tenant, k), ()))
                for w in self._by_parent.get((tenant, k), ()):
                    if w.key not in seen:
                        seen.add(w.key)
                        todo.append(w.key)
        return out

    def where(self, hit: Callable[[Written], bool]) -> list[Written]:
        """The recorded writes that satisfy ``hit`` (a scan: for a model or a tenant)."""
        with self._lock:
            self._trim(self._clock())
            return [w for ws in self._by_key.values() for w in ws if hit(w)]

    def forget(self, tenant: str, blocks: Iterable[tuple[bytes, bytes]]) -> None:
        """Forget the writes of the blocks ``(key, fingerprint)`` of ``tenant``: deleted."""
        with self._lock:
            for key, fp in blocks:
                for w in [w for w in self._by_key.get((tenant, key), ()) if w.fingerprint == fp]:
                    self._unindex(w)

    def forget_where(self, hit: Callable[[Written], bool]) -> None:
        """Forget the writes that satisfy ``hit`` (a model or a tenant purged)."""
        with self._lock:
            for w in [w for ws in self._by_key.values() for w in ws if hit(w)]:
                self._unindex(w)


def _remove(index: dict[tuple[str, bytes], list[Written]], at: tuple[str, bytes], w: Written) -> bool:
    """Remove ``w`` itself (not an equal record) from ``index[at]``; False when it is not there."""
    ws = index.get(at)
    if ws is None:
        return False
    for i, x in enumerate(ws):
        if x is w:
            del ws[i]
            if not ws:
                del index[at]
            return True
    return False


class DemotionQueue:
    """RemoteTier methods of the background writer (see the module docstring)."""

    def _init_queue(self) -> None:
        """Make the queue's state and start the writer thread (last: it reads the tier)."""
        # asynchronous demotion: a bounded deque drained by one writer thread
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._queued_bytes = 0
        # NOTE: a block counts once in its tenant's queued bytes however many demotions of it
        # are queued (a write-through and an eviction spill, skip_held), and not at all while
        # its copy is accounted written (_held): the quota check counted it two or three times
        self._tenant_queued: dict[str, int] = {}  # tenant -> bytes of its blocks queued, not held
        self._queued_blocks: dict[tuple[str, bytes], int] = {}  # ident -> its demotions queued
        self._pending = 0
        self._epochs: dict[str, int] = {}  # tenant -> deletions of it so far (see Job.epoch)
        self._writing: Job | None = None  # the block the writer is writing now
        self._writing_cancelled = False  # ... and deleted meanwhile: unlinked again once written
        # tenant -> one set per deletion running now of the block keys it removes: the writer
        # drops a queued block that is one of them or a child of one (and adds it), so none
        # lands behind it
        self._doomed: dict[str, list[set[bytes]]] = {}
        # ("model", fingerprint) / ("tenant", name) -> purges of it running now: the writer
        # drops their queued blocks
        self._purging: dict[tuple[str, bytes | str], int] = {}
        self._resync_due = False
        self._last_resync = -math.inf
        # ("tenant", name) / ("model", fingerprint) -> the deadline its copies in Redis are capped at next
        self._caps: dict[tuple[str, str | bytes], float] = {}
        self._closed = False
        self._recent = RecentWrites(self.config.rewrite_window_s, self.config.rewrite_window_blocks,
                                    self._monotonic)
        self._worker = threading.Thread(target=self._drain, name="kvstore-remote-demote",
                                        daemon=True)
        self._worker.start()

    def _one_write_s(self) -> float:
        """The longest one command can take: its timeouts and retries, plus a second."""
        cfg = self.config
        return (cfg.op_timeout_s + cfg.connect_timeout_s) * (cfg.retries + 1) + 1

    def _enqueue(self, job: Job) -> None:
        """Append ``job`` and wake the writer. Caller holds ``_cond``."""
        self._queue.append(job)
        if job.nbytes:
            self._queued_bytes += job.nbytes
            ident = job.ref.ident
            with self._lock:
                n = self._queued_blocks.get(ident, 0)
                self._queued_blocks[ident] = n + 1
                if not n and ident not in self._held:
                    self._tenant_queued[ident[0]] = self._tenant_queued.get(ident[0], 0) + job.nbytes
        self._pending += 1
        self._cond.notify_all()

    def _unqueue(self, job: Job) -> None:
        """Take ``job``'s bytes off the queue's counts. Caller holds ``_cond``."""
        if not job.nbytes:
            return
        self._queued_bytes -= job.nbytes
        ident = job.ref.ident
        with self._lock:
            n = self._queued_blocks.pop(ident, 0) - 1
            if n > 0:
                self._queued_blocks[ident] = n
            elif ident not in self._held:
                take_bytes(self._tenant_queued, ident[0], job.nbytes)

    def _queued_held(self, ident: tuple[str, bytes], nbytes: int, held: bool) -> None:
        """The accounting's hook: ``ident``'s copy is now accounted written (``held``) or not
        any more; while a demotion of it is queued, it counts there and not in the queued
        bytes (once in all). Caller holds ``_lock``."""
        if ident not in self._queued_blocks:
            return
        if held:
            take_bytes(self._tenant_queued, ident[0], nbytes)
        else:
            self._tenant_queued[ident[0]] = self._tenant_queued.get(ident[0], 0) + nbytes

    def _queue_gauges(self) -> dict[str, int]:
        with self._cond:
            return {"queue_blocks": len(self._queue), "queue_bytes": self._queued_bytes}

    def submit(self, ref: BlockRef, data: Any, *, ttl_deadline: float | None = None,
               quant: QuantArg = None, quota: int | None = None,
               created: float | None = None, parent: bytes | None = None,
               skip_held: bool = False) -> bool:
        """Queue an asynchronous put; False (nothing queued) when the queue is full or closed,
        or when the tenant's blocks here, written and queued, would pass ``quota`` bytes.
        ``data`` (a buffer of ``ref.nbytes``) is owned by the tier from now on. ``parent``:
        as for :meth:`put`. ``skip_held``: not written when, by the writer's turn, this
        server's copy is in Redis (:meth:`holds` with ``ttl_deadline``: a write of it queued
        before, write-through, landed meanwhile, or an earlier one) and Redis confirms it (one
        ``PTTL``, :meth:`_verify_held`: another server's put may have shortened it)."""
        view = as_bytes_view(data)
        over = False
        with self._cond:
            if (self._closed or len(self._queue) >= self.config.queue_depth
                    or self._queued_bytes + ref.nbytes > self.config.max_inflight_bytes):
                with self._lock:
                    self._counts["queue_rejected"] += 1
                return False
            if quota is not None:
                with self._lock:
                    queued = self._tenant_queued.get(ref.tenant, 0)
                    if ref.ident in self._queued_blocks and ref.ident not in self._held:
                        queued -= ref.nbytes  # NOTE: queued already: this demotion replaces it
                    if self._held_bytes_but(ref) + queued + ref.nbytes > quota:
                        self._counts["quota_rejected"] += 1
                        over = True
            if not over:
                epoch = self._epochs.get(ref.tenant, 0)
                self._enqueue(Job(ref, view, ttl_deadline, epoch, quant, created, parent, skip_held))
        if over:
            self._want_resync()
            return False
        self._count("queue_submitted")
        return True

    def submit_ttl(self, ref: BlockRef, ttl_deadline: float | None, *,
                   parent: bytes | None = None) -> bool:
        """Queue a move of the block's deadline (:meth:`update_ttl`, by the background writer,
        after every demotion queued before it: a queued copy of the block is written first);
        False (nothing queued, counted ``ttl_rejected``) when the queue is full or closed."""
        with self._cond:
            if self._closed or len(self._queue) >= self.config.queue_depth:
                with self._lock:
                    self._counts["ttl_rejected"] += 1
                return False
            self._enqueue(Job(ref, None, ttl_deadline, self._epochs.get(ref.tenant, 0),
                              None, None, parent))
        self._count("ttl_submitted")
        return True

    def cap_ttl(self, tenant: str, deadline: float) -> None:
        """No copy of ``tenant``'s blocks outlives ``deadline``: its queued demotions and
        deadline moves are capped now, the copies this node wrote are accounted so, and the
        writer caps every copy in Redis next (see the module docstring). Never blocks."""
        if self._cap(("tenant", tenant), deadline, lambda ref: ref.tenant == tenant):
            self._cap_held(tenant, deadline)

    def cap_model_ttl(self, fingerprint: bytes, deadline: float) -> None:
        """:meth:`cap_ttl` for every block of the model ``fingerprint``, every tenant's (a
        model's TTL set or lowered). Never blocks."""
        if self._cap(("model", fingerprint), deadline, lambda ref: ref.spec.fingerprint == fingerprint):
            self._cap_held_model(fingerprint, deadline)

    def _cap(self, which: tuple[str, str | bytes], deadline: float, hit: Callable[[BlockRef], bool]) -> bool:
        """Cap the queued jobs of the blocks ``hit`` at ``deadline`` and have the writer cap
        the copies in Redis of ``which`` next; False when the queue is closed."""
        with self._cond:
            if self._closed:
                return False
            self._queue = deque(j._replace(deadline=deadline)
                                if hit(j.ref) and (j.deadline is None or j.deadline > deadline) else j
                                for j in self._queue)
            if which not in self._caps:
                self._pending += 1
            self._caps[which] = min(self._caps.get(which, deadline), deadline)
            self._cond.notify_all()
        return True

    def _run_cap(self, which: tuple[str, str | bytes], deadline: float) -> None:
        """The writer's part of :meth:`cap_ttl` and :meth:`cap_model_ttl`."""
        kind, name = which
        try:
            if kind == "model":
                assert isinstance(name, bytes)
                moved = self._cap_model(name, deadline)
            else:
                assert isinstance(name, str)
                moved = self._cap_tenant(name, deadline)
            self._count("ttl_capped", moved)
        except Exception as exc:  # noqa: BLE001 - NOTE: counted and logged; the writer must outlive it
            self._count("ttl_cap_failures")
            shown = f"model {name.hex()}" if isinstance(name, bytes) else repr(name)
            log.warning("remote tier: the TTL of %s could not be applied to all its copies (%s): some keep "
                        "a later deadline until the policy is set again or the server restarts", shown, exc)
        finally:
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued demotion (and re-count, and cap) was attempted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def _want_resync(self) -> None:
        """Have the writer re-count this node's blocks (a write was refused for capacity or
        quota: blocks that vanished unseen may be what fills them), unless one was made less
        than ``accounting_resync_s`` ago."""
        now = self._monotonic()
        with self._cond:
            if (self._closed or self._resync_due
                    or now - self._last_resync < self.config.accounting_resync_s):
                return
            self._last_resync = now
            self._resync_due = True
            self._pending += 1
            self._cond.notify_all()

    def _drain(self) -> None:
        scratch = np.empty(0, dtype=np.uint8)
        while True:
            with self._cond:
                while not self._queue and not self._closed and not self._resync_due and not self._caps:
                    self._cond.wait()
                resync = self._resync_due
                cap = None
                if resync:
                    self._resync_due = False
                elif self._caps:
                    cap = self._caps.popitem()
                elif not self._queue:
                    return
                else:
                    job = self._queue.popleft()
                    ref = job.ref
                    self._writing, self._writing_cancelled = job, False
                    if self._is_doomed(job) or self._purged(ref.tenant, ref.spec.fingerprint):
                        self._writing_cancelled = True  # it, an ancestor or its model is being deleted
            if cap is not None:
                self._run_cap(*cap)
                continue
            if resync:
                try:
                    self.resync()
                except Exception:  # noqa: BLE001 - NOTE: counted; the writer must outlive it
                    self._count("resync_errors")
                finally:
                    with self._cond:
                        self._pending -= 1
                        self._cond.notify_all()
                continue
            try:
                if self._epochs.get(ref.tenant, 0) != job.epoch:
                    self._count("queue_dropped")  # the tenant was deleted meanwhile
                elif self._writing_cancelled:
                    self._count("queue_cancelled")
                elif job.data is None:
                    ok = self.update_ttl(ref, job.deadline, parent=job.parent)
                    self._count("ttl_moved" if ok else "ttl_not_moved")
                elif job.skip_held and self.holds(ref, job.deadline) and self._verify_held(ref, job.deadline):
                    self._count("queue_skipped_held")
                else:
                    ok, scratch = self._put_with(scratch, ref, job.data, job.deadline, job.quant,
                                                 job.created, job.parent)
                    self._count("queue_written" if ok else "queue_failed")
                    with self._cond:
                        cancelled = self._writing_cancelled
                    if ok and cancelled:  # deleted while it was being written
                        self._unlink(ref)
                        self._count("queue_cancelled")
                    elif ok:
                        # NOTE: recorded before the job stops being the one in flight: a
                        # deletion applied from another server waits for it, then finds it
                        # here (it landed after that deletion: written back, served to all)
                        self._recent.add(ref, job.parent)
            except Exception:  # noqa: BLE001 - NOTE: counted; the writer must outlive any item
                self._count("queue_failed")
                self._count("queue_errors")
            finally:
                with self._cond:
                    self._unqueue(job)
                    self._writing = None
                    self._pending -= 1
                    self._cond.notify_all()

    # -- cancellation (deletions) ---------------------------------------------------------------
    def _drop_tenant_queue(self, tenant: str) -> None:
        """Every item of ``tenant`` queued so far is dropped when its turn comes (counted
        ``queue_dropped``): the tenant is being deleted."""
        with self._cond:
            self._epochs[tenant] = self._epochs.get(tenant, 0) + 1

    def _is_doomed(self, job: Job) -> bool:
        """Whether a delete_subtrees running now removes ``job``'s block: it is one of the
        blocks being deleted or a child of one (then it is one too, from now on). Caller holds
        ``_cond``."""
        hit = False
        for doomed in self._doomed.get(job.ref.tenant, ()):
            if job.ref.key in doomed or job.parent in doomed:
                doomed.add(job.ref.key)
                hit = True
        return hit

    def under_deletion(self, tenant: str, fingerprint: bytes, chain: Callable[[], Iterable[bytes]]) -> bool:
        """Whether a purge of the model ``fingerprint`` is open, or a deletion of ``tenant``
        is and one of the block keys ``chain()`` yields (a block and its ancestors) is among
        the blocks it removes: a block put under a block being deleted, and evicted before
        the deletion's local part drops it, must not be demoted (its parent's demotion, by
        which the writer's filter would know it, may never be queued). ``chain`` is called
        only while a deletion of ``tenant`` is open."""
        with self._cond:
            if self._purged(tenant, fingerprint):
                return True
            sets = self._doomed.get(tenant)
            return bool(sets) and any(k in d for k in chain() for d in sets)

    def _purged(self, tenant: str, fingerprint: bytes) -> bool:
        """Whether a purge of the tenant or of the model is open. Caller holds ``_cond``."""
        return bool(self._purging) and (("model", fingerprint) in self._purging
                                        or ("tenant", tenant) in self._purging)

    @contextmanager
    def purging(self, *, fingerprint: bytes | None = None,
                tenant: str | None = None) -> Iterator[Callable[[], int]]:
        """While open, no demotion of a block of the model ``fingerprint`` (any tenant), or of
        ``tenant`` (any model), is written: the queued ones are dropped at once and when their
        turn comes, the one being written is waited for and unlinked again. Yields
        ``cancel()``, which drops the queued ones (returns how many); entering waits for
        nothing (the Store enters it under its lock), so call it once the lock is released,
        and again after the local part of the purge, before the filter is lifted."""
        what: tuple[str, bytes | str]
        if fingerprint is not None:
            what = ("model", fingerprint)
        elif tenant is not None:
            what = ("tenant", tenant)
        else:
            raise TypeError("purging() takes a fingerprint or a tenant")
        with self._cond:
            self._purging[what] = self._purging.get(what, 0) + 1

        def cancel() -> int:
            def hit(job: Job) -> bool:
                return (job.ref.spec.fingerprint == fingerprint if tenant is None
                        else job.ref.tenant == tenant)

            with self._cond:
                n = len(self._drop_queued(hit)) + self._wait_writing(hit)
                self._cond.notify_all()
            if n:
                self._count("queue_cancelled", n)
            return n

        try:
            yield cancel
        finally:
            with self._cond:
                left = self._purging[what] - 1
                if left:
                    self._purging[what] = left
                else:
                    del self._purging[what]

    def _wait_writing(self, hit: Callable[[Job], bool]) -> bool:
        """When the block being written satisfies ``hit``: mark it cancelled (the writer unlinks
        it once written) and wait for it (one write's timeouts at most). Caller holds ``_cond``."""
        job = self._writing
        if job is None or not hit(job):
            return False
        self._writing_cancelled = True
        self._cond.wait_for(lambda: self._writing is not job, self._one_write_s())
        return True

    def _drop_queued(self, hit: Callable[[Job], bool]) -> list[Job]:
        """Take the queued demotions that satisfy ``hit`` out of the queue. Caller holds ``_cond``."""
        keep: deque[Job] = deque()
        out: list[Job] = []
        for job in self._queue:
            if hit(job):
                self._unqueue(job)
                self._pending -= 1
                out.append(job)
            else:
                keep.append(job)
        self._queue = keep
        return out

    def _cancel(self, idents: set[tuple[str, bytes]]) -> int:
        """Take the queued demotions of ``idents`` out of the queue and wait (one write's
        timeouts at most) for the one being written, if it is one of them (the writer unlinks
        it again if the wait ends first); returns how many were cancelled."""
        with self._cond:
            n = len(self._drop_queued(lambda job: job.ref.ident in idents))
            n += self._wait_writing(lambda job: job.ref.ident in idents)
            self._cond.notify_all()
        if n:
            self._count("queue_cancelled", n)
        return n

    @contextmanager
    def _doomed_subtree(self, tenant: str,
                        keys: Iterable[bytes]) -> Iterator[Callable[[Iterable[bytes]], set[bytes]]]:
        """While open, the blocks ``keys`` of ``tenant`` and every block queued under one of them
        are being deleted: the writer drops such a demotion when its turn comes. Yields
        ``doom(more=())``: adds the blocks ``more`` and cancels every queued (or in-flight)
        demotion the deletion now removes (see :meth:`_cancel_doomed`); returns their keys."""
        doomed = set(keys)
        with self._cond:
            # NOTE: one set per deletion: two deletions of one tenant may run at once (the
            # Store holds its lock only for its local part), and the first to end must not
            # stop the writer's filter for the other
            self._doomed.setdefault(tenant, []).append(doomed)

        def doom(more: Iterable[bytes] = ()) -> set[bytes]:
            with self._cond:
                doomed.update(more)
            return self._cancel_doomed(tenant)

        try:
            yield doom
        finally:
            with self._cond:
                sets = [d for d in self._doomed[tenant] if d is not doomed]
                if sets:
                    self._doomed[tenant] = sets
                else:
                    del self._doomed[tenant]

    def _cancel_doomed(self, tenant: str) -> set[bytes]:
        """Cancel every queued (or in-flight) demotion of ``tenant`` that a running
        delete_subtrees removes (see :meth:`_is_doomed`: a child queued before its parent is
        found once its parent is); returns their keys."""
        out: set[bytes] = set()
        with self._cond:
            while True:
                jobs = self._drop_queued(lambda job: job.ref.tenant == tenant and self._is_doomed(job))
                out.update(job.ref.key for job in jobs if job.data is not None)
                if not jobs:
                    break
            writing = self._writing
            if self._wait_writing(lambda job: job.ref.tenant == tenant and self._is_doomed(job)):
                assert writing is not None
                if writing.data is not None:
                    out.add(writing.ref.key)
            self._cond.notify_all()
        if out:
            self._count("queue_cancelled", len(out))
        return out

    def _stop_writer(self) -> None:
        """Drop what is still queued, stop the writer thread and wait for it (the item being
        written ends within one command's timeouts and retries)."""
        with self._cond:
            self._closed = True
            self._pending -= len(self._queue)
            if self._resync_due:
                self._resync_due = False
                self._pending -= 1
            self._pending -= len(self._caps)  # NOTE: the next start sets the policies again
            self._caps.clear()
            self._queued_bytes -= sum(job.nbytes for job in self._queue)
            self._queue.clear()
            with self._lock:
                self._tenant_queued.clear()
                self._queued_blocks.clear()
            self._cond.notify_all()
        self._worker.join(timeout=self._one_write_s())


__all__ = ["DemotionQueue", "Job", "RecentWrites", "Written"]
