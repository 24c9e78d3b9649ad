"""What every RPC shares: authentication, timing, error mapping, auditing, and registration.

* :class:`RpcRunner` — ``run(name, context, fn)`` authenticates the bearer token, calls
  ``fn(principal)``, maps typed errors to status codes through :mod:`kvstore.status` (the one
  place that does), counts rejections and observes latency. With ``audit`` (a
  :class:`~kvstore.audit.Recorder`) it also requires the admin role, records the action before
  it runs (a change whose record cannot be written is not made) and records the outcome.
* :func:`service_handler` — the grpc handler of a service built from its descriptor, with
  per-method (de)serializers overridable: the KVStore service serves Put/Get as raw frames
  (:mod:`kvstore.frames`) and every other method with the generated protobuf classes.
* :class:`CallLimiter` — with ``calls`` (:class:`~kvstore.server_config.CallLimits`) the runner
  admits a call once it is authenticated: one principal may have ``calls_per_principal`` calls
  running (``streams_per_principal`` of them streams), all tenants together ``tenant_calls``
  (the rest of the worker threads are kept for the admin, who is not counted, and for health
  checks); past a bound the call is refused with RESOURCE_EXHAUSTED naming the limit. A
  server-streaming call (Get) keeps its place until its last message is sent.
* :class:`IdleWatch` — streams that move no message for ``stream_idle_s`` (a Put whose client
  sends nothing, a Get whose client reads nothing) are cancelled from one watcher thread with
  ``context.cancel()`` (thread-safe, unlike ``abort``), which wakes the handler thread blocked in
  grpc; the handler then fails with :class:`StreamIdle` and a Put stores nothing. The client
  sees CANCELLED: a cancelled call can carry no status of the server's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from kvstore.audit import Recorder
from kvstore.auth import AuthRegistry, Principal, Role, bearer_token
from kvstore.errors import FailedPrecondition, KVStoreError, PermissionDenied, ResourceExhausted, Unauthenticated
from kvstore.metrics import ServiceMetrics
from kvstore.status import to_status

if TYPE_CHECKING:
    from kvstore.server_config import CallLimits

log = logging.getLogger(__name__)


class StreamIdle(KVStoreError):
    """A stream moved no message for ``limits.stream_idle_s``; it was cancelled."""

    code = "DEADLINE_EXCEEDED"


class _Slot:
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

    def enter(self, principal: Principal, *, stream: bool) -> _Slot:
        """Admit one call of ``principal`` (a stream when ``stream``), or ResourceExhausted
        naming the bound it would pass."""
        if principal.role is Role.ADMIN:
            return _Slot(None, "", False)
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
        return _Slot(self, name, stream)

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


class _Watched:
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
        self._watched: set[_Watched] = set()
        self._thread: threading.Thread | None = None

    def watch(self, cancel: Callable[[], None]) -> _Watched:
        w = _Watched(cancel)
        with self._lock:
            self._watched.add(w)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-idle-watch", daemon=True)
                self._thread.start()
        return w

    def forget(self, w: _Watched) -> None:
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

    def requests(self, requests: Iterator[Any], w: _Watched) -> Iterator[Any]:
        """The items of a client stream; one that keeps the server waiting ``idle_s`` is
        cancelled and raises :class:`StreamIdle` (also when it ends at that moment)."""
        it = iter(requests)
        while True:
            w.wait()
            try:
                item = next(it)
            except StopIteration:
                if w.done():
                    raise self.error("the client sent nothing") from None
                return
            except BaseException:
                if w.done():
                    raise self.error("the client sent nothing") from None
                raise
            if w.done():
                raise self.error("the client sent nothing")
            yield item


class _Call:
    """What a stream handler tells :meth:`RpcRunner.run` about its call: a stream counts as
    one; a server stream (``hold``) keeps its slot until its handler ends."""

    __slots__ = ("hold", "slot")

    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.slot: _Slot | None = None

#: (request_deserializer, response_serializer); None = pass bytes through unchanged
Codec = tuple[Callable[[bytes], Any] | None, Callable[[Any], bytes] | None]


class RpcRunner:
    """Authentication, timing, error mapping and (for Admin) auditing around one plain call;
    with ``calls``, admission (:class:`CallLimiter`) and idle streams (:class:`IdleWatch`,
    installed on the stream handlers by :meth:`guard`)."""

    def __init__(self, registry: AuthRegistry, metrics: ServiceMetrics | None,
                 drop_epoch: Callable[[], int] | None = None, calls: CallLimits | None = None) -> None:
        self.registry, self.metrics = registry, metrics
        self._drop_epoch = drop_epoch
        self.limiter: CallLimiter | None = None
        self.idle: IdleWatch | None = None
        if calls is not None:
            self.limiter = CallLimiter(calls.calls_per_principal, calls.streams_per_principal, calls.tenant_calls)
            self.idle = IdleWatch(calls.stream_idle_s)
        self._calls: dict[Any, _Call] = {}  # context -> what its stream handler said

    def principal(self, context: grpc.ServicerContext) -> Principal:
        # NOTE: the epoch is read BEFORE the token is checked: a tenant deleted after this
        # point fails the call's put (Store.reserve_put since=), one deleted before fails here
        epoch = self._drop_epoch() if self._drop_epoch is not None else None
        metadata = context.invocation_metadata() or ()
        if sum(1 for key, _ in metadata if key.lower() == "authorization") > 1:
            # NOTE: which one counts is up to each proxy on the way: refuse the ambiguity
            raise Unauthenticated("more than one authorization header")
        principal = self.registry.authenticate(bearer_token(metadata))
        return replace(principal, epoch=epoch)

    def run(self, name: str, context: grpc.ServicerContext, fn: Callable[[Principal], Any],
            audit: Recorder | None = None) -> Any:
        """Authenticate, call ``fn(principal)``, map errors; with ``audit``, require the admin
        role and record the action and its outcome (failed authentications included, as
        principal ``?``)."""
        start = time.perf_counter()
        code = "OK"
        who = "?"
        slot = None
        try:
            principal = self.principal(context)
            who = principal.name
            call = self._calls.get(context)
            if self.limiter is not None and (call is None or call.slot is None):
                slot = self.limiter.enter(principal, stream=call is not None)
                if call is not None and call.hold:  # a server stream: its handler releases it
                    call.slot, slot = slot, None
            if audit is not None and principal.role is not Role.ADMIN:
                raise PermissionDenied(f"{principal.name!r} is not an admin")
            if audit is not None:
                audit.begin(who)
            result = fn(principal)
            if audit is not None:
                try:
                    audit.end(who, "OK")
                except KVStoreError as exc:  # the action is done; its record is not
                    audit = None  # NOTE: not once more below
                    raise FailedPrecondition(f"{name} was carried out, but {exc}") from None
            return result
        except KVStoreError as exc:
            status, message = to_status(exc)
            code = status.name
            if audit is not None:
                _audit_quietly(audit, who, code, name)
            if self.metrics is not None and isinstance(exc, ResourceExhausted):
                self.metrics.rejections.labels(resource=exc.resource or "unknown").inc()
            context.abort(status, message)
        except Exception:
            if context.code() is not None or not context.is_active():
                code = "CANCELLED"
                raise
            code = "INTERNAL"
            log.exception("%s failed", name)
            if audit is not None:
                _audit_quietly(audit, who, code, name)
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            if slot is not None:
                slot.release()
            if self.metrics is not None:
                self.metrics.observe(name, code, time.perf_counter() - start)

    @staticmethod
    def relay(context: grpc.ServicerContext, frames: Iterator[Any]) -> Iterator[Any]:
        """The items of a response stream whose call :meth:`run` already started; a typed error
        raised while producing them aborts the stream with its status (it ended as UNKNOWN)."""
        try:
            yield from frames
        except KVStoreError as exc:
            status, message = to_status(exc)
            context.abort(status, message)

    def guard(self, behavior: Callable[..., Any], client_streaming: bool,
              server_streaming: bool) -> Callable[..., Any]:
        """``behavior`` (a servicer method), as registered: a stream counts against
        ``streams_per_principal`` when :meth:`run` admits it, a server stream keeps its slot
        until it ends, and both directions are watched for idleness. Unary calls unchanged."""
        idle = self.idle
        if idle is None or not (client_streaming or server_streaming):
            return behavior
        if server_streaming:
            def serve_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                return self._serve_stream(idle, behavior, request, context, client_streaming)
            return serve_stream

        def receive_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            call = self._calls[context] = _Call(hold=False)
            w = idle.watch(context.cancel)
            try:
                return behavior(idle.requests(requests, w), context)
            finally:
                idle.forget(w)
                if self._calls.get(context) is call:
                    del self._calls[context]
        return receive_stream

    def _serve_stream(self, idle: IdleWatch, behavior: Callable[..., Any], request: Any,
                      context: grpc.ServicerContext, client_streaming: bool) -> Iterator[Any]:
        call = self._calls[context] = _Call(hold=True)
        w = idle.watch(context.cancel)
        try:
            if client_streaming:
                request = idle.requests(request, w)
            for item in behavior(request, context):
                w.wait()  # grpc sends it: the client must take it
                yield item
                if w.done():  # cancelled as it was taken: end here (the client saw CANCELLED)
                    context.abort(grpc.StatusCode.CANCELLED, str(idle.error("the client took nothing")))
        finally:
            idle.forget(w)
            if call.slot is not None:
                call.slot.release()
            if self._calls.get(context) is call:
                del self._calls[context]


def _audit_quietly(audit: Recorder, who: str, code: str, name: str) -> None:
    """Record a failed call; a record that cannot be written is logged, not raised over the
    call's own error."""
    try:
        audit.end(who, code)
    except KVStoreError as exc:
        log.error("%s by %s failed with %s, and its audit record was not written: %s", name, who, code, exc)


