"""Admission of calls and idle streams: the bounds :class:`~kvstore.service_rpc.RpcRunner`
enforces with ``calls`` (:class:`~kvstore.server_config.CallLimits`).

* :class:`CallLimiter` — the runner admits a call once it is authenticated: one principal may
  have ``calls_per_principal`` calls running (``streams_per_principal`` of them streams), all
  tenants together ``tenant_calls`` (the rest of the worker threads are kept for the admin, who
  is not counted, and for health checks); past a bound the call is refused with
  RESOURCE_EXHAUSTED naming the limit. A server-streaming call (Get) keeps its place until its
  last message is sent.
* :class:`CallQueue` and :class:`QueueBound` — the calls running or waiting for a worker
  (``max_concurrent_rpcs``: ``workers + limits.max_queued_calls``; the Admin service and health
  checks may go ``admin_workers`` past it): a call arriving past them is refused at once
  (decided and counted on grpc's serving thread, sent from a thread of its own, never queued
  behind the workers) with RESOURCE_EXHAUSTED in grpc's own words (``Concurrent RPC limit
  exceeded!``, which the client reads as ``limits.max_queued_calls``; counted by
  :meth:`~kvstore.service_rpc.RpcRunner.count_queued`). NOTE: grpc's ``maximum_concurrent_rpcs``
  refused them before any kvstore code ran: the metrics never saw them. It stays,
  :data:`REFUSALS_IN_FLIGHT` above, as a backstop.
* :class:`IdleWatch` — streams that move no message for ``stream_idle_s`` (a Put whose client
  sends nothing, a Get whose client reads nothing) are cancelled from one watcher thread with
  ``context.cancel()`` (thread-safe, unlike ``abort``), which wakes the handler thread blocked in
  grpc; the handler then fails with :class:`~kvstore.errors.StreamIdle` and a Put stores
  nothing. The client sees CANCELLED: a cancelled call can carry no status of the server's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc

from kvstore.auth import Principal, Role
from kvstore.errors import ResourceExhausted, StreamIdle

log = logging.getLogger(__name__)

#: what :meth:`IdleWatch.requests` gets from a client stream that ended
_END = object()


class CallSlot:
    """One admitted call's place in a :class:`CallLimiter`; :meth:`release` is idempotent."""

    __slots__ = ("_limiter", "_name", "_stream")

    def __init__(self, limiter: CallLimiter | None, name: str, stream: bool) -> None:
        self._limiter, self._name, self._stream = limiter, name, stream

    def release(self) -> None:
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter._leave(self._name, self._stream)


class CallLimiter:
    """Concurrent calls per principal, streams per principal and calls of all tenants together;
    the admin principal is not counted."""

    def __init__(self, calls_per_principal: int, streams_per_principal: int, tenant_calls: int) -> None:
        self.calls_per_principal = calls_per_principal
        self.streams_per_principal = streams_per_principal
        self.tenant_calls = tenant_calls
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        self._streams: Counter[str] = Counter()
        self._tenants = 0

    def enter(self, principal: Principal, *, stream: bool) -> CallSlot:
        """Admit one call of ``principal`` (a stream when ``stream``), or ResourceExhausted
        naming the bound it would pass."""
        if principal.role is Role.ADMIN:
            return CallSlot(None, "", False)
        name = principal.name
        with self._lock:
            if self._calls[name] >= self.calls_per_principal:
                raise ResourceExhausted(
                    f"this principal already has {self._calls[name]} calls running, the most one may "
                    f"(limits.max_calls_per_principal={self.calls_per_principal}); retry when one ends",
                    resource="limits.max_calls_per_principal")
            if stream and self._streams[name] >= self.streams_per_principal:
                raise ResourceExhausted(
                    f"this principal already has {self._streams[name]} Put/Get streams running, the most "
                    f"one may (limits.max_streams_per_principal={self.streams_per_principal}); retry when "
                    f"one ends", resource="limits.max_streams_per_principal")
            if self._tenants >= self.tenant_calls:
                raise ResourceExhausted(
                    f"the server is busy: tenants have {self._tenants} calls running, all the worker "
                    f"threads not kept for the admin (workers - limits.admin_workers); retry later",
                    resource="limits.admin_workers")
            self._calls[name] += 1
            if stream:
                self._streams[name] += 1
            self._tenants += 1
        return CallSlot(self, name, stream)

    def _leave(self, name: str, stream: bool) -> None:
        with self._lock:
            self._tenants -= 1
            self._calls[name] -= 1
            if not self._calls[name]:
                del self._calls[name]
            if stream:
                self._streams[name] -= 1
                if not self._streams[name]:
                    del self._streams[name]

    def running(self, name: str) -> tuple[int, int]:
        """(calls, streams) that principal ``name`` has running."""
        with self._lock:
            return self._calls[name], self._streams[name]


#: refusals of :class:`QueueBound` being sent at once (grpc counts them as calls) before grpc's
#: own bound, this far above the queue's (and the admin's headroom), refuses calls itself: a
#: backstop (those calls are counted all the same: see :class:`QueueBound`)
REFUSALS_IN_FLIGHT = 32
#: the methods that may take the ``admin_workers`` headroom above the bound: the Admin service
#: (a tenant's call of it is PERMISSION_DENIED anyway) and health checks
RESERVED_METHODS = ("/kvstore.v1.Admin/", "/grpc.health.v1.Health/")

