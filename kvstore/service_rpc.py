"""What every RPC shares: authentication, timing, error mapping, auditing, and registration.

* :class:`RpcRunner` — ``run(name, context, fn)`` authenticates the bearer token, calls
  ``fn(principal)``, maps typed errors to status codes through :mod:`kvstore.status` (the one
  place that does), counts rejections and observes latency. With ``audit`` (a
  :class:`~kvstore.audit.Recorder`) it also requires the admin role, records the action before
  it runs (a change whose record cannot be written is not made) and records the outcome.
* :func:`method_handlers`, :func:`add_service` — the grpc handlers of a service built from its
  descriptor, with per-method (de)serializers overridable: the KVStore service serves Put/Get as
  raw frames (:mod:`kvstore.frames`) and every other method with the generated protobuf classes.
  Requests are parsed by :func:`parser`, which never raises: bytes that are not a valid request
  become :class:`Malformed`, and the handler answers it through :meth:`RpcRunner.run` (so after
  authentication, counted like any call) with INVALID_ARGUMENT. Why: an exception inside a grpc
  deserializer answered INTERNAL "Exception deserializing request!" before anything else ran
  (no authentication, no metrics, a traceback in the log).
* With ``calls`` (:class:`~kvstore.server_config.CallLimits`) the runner also admits calls
  (:class:`~kvstore.service_limits.CallLimiter`) and cancels idle streams
  (:class:`~kvstore.service_limits.IdleWatch`), installed on the stream handlers by
  :meth:`RpcRunner.guard`: see :mod:`kvstore.service_limits`.
* :meth:`RpcRunner.refuse_queued` — a call past the server's workers + ``limits.max_queued_calls``
  (:class:`~kvstore.service_limits.QueueBound`), refused with RESOURCE_EXHAUSTED and counted
  as any other limit's refusal.
* :func:`known_namespace` — whether a namespace may still be counted in the metrics (not a
  tenant deleted while the call ran).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from kvstore.audit import Recorder
from kvstore.auth import SHARED_PREFIX, AuthRegistry, Principal, Role, bearer_token
from kvstore.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from kvstore.metrics import ServiceMetrics
from kvstore.service_limits import CallLimiter, CallSlot, IdleWatch
from kvstore.status import GRPC_CONCURRENCY, to_status

if TYPE_CHECKING:
    from kvstore.server_config import CallLimits

log = logging.getLogger(__name__)
#: the status of a call refused past the queue's bound (to_status's, for the limit's error)
_QUEUED_STATUS = to_status(ResourceExhausted(GRPC_CONCURRENCY, resource="limits.max_queued_calls"))[0]


def known_namespace(registry: AuthRegistry, namespace: str) -> bool:
    """Whether ``namespace``'s counts may make metric series (:data:`kvstore.metrics.Known`):
    a shared namespace (deleting its blocks leaves it), or a principal's own namespace while
    the principal exists (marked for deletion, it is none). Takes no lock."""
    if namespace.startswith(SHARED_PREFIX):
        return True
    try:
        registry.get(namespace)
    except NotFound:
        return False
    return True


class _Call:
    """What a stream handler tells :meth:`RpcRunner.run` about its call: a stream counts as
    one; a server stream (``hold``) keeps its slot until its handler ends."""

    __slots__ = ("hold", "slot")

    def __init__(self, hold: bool) -> None:
        self.hold = hold
        self.slot: CallSlot | None = None


#: (request_deserializer, response_serializer); None = pass bytes through unchanged
Codec = tuple[Callable[[bytes], Any] | None, Callable[[Any], bytes] | None]


class Malformed:
    """What :func:`parser` gives the handler in place of a request that did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def parser(cls: type[Message]) -> Callable[[bytes], Any]:
    """A grpc request deserializer of ``cls`` that never raises: bytes that are not a valid
    ``cls`` (corrupt wire format, a string field that is not UTF-8) come back as
    :class:`Malformed`, which the handlers of :func:`method_handlers` refuse with
    INVALID_ARGUMENT once the caller is authenticated (as :func:`kvstore.frames.decoder` does
    for Put frames)."""
    parse = cls.FromString

    def decode(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:  # a string field that is not UTF-8 too
            return Malformed(f"malformed {cls.DESCRIPTOR.name}: {exc}")

    return decode


class RpcRunner:
    """Authentication, timing, error mapping and (for Admin) auditing around one plain call;
    with ``calls``, admission (:class:`CallLimiter`) and idle streams (:class:`IdleWatch`,
    installed on the stream handlers by :meth:`guard`)."""

    def __init__(self, registry: AuthRegistry, metrics: ServiceMetrics | None,
                 drop_epoch: Callable[[], int] | None = None, calls: CallLimits | None = None) -> None:
        self.registry, self.metrics = registry, metrics
        self._drop_epoch = drop_epoch
        self._known = partial(known_namespace, registry)
        self.limiter: CallLimiter | None = None
        self.idle: IdleWatch | None = None
        if calls is not None:
            self.limiter = CallLimiter(calls.calls_per_principal, calls.streams_per_principal, calls.tenant_calls)
            self.idle = IdleWatch(calls.stream_idle_s)
        self._calls: dict[Any, _Call] = {}  # context -> what its stream handler said
        #: "/package.Service/Method" -> the name its calls are counted under (method_handlers)
        self.names: dict[str, str] = {}
        self._running = 0  # calls inside run(): drain() waits for them
        self._ended = threading.Condition()

    def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the calls inside :meth:`run` to end (after the
        server stopped: grpc cancelled them, their threads go on); returns how many still run."""
        with self._ended:
            self._ended.wait_for(lambda: not self._running, timeout)
            return self._running

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
            audit: Recorder | None = None, *, stream: bool = False, refused: Recorder | None = None) -> Any:
        """Authenticate, call ``fn(principal)``, map errors; with ``audit``, require the admin
        role and record the action and its outcome (failed authentications included, as
        principal ``?``). ``refused``: a data-plane action that records itself (a Delete)
        records here only a failed authentication, as principal ``?`` (its attempt left no
        trace, where an Admin call's did). ``stream``: ``fn`` opens a server stream that
        :meth:`relay` sends, and relay records the call's status and latency when the stream
        ends; run records only a failure to open it."""
        start = time.perf_counter()
        code = "OK"
        # NOTE: a stream's outcome was recorded here, once its header existed: its latency left
        # out sending the data, and a stream that failed part-way counted as OK
        observe = True
        who = "?"
        slot = None
        with self._ended:
            self._running += 1
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
            observe = not stream  # opened: relay records how it ends
            return result
        except KVStoreError as exc:
            status, message = to_status(exc)
            code = status.name
            if audit is not None:
                _audit_quietly(audit, who, code, name)
            elif refused is not None and who == "?":
                _audit_quietly(refused, who, code, name)
            if self.metrics is not None and isinstance(exc, ResourceExhausted):
                self.metrics.rejected(exc.resource, self._known)
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
            if self.metrics is not None and observe:
                self.metrics.observe(name, code, time.perf_counter() - start)
            with self._ended:
                self._running -= 1
                self._ended.notify_all()

    def count_queued(self, method: str) -> None:
        """Count a call of ``method`` (its path) refused past the workers +
        ``limits.max_queued_calls`` calls held (:class:`~kvstore.service_limits.QueueBound`): a
        rejection of that limit, and a request of its RPC for a method of ours."""
        if self.metrics is not None:
            self.metrics.rejected("limits.max_queued_calls")
            name = self.names.get(method)
            if name is not None:  # else a health check or reflection: counted nowhere else
                self.metrics.observe(name, _QUEUED_STATUS.name, 0.0)

    @staticmethod
    def abort_queued(context: grpc.ServicerContext) -> None:
        """End a call :meth:`count_queued` counted, in grpc's own words (what grpc answered when
        its bound refused it, and what clients read as that limit:
        :func:`kvstore.status.from_rpc_error`)."""
        context.abort(_QUEUED_STATUS, GRPC_CONCURRENCY)

    def relay(self, name: str, context: grpc.ServicerContext, frames: Iterator[Any], start: float) -> Iterator[Any]:
        """The items of a response stream that :meth:`run` opened (``stream=True``; ``start``:
        when the call began), and the call's status and latency recorded once, when the stream
        ends: OK at its end; a typed error raised while producing the items aborts the stream
        with its status (it ended as UNKNOWN); CANCELLED when grpc stops asking for items (the
        client went away, or an idle stream was cut); INTERNAL for any other error."""
        # NOTE: errors raised here went unrecorded: a stream failed part-way counted as OK
        code = "CANCELLED"  # closed before its end
        try:
            yield from frames
            code = "OK"
        except KVStoreError as exc:
            status, message = to_status(exc)
            code = status.name
            if self.metrics is not None and isinstance(exc, ResourceExhausted):
                self.metrics.rejected(exc.resource, self._known)
            context.abort(status, message)
        except Exception:
            if context.code() is not None or not context.is_active():
                raise
            code = "INTERNAL"
            log.exception("%s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            if self.metrics is not None:
                self.metrics.observe(name, code, time.perf_counter() - start)

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
    except Exception:  # NOTE: a TypeError here replaced the call's own status with UNKNOWN
        log.exception("%s by %s failed with %s, and its audit record was not written", name, who, code)


_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refusing_malformed(behavior: Callable[..., Any], name: str, rpc: RpcRunner | None,
                        admin_only: bool) -> Callable[..., Any]:
    """``behavior`` of a method with one request, a :class:`Malformed` request refused: through
    ``rpc.run`` (authenticated first, counted under ``name``; with ``admin_only`` a non-admin
    is refused as by the method itself) with INVALID_ARGUMENT."""

    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        if not isinstance(request, Malformed):
            return behavior(request, context)

        def refuse(p: Principal) -> Any:
            if admin_only and p.role is not Role.ADMIN:
                raise PermissionDenied(f"{p.name!r} is not an admin")
            raise InvalidArgument(request.error)

        if rpc is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return rpc.run(name, context, refuse)

    return handle


def method_handlers(service: ServiceDescriptor, servicer: Any, overrides: Mapping[str, Codec] | None = None,
                    *, prefix: str = "", admin_only: bool = False) -> dict[str, grpc.RpcMethodHandler]:
    """One handler per method of ``service``, calling ``servicer.<Method>``; a request that does
    not parse (:func:`parser`) is refused, named ``prefix + Method`` in the metrics (as the
    servicer names its calls) and, with ``admin_only``, refused to a non-admin first."""
    overrides = overrides or {}
    unknown = set(overrides) - {m.name for m in service.methods}
    assert not unknown, f"overrides name unknown methods: {sorted(unknown)}"
    handlers = {}
    for m in service.methods:
        codec = overrides.get(m.name)
        if codec is None:
            codec = (parser(GetMessageClass(m.input_type)), GetMessageClass(m.output_type).SerializeToString)
        factory = _FACTORIES[(m.client_streaming, m.server_streaming)]
        behavior = getattr(servicer, m.name)
        rpc = getattr(servicer, "rpc", None)
        if not isinstance(rpc, RpcRunner):
            rpc = None
        if not m.client_streaming:
            behavior = _refusing_malformed(behavior, prefix + m.name, rpc, admin_only)
        if rpc is not None:  # streams: counted, held and watched (see RpcRunner.guard)
            behavior = rpc.guard(behavior, m.client_streaming, m.server_streaming)
            rpc.names[f"/{service.full_name}/{m.name}"] = prefix + m.name
        handlers[m.name] = factory(behavior, request_deserializer=codec[0], response_serializer=codec[1])
    return handlers


def add_service(server: grpc.Server, service: ServiceDescriptor, servicer: Any,
                overrides: Mapping[str, Codec] | None = None, *, prefix: str = "",
                admin_only: bool = False) -> None:
    """Register ``servicer`` for ``service`` on ``server`` (as the generated add_* functions do,
    with requests parsed by :func:`parser`; ``prefix``, ``admin_only``: see
    :func:`method_handlers`)."""
    handlers = method_handlers(service, servicer, overrides, prefix=prefix, admin_only=admin_only)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