_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def method_handlers(service: ServiceDescriptor, servicer: Any,
                    overrides: Mapping[str, Codec] | None = None) -> dict[str, grpc.RpcMethodHandler]:
    """One handler per method of ``service``, calling ``servicer.<Method>``."""
    overrides = overrides or {}
    unknown = set(overrides) - {m.name for m in service.methods}
    assert not unknown, f"overrides name unknown methods: {sorted(unknown)}"
    handlers = {}
    for m in service.methods:
        codec = overrides.get(m.name)
        if codec is None:
            codec = (GetMessageClass(m.input_type).FromString, GetMessageClass(m.output_type).SerializeToString)
        factory = _FACTORIES[(m.client_streaming, m.server_streaming)]
        behavior = getattr(servicer, m.name)
        rpc = getattr(servicer, "rpc", None)
        if isinstance(rpc, RpcRunner):  # streams: counted, held and watched (see RpcRunner.guard)
            behavior = rpc.guard(behavior, m.client_streaming, m.server_streaming)
        handlers[m.name] = factory(behavior, request_deserializer=codec[0], response_serializer=codec[1])
    return handlers


def add_service(server: grpc.Server, service: ServiceDescriptor, servicer: Any,
                overrides: Mapping[str, Codec] | None = None) -> None:
    """Register ``servicer`` for ``service`` on ``server`` (as the generated add_* functions do)."""
    handlers = method_handlers(service, servicer, overrides)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