#: ``count(method)``: count a call :class:`QueueBound` refuses (on grpc's serving thread)
CountRefusal = Callable[[str], None]
#: ``abort(context)``: end such a call with the refusal's status
AbortRefusal = Callable[[grpc.ServicerContext], None]


class CallQueue(ThreadPoolExecutor):
    """grpc's pool of ``workers`` threads, counting the calls it holds (:attr:`held`: running
    or waiting for a thread) against ``bound``. grpc submits each call it accepts here from its
    serving thread, the one that asks :class:`QueueBound` first: the count a call is admitted
    on includes every call admitted before it."""

    def __init__(self, workers: int, bound: int) -> None:
        super().__init__(max_workers=workers, thread_name_prefix="kvstore-rpc")
        self.bound = bound
        self._held = 0
        self._held_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._held_lock:
            self._held += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._leave(None)
            raise
        future.add_done_callback(self._leave)
        return future

    def _leave(self, _future: Future | None) -> None:
        with self._held_lock:
            self._held -= 1

    @property
    def held(self) -> int:
        return self._held


class QueueBound(grpc.ServerInterceptor):
    """Refuses each call that arrives while ``queue`` holds its bound (``reserved`` more for
    :data:`RESERVED_METHODS`): ``count`` counts it at once, on grpc's serving thread; ``abort``
    ends it on a thread of its own (grpc's ``experimental_thread_pool``), not behind the busy
    workers, and the request is never read.

    NOTE: counted when the abort ran, a burst of refusals waiting for that thread passed grpc's
    own bound (``REFUSALS_IN_FLIGHT`` above), which refused the rest uncounted (300 refused,
    277 counted; 1000, 597). grpc asks the interceptors before its own bound: counted here,
    each is counted whoever sends it. NOTE: without the headroom, one tenant's flood of calls
    (each about to be refused by the per-principal limits) filled the queue, and health checks
    and admin calls were refused with it, though the tenants leave ``admin_workers`` to them."""

    def __init__(self, queue: CallQueue, count: CountRefusal, abort: AbortRefusal, reserved: int = 0) -> None:
        self._queue = queue
        self._count = count
        self._reserved = reserved
        self._refusal = _Refusal(ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-refuse"), abort)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return handler
        method = details.method
        bound = self._queue.bound + (self._reserved if method.startswith(RESERVED_METHODS) else 0)
        if self._queue.held < bound:
            return handler
        self._count(method)
        # NOTE: a stream handler whatever the method: grpc reads no request before calling it
        return grpc.stream_stream_rpc_method_handler(self._refusal)


class _Refusal:
    """The behaviour of a refused call (one for all: it keeps no state of a call)."""

    __slots__ = ("abort", "experimental_thread_pool")

    def __init__(self, lane: ThreadPoolExecutor, abort: AbortRefusal) -> None:
        self.experimental_thread_pool = lane  # grpc runs the behaviour there
        self.abort = abort

    def __call__(self, _requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        self.abort(context)
        return iter(())


class WatchedStream:
    """One stream under an :class:`IdleWatch`: ``since`` is when it began waiting on its client
    (None while the server itself is busy); ``expired`` once the watch cancelled it."""

    __slots__ = ("cancel", "expired", "lock", "since")

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.cancel = cancel
        self.since: float | None = None
        self.expired = False
        self.lock = threading.Lock()

    def wait(self) -> None:
        self.since = time.monotonic()

    def done(self) -> bool:
        """The wait on the client is over; True when the watch cancelled the stream meanwhile."""
        with self.lock:
            self.since = None
            return self.expired

    def expire(self, now: float, idle_s: float) -> bool:
        with self.lock:
            since = self.since
            if since is None or self.expired or now - since < idle_s:
                return False
            self.expired = True
            return True


class IdleWatch:
    """Cancels the streams that wait on their client for ``idle_s`` or longer. One daemon
    thread, running only while streams are watched, looks every ``idle_s / 2``."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._watched: set[WatchedStream] = set()
        self._thread: threading.Thread | None = None

    def watch(self, cancel: Callable[[], None]) -> WatchedStream:
        w = WatchedStream(cancel)
        with self._lock:
            self._watched.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-idle-watch", daemon=True)
                self._thread.start()
        return w

    def forget(self, w: WatchedStream) -> None:
        with self._lock:
            self._watched.discard(w)

    def _run(self) -> None:
        while True:
            time.sleep(self.idle_s / 2)
            now = time.monotonic()
            with self._lock:
                if not self._watched:
                    self._thread = None
                    return
                expired = [w for w in self._watched if w.expire(now, self.idle_s)]
            for w in expired:
                try:
                    w.cancel()
                except Exception:
                    log.debug("cancelling an idle stream failed", exc_info=True)

    def error(self, what: str) -> StreamIdle:
        return StreamIdle(f"{what} for limits.stream_idle_s={self.idle_s:g} s: the stream was cancelled")

    def requests(self, requests: Iterator[Any], w: WatchedStream) -> Iterator[Any]:
        """The items of a client stream; one that keeps the server waiting ``idle_s`` is
        cancelled and raises :class:`~kvstore.errors.StreamIdle` (also when it ends at that
        moment)."""
        it = iter(requests)
        while True:
            w.wait()
            try:
                item = next(it, _END)
            except BaseException:
                if w.done():
                    raise self.error("the client sent nothing") from None
                raise
            if w.done():
                raise self.error("the client sent nothing")
            if item is _END:
                return
            yield item
