"""Typed errors of kvstore.

Every error a caller can provoke is a subclass of :class:`KVStoreError` and carries a ``code``
naming the gRPC status it maps to; the service maps them in one place (``kvstore.status``).
Expected outcomes (a miss, "no room in this tier") are return values, not exceptions;
``assert`` is kept for our own invariants.
"""

from __future__ import annotations

# The root and the kernels' errors live in kernels.errors, at the bottom of the import order;
# they are re-exported here, where the rest of the hierarchy is.
from kernels.errors import DTypeMismatch, InvalidArgument, KVStoreError, ShapeMismatch


class UnknownTier(InvalidArgument):
    """A tier name that this store does not have."""


class NotFound(KVStoreError, KeyError):
    """A named object (session, tenant) does not exist. Block misses are not errors."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else self.__class__.__name__


class UnknownRegion(NotFound):
    """A shared-memory region id the server does not know for this caller: never registered,
    unregistered, or registered before the server restarted (a restart forgets every region).
    Its message starts with :data:`PREFIX`, which is how a client tells it from other
    NOT_FOUND answers (:func:`kvstore.status.from_rpc_error`)."""

    PREFIX = "unknown region"


class ParentNotStored(NotFound):
    """A put continues from a parent block that is not stored (never put, evicted, expired or
    deleted). Its message starts with :data:`PREFIX` (see :class:`UnknownRegion`)."""

    PREFIX = "the parent block is not stored"


class ResourceExhausted(KVStoreError):
    """A capacity or quota cannot hold the request, even after eviction.

    ``resource`` names the limit that was hit (e.g. ``"hbm"``, ``"quota:tenant-a:nvme"``).
    """

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, resource: str = "") -> None:
        super().__init__(message)
        self.resource = resource


class NVMeWriteFailed(ResourceExhausted):
    """The NVMe tier could not commit a write transaction (a full disk, an I/O error). The
    tier forgot the blocks that transaction would have stored (``lost``: their ``(tenant,
    key)``); the Store drops them, or their NVMe copies, from its index, so that no lookup
    announces a block that is not on disk."""

    def __init__(self, message: str, *, lost: tuple[tuple[str, bytes], ...] = ()) -> None:
        super().__init__(message, resource="nvme disk")
        self.lost = lost


class PermissionDenied(KVStoreError):
    code = "PERMISSION_DENIED"


class Unauthenticated(KVStoreError):
    code = "UNAUTHENTICATED"


class Unavailable(KVStoreError):
    """The sidecar could not be reached (client side: status UNAVAILABLE), or an engine
    integration skips calls while its sidecar keeps failing
    (:class:`kvstore.integrations.guard.SidecarGuard`)."""

    code = "UNAVAILABLE"


class FailedPrecondition(KVStoreError):
    """The store is in a state that does not allow the call (e.g. closed)."""

    code = "FAILED_PRECONDITION"


class EncryptionMismatch(FailedPrecondition):
    """A stored value is encrypted and the reader's ``encrypt`` setting is off, or the reverse
    (:meth:`kvstore.codec.Codec.decode`). A configuration fault, like a wrong master key: the
    stored bytes are fine, so a reader never deletes them for it. NOTE: it was an
    IntegrityError, and one server with ``encrypt=False`` on a shared Redis namespace deleted
    every block the encrypting servers wrote (and a Store reopened with the other setting
    deleted its NVMe blocks)."""


class Aborted(KVStoreError):
    """A call that lost a race with another one and changed nothing; the same call, made
    again, can succeed (e.g. a put into a shared namespace whose blocks an admin dropped
    while it ran: the namespace and the caller's rights are still there)."""

    code = "ABORTED"


class StreamIdle(KVStoreError):
    """A stream moved no message for ``limits.stream_idle_s``; it was cancelled
    (:class:`kvstore.service_limits.IdleWatch`)."""

    code = "DEADLINE_EXCEEDED"


class IntegrityError(KVStoreError):
    """Stored bytes failed authentication or checksum. Internal: callers see a miss."""

    code = "DATA_LOSS"


class KeyUnavailable(IntegrityError):
    """The tenant's data key is gone (tenant deleted): its stored bytes are unreadable."""


__all__ = [
    "Aborted",
    "DTypeMismatch",
    "EncryptionMismatch",
    "FailedPrecondition",
    "IntegrityError",
    "InvalidArgument",
    "KVStoreError",
    "KeyUnavailable",
    "NVMeWriteFailed",
    "NotFound",
    "ParentNotStored",
    "PermissionDenied",
    "ResourceExhausted",
    "ShapeMismatch",
    "StreamIdle",
    "Unauthenticated",
    "Unavailable",
    "UnknownRegion",
    "UnknownTier",
]
