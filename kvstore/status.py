"""The one place mapping kvstore's typed errors to gRPC status codes.

Every :class:`kvstore.errors.KVStoreError` names its status in ``code``; the service aborts
with :func:`to_status` and the client turns a failed call back into the same typed error with
:func:`from_rpc_error`, so an in-process caller and a remote one see the same exceptions.

Contract:

* ``to_status(exc)`` -> ``(grpc.StatusCode, message)``. Unknown exceptions map to INTERNAL with
  a generic message (details are logged by the caller, never sent). A long message is cut to
  fit grpc's trailer limit as grpc encodes it (:data:`MAX_DETAILS_WIRE`), else the caller would
  get RESOURCE_EXHAUSTED "Stream removed" in place of the status.
* ``IntegrityError`` never reaches a caller as DATA_LOSS through the data plane (a failed block
  is a miss); if one escapes it maps to DATA_LOSS.
* ``from_rpc_error(err)`` -> the ``KVStoreError`` subclass for the status (``KVStoreError`` with
  ``code`` set for codes without a dedicated class); NOT_FOUND whose message starts with
  ``UnknownRegion.PREFIX`` -> ``UnknownRegion`` (the client registers its region again);
  ``ParentNotStored.PREFIX`` -> ``ParentNotStored``. grpc's own RESOURCE_EXHAUSTED answers
  (too many calls; a message past its size limit) become ``ResourceExhausted`` naming the limit.
"""

from __future__ import annotations

import grpc

from kvstore import errors

#: status name -> the typed error the client raises for it
_ERROR_FOR_CODE: dict[str, type[errors.KVStoreError]] = {
    "INVALID_ARGUMENT": errors.InvalidArgument,
    "NOT_FOUND": errors.NotFound,
    "RESOURCE_EXHAUSTED": errors.ResourceExhausted,
    "PERMISSION_DENIED": errors.PermissionDenied,
    "UNAUTHENTICATED": errors.Unauthenticated,
    "FAILED_PRECONDITION": errors.FailedPrecondition,
    "DATA_LOSS": errors.IntegrityError,
    "UNAVAILABLE": errors.Unavailable,
    "ABORTED": errors.Aborted,
}


def status_code(name: str) -> grpc.StatusCode:
    """The grpc.StatusCode named ``name`` (``"NOT_FOUND"``); INTERNAL for unknown names."""
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


#: the most characters of an error message sent as a status's details: they travel in HTTP/2
#: trailers, which grpc limits (8 KiB by default); a longer one failed the call with
#: RESOURCE_EXHAUSTED "Stream removed" in place of its own status
MAX_DETAILS = 1024
#: the most bytes those details may take on the wire: grpc sends them as UTF-8, percent-encoded
#: outside printable ASCII (a non-ASCII character costs up to 12 bytes). NOTE: 1024 characters
#: of emoji were ~12 KiB there, past the 8 KiB limit: the caller got "Stream removed" instead
MAX_DETAILS_WIRE = 3 * 1024


def _wire_bytes(ch: str) -> int:
    """Bytes ``ch`` takes in a grpc-message trailer (grpc percent-encodes every UTF-8 byte
    outside 0x20..0x7E, and ``%`` itself)."""
    if " " <= ch <= "~":
        return 3 if ch == "%" else 1
    return 3 * len(ch.encode("utf-8", "surrogatepass"))


def _bounded(message: str) -> str:
    """``message``, cut at a character boundary to fit :data:`MAX_DETAILS` characters and
    :data:`MAX_DETAILS_WIRE` bytes once encoded, ending ``…(N chars)`` when cut."""
    if len(message) <= MAX_DETAILS and sum(map(_wire_bytes, message)) <= MAX_DETAILS_WIRE:
        return message
    suffix = f"…({len(message)} chars)"
    room = MAX_DETAILS_WIRE - sum(map(_wire_bytes, suffix))
    cut = message[: MAX_DETAILS - 40]
    for i, ch in enumerate(cut):
        room -= _wire_bytes(ch)
        if room < 0:
            cut = cut[:i]
            break
    return cut + suffix


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Status code and message to send for ``exc``."""
    if isinstance(exc, errors.KVStoreError):
        message = str(exc) or type(exc).__name__
        resource = getattr(exc, "resource", "")
        if resource and resource not in message:
            message = f"{message} (limit: {resource})"
        return status_code(exc.code), _bounded(message)
    return grpc.StatusCode.INTERNAL, "internal error"


#: what grpc answers past ``maximum_concurrent_rpcs`` (the server's workers + max_queued_calls)
GRPC_CONCURRENCY = "Concurrent RPC limit exceeded!"
#: in what grpc answers for a message past its size limit ("SERVER: Received message larger
#: than max (640054 vs. 262144)", "Sent ...", "CLIENT: ..."): the server's and the clients'
#: limit is ``limits.max_message_bytes`` (a client's own ``max_message_bytes``)
_GRPC_TOO_LARGE = "message larger than max"


def from_rpc_error(err: grpc.RpcError) -> errors.KVStoreError:
    """The typed error matching a failed call's status (for the client)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    name = code.name if code is not None else "UNKNOWN"
    message = err.details() if hasattr(err, "details") else str(err)
    cls = _ERROR_FOR_CODE.get(name)
    if cls is None:
        exc = errors.KVStoreError(message or name)  # NOTE: the code is in exc.code (the CLI prints both)
        exc.code = name
        return exc
    if cls is errors.ResourceExhausted:
        if message == GRPC_CONCURRENCY:  # NOTE: grpc's own words named no limit to raise
            return errors.ResourceExhausted(
                "the server is running and queueing as many calls as it takes (grpc: Concurrent RPC "
                "limit exceeded): its workers + limits.max_queued_calls; retry later, or raise them",
                resource="limits.max_queued_calls")
        if _GRPC_TOO_LARGE in message:  # NOTE: named no limit either
            return errors.ResourceExhausted(
                f"a message is larger than the gRPC message size limit, limits.max_message_bytes (the "
                f"client's max_message_bytes for what it receives): send fewer keys or tokens per call, "
                f"or raise it (grpc: {message})", resource="limits.max_message_bytes")
        return errors.ResourceExhausted(message or name)
    if cls is errors.NotFound:
        for sub in (errors.UnknownRegion, errors.ParentNotStored):
            if message.startswith(sub.PREFIX):
                return sub(message)
    return cls(message or name)
