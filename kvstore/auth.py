"""Principals, bearer tokens and namespace rules of the service.

Roles:

* ``tenant`` — reads and writes its own namespace (named after the tenant); reads the shared
  namespaces it was granted.
* ``publisher`` — writes (and reads) the shared namespaces it publishes; has no own namespace.
* ``admin`` — the Admin service only; no data-plane access.

Shared namespaces are named ``shared:<name>``; tenant names never contain ``:`` so the two can
never collide. A request names a namespace only to reach a shared one: the caller's own
namespace always comes from its token.

Tokens are ``kvs_`` + 43 url-safe characters (256 random bits) and are shown once; the registry
keeps only their SHA-256 (a fast hash is enough for a high-entropy secret). The registry is a
JSON file (mode 0600) in the store directory, rewritten atomically on every change; it also keeps
the per-tenant policies set through the Admin service so they survive restarts, and the per-model
ones (a model fingerprint's TTL, under ``"model_policies"``, only when there is one).

Errors: a missing or unknown token -> ``Unauthenticated``; a role or namespace the caller may not
use -> ``PermissionDenied``; unknown names -> ``NotFound``; bad names -> ``InvalidArgument``.

Calls that outlive a change of rights: a token is checked when a call starts, but a Put stream
(or a shared-memory put, or a Get stream) may run on long after. The registry keeps an **auth
epoch**, advanced by every change of principals (create, token rotation, deletion, grant or
revoke); :meth:`AuthRegistry.authenticate` stamps it on the principal
(:attr:`Principal.auth_epoch`). Before a put commits, the service re-validates the principal
under :meth:`AuthRegistry.holding` (an int comparison while nothing changed): a token rotated
or a principal deleted since -> ``Unauthenticated``, the namespace written no longer granted ->
``PermissionDenied``, and nothing of the call is stored. Changes wait for the commits holding
the registry to end, so once a rotation or revocation has returned, no call authenticated
before it stores anything. (Before, such a stream committed its blocks after the rotation.)

Deletion in two steps, each saved: :meth:`AuthRegistry.begin_delete` marks a principal as being
deleted (its token refused from then on, the mark saved in the file under ``"deleting"``), the
caller drops its data and destroys its data key, and :meth:`AuthRegistry.end_delete` removes
the principal. A principal being deleted is no principal to :meth:`~AuthRegistry.get`,
:meth:`~AuthRegistry.list` or :meth:`~AuthRegistry.authenticate`; :meth:`~AuthRegistry.deleting`
names them, so that the next start (or a later call) finishes what a crash interrupted. Why: the
principal was removed (saved) before its data was gone for good; killed in between, a restart
found no principal but the tenant's blocks and key, and a tenant created later under the name
read them. Only a mark says a deletion is under way: a name with data and no principal at all
(a principals file lost, to be restored from a backup) is left alone.

The first admin's token: :meth:`AuthRegistry.ensure_admin` creates the admin and records, in the
same save, that its token was not shown yet (``"token_unshown"`` in the file); the caller shows
it, then calls :meth:`AuthRegistry.admin_token_shown`. A start that finds the mark (the one
before died in between: its token was never seen, and no token can make another without an
admin's) gives that admin a new token to show. Why: the admin was saved, then the start died
before printing its token (kill -9, a closed terminal), and every later start saw an admin and
printed none: no admin token could be had at all.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvstore.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    KVStoreError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)

SHARED_PREFIX = "shared:"
ADMIN_NAME = "admin"
#: ``\Z``, not ``$``: ``$`` also matches before a trailing newline, which let ``"acme\n"`` be a
#: principal distinct from ``acme`` (and 63 characters plus ``"\n"`` pass the limit)
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}\Z")
TOKEN_PREFIX = "kvs_"


class AlreadyExists(KVStoreError):
    code = "ALREADY_EXISTS"


class Role(str, enum.Enum):
    TENANT = "tenant"
    PUBLISHER = "publisher"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. ``namespaces`` are read grants (tenant) or published (publisher)."""

    name: str
    role: Role
    namespaces: tuple[str, ...] = ()
    created: float = 0.0
    epoch: int | None = None
    """The Store's ``drop_epoch`` read just before this call's token was checked (set by the
    service): a put that outlives the deletion of its tenant then fails instead of storing."""
    auth_epoch: int | None = None
    """The registry's auth epoch read just before this call's token was checked (set by
    :meth:`AuthRegistry.authenticate`; None: not checked, e.g. built in-process): see
    :meth:`AuthRegistry.check`."""

    @property
    def readable(self) -> frozenset[str]:
        if self.role is Role.TENANT:
            return frozenset((self.name, *self.namespaces))
        if self.role is Role.PUBLISHER:
            return frozenset(self.namespaces)
        return frozenset()

    @property
    def writable(self) -> frozenset[str]:
        if self.role is Role.TENANT:
            return frozenset((self.name,))
        if self.role is Role.PUBLISHER:
            return frozenset(self.namespaces)
        return frozenset()

    @property
    def default_namespace(self) -> str | None:
        if self.role is Role.TENANT:
            return self.name
        if self.role is Role.PUBLISHER and len(self.namespaces) == 1:
            return self.namespaces[0]
        return None


@dataclass(frozen=True, slots=True)
class AdminToken:
    """The first admin's token, for a start to show (:meth:`AuthRegistry.ensure_admin`)."""

    name: str
    token: str
    replaced: bool
    """The admin existed already, its token never shown (a start died first): this one
    replaces it. False: the admin was created now."""


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """Operator policy of one tenant (or shared namespace). ``quota_bytes``: tier name -> bytes."""

    ttl_s: float | None = None
    quota_bytes: dict[str, int] = field(default_factory=dict)
    priority: int = 0


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """Operator policy of one model fingerprint (``Store.set_model_ttl``): its TTL, None: none."""

    ttl_s: float | None = None


def check_name(name: str) -> str:
    """Validate a principal name (lower-case, digits, ``_.-``, at most 63 characters)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        shown = repr(name[:80]) + (f"…({len(name)} chars)" if len(name) > 80 else "") \
            if isinstance(name, str) else type(name).__name__
        raise InvalidArgument(
            f"bad name {shown}: use 1-63 characters of a-z 0-9 _ . - starting with a letter or digit"
        )
    return name


def check_shared(namespace: str) -> str:
    """Validate a shared namespace name (``shared:<name>``)."""
    if not isinstance(namespace, str) or not namespace.startswith(SHARED_PREFIX):
        raise InvalidArgument(f"shared namespaces are named '{SHARED_PREFIX}<name>', got {namespace!r}")
    check_name(namespace[len(SHARED_PREFIX):])
    return namespace


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The token of an ``authorization: Bearer <token>`` metadata entry, or Unauthenticated."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
            return token.strip()
    raise Unauthenticated("missing authorization metadata (Bearer token)")


def resolve_namespace(principal: Principal, requested: str, *, write: bool) -> str:
    """The namespace a data-plane call acts on.

    ``requested == ""`` means the caller's own namespace (a publisher with exactly one shared
    namespace gets that one). Anything else must be a shared namespace the caller may read (or
    write, when ``write``); another tenant's namespace is never reachable.
    """
    if principal.role is Role.ADMIN:
        raise PermissionDenied("admin tokens have no data-plane access; use a tenant token")
    if not requested:
        ns = principal.default_namespace
        if ns is None:
            raise InvalidArgument("this publisher publishes several namespaces: name one")
        return ns
    allowed = principal.writable if write else principal.readable
    if requested in allowed:
        return requested
    verb = "write" if write else "read"
    raise PermissionDenied(f"namespace {requested!r} is not granted to {principal.name!r} for {verb}")


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _load(path: Path) -> dict:
    if not path.exists():
        return {"principals": {}, "policies": {}}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class _Gate:
    """A readers-writer lock that lets a waiting writer in first: calls about to commit hold it
    shared (briefly), changes of rights exclusive. Not re-entrant: a holder must not take it
    again (a writer waiting in between would deadlock them)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writing = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writing and not self._waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: not self._writing and not self._readers)
            finally:
                self._waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class AuthRegistry:
    """Principals (with hashed tokens) and tenant policies, persisted in ``path``. Thread-safe."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float]) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._principals: dict[str, Principal] = {}
        self._hashes: dict[str, str] = {}  # token hash -> name
        self._epoch = 0  # the auth epoch: advanced after every change of principals
        self._token_epoch: dict[str, int] = {}  # name -> the epoch its current token was set at
        self._deleting: dict[str, Principal] = {}  # marked by begin_delete: no token, data going
        self._unshown: str | None = None  # the admin whose token no start has shown yet
        self._gate = _Gate()
        try:
            data = _load(self.path)
            for name, rec in data.get("principals", {}).items():
                self._principals[name] = Principal(
                    name=name, role=Role(rec["role"]), namespaces=tuple(rec.get("namespaces", ())),
                    created=float(rec.get("created", 0.0)),
                )
                self._hashes[rec["token_sha256"]] = name
            for name, rec in data.get("deleting", {}).items():
                self._deleting[name] = Principal(
                    name=name, role=Role(rec["role"]), namespaces=tuple(rec.get("namespaces", ())),
                    created=float(rec.get("created", 0.0)),
                )
            self._policies: dict[str, TenantPolicy] = {
                name: TenantPolicy(ttl_s=p.get("ttl_s"), quota_bytes=dict(p.get("quota_bytes", {})),
                                   priority=int(p.get("priority", 0)))
                for name, p in data.get("policies", {}).items()
            }
            self._model_policies: dict[bytes, ModelPolicy] = {
                bytes.fromhex(fp): ModelPolicy(ttl_s=p.get("ttl_s"))
                for fp, p in data.get("model_policies", {}).items()
            }
            unshown = data.get("token_unshown")
            if unshown is not None and not isinstance(unshown, str):
                raise TypeError(f"token_unshown is {type(unshown).__name__}, not a name")
            self._unshown = unshown
        except OSError as exc:  # NOTE: a directory or an unreadable file was called "damaged"
            raise FailedPrecondition(f"cannot read the principals file {self.path}: "
                                     f"{exc.strerror or exc}") from None
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # NOTE: a damaged file fails closed, by name (it was a traceback): no token works
            # without it, and a new admin would not bring back the tenants' tokens
            raise IntegrityError(f"the principals file {self.path} is damaged ({type(exc).__name__}: "
                                 f"{exc}): restore it from a backup") from None

    # -- persistence ------------------------------------------------------------------------
    def _save(self) -> None:
        by_name = {name: h for h, name in self._hashes.items()}
        data = {
            "principals": {
                name: {"role": p.role.value, "namespaces": list(p.namespaces), "created": p.created,
                       "token_sha256": by_name[name]}
                for name, p in sorted(self._principals.items())
            },
            "policies": {name: asdict(p) for name, p in sorted(self._policies.items())},
        }
        if self._deleting:  # NOTE: only then: a file without deletions reads as it always did
            data["deleting"] = {
                name: {"role": p.role.value, "namespaces": list(p.namespaces), "created": p.created}
                for name, p in sorted(self._deleting.items())
            }
        if self._model_policies:  # NOTE: only then, as "deleting"
            data["model_policies"] = {fp.hex(): asdict(p) for fp, p in sorted(self._model_policies.items())}
        if self._unshown is not None:  # NOTE: only then, as "deleting"
            data["token_unshown"] = self._unshown
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            _sync_dir(self.path.parent)  # NOTE: the rename itself survives a power loss
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise FailedPrecondition(f"the principals file {self.path} could not be saved ({exc}); "
                                     "nothing was changed") from None

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """A change of principals, tokens or policies: saved when the block ends, or undone in
        memory when it raises or the save fails (a deletion or rotation that memory had made
        and the file had not would bring the old token back at the next start)."""
        before = (dict(self._principals), dict(self._hashes), dict(self._policies), dict(self._token_epoch),
                  dict(self._deleting), self._unshown, dict(self._model_policies))
        try:
            yield
            self._save()
        except BaseException:
            (self._principals, self._hashes, self._policies, self._token_epoch, self._deleting,
             self._unshown, self._model_policies) = before
            raise

    @contextmanager
    def _changing_rights(self) -> Iterator[None]:
        """A change of principals (tokens, grants, existence): :meth:`_changing`, made while no
        call holds the registry (:meth:`holding`), and the auth epoch advanced after it.

        NOTE: advanced AFTER the change: :meth:`authenticate` reads the epoch before the token,
        so a call that read the new epoch finds the new tokens and grants; advanced before, a
        call could read the new epoch with the old token and pass every later check."""
        with self._gate.exclusive(), self._lock:
            with self._changing():
                yield
            self._epoch += 1

    @property
    def epoch(self) -> int:
        """The auth epoch: advanced after every change of principals, tokens or grants."""
        return self._epoch

    # -- authentication ---------------------------------------------------------------------
    def authenticate(self, token: str) -> Principal:
        """The principal of ``token``, stamped with the auth epoch read before the token was
        checked (:attr:`Principal.auth_epoch`)."""
        epoch = self._epoch  # NOTE: first (see _changing_rights)
        name = self._hashes.get(hash_token(token))
        principal = self._principals.get(name) if name is not None else None
        if principal is None:  # NOTE: .get: a principal deleted meanwhile was a KeyError (INTERNAL)
            raise Unauthenticated("invalid token")
        return replace(principal, auth_epoch=epoch)

    def check(self, principal: Principal, namespace: str | None = None, *, write: bool = False) -> None:
        """Raise when ``principal``, authenticated at its ``auth_epoch``, has since lost the
        right to go on: its token was rotated or it was deleted (``Unauthenticated``), or
        ``namespace`` is no longer granted to it for reading (or writing, when ``write``)
        (``PermissionDenied``). A comparison of two ints while nothing changed. For a check
        that a commit must not outrun, use :meth:`holding`."""
        if principal.auth_epoch is None or principal.auth_epoch == self._epoch:
            return
        name = principal.name
        tail = ": nothing was stored" if write else ""
        current = self._principals.get(name)
        if current is None:
            raise Unauthenticated(f"principal {name!r} was deleted while this call ran{tail}")
        if self._token_epoch.get(name, 0) > principal.auth_epoch:
            raise Unauthenticated(f"the token of {name!r} was rotated or replaced while this call ran{tail}; "
                                  "call again with the current token")
        if current.role is not principal.role:
            raise PermissionDenied(f"the role of {name!r} changed while this call ran{tail}")
        if namespace is not None and namespace not in (current.writable if write else current.readable):
            verb = "write" if write else "read"
            raise PermissionDenied(f"namespace {namespace!r} was revoked from {name!r} for {verb} while this "
                                   f"call ran{tail}")

    @contextmanager
    def holding(self, principal: Principal, namespace: str | None = None, *,
                write: bool = False) -> Iterator[None]:
        """:meth:`check`, and no change of principals until the block ends: wrap a commit in it
        so that a rotation or revocation either comes before the check (the call fails) or
        after the commit. Keep the block short (changes wait for it) and never nest it."""
        with self._gate.shared():
            self.check(principal, namespace, write=write)
            yield

    # -- principals ---------------------------------------------------------------------------
    def _check_namespaces(self, role: Role, namespaces: Sequence[str]) -> tuple[str, ...]:
        if role is Role.ADMIN and namespaces:
            raise InvalidArgument("admins have no namespaces")
        if role is Role.PUBLISHER and not namespaces:
            raise InvalidArgument("a publisher needs at least one shared namespace to publish")
        return tuple(sorted({check_shared(ns) for ns in namespaces}))

    def _set_token(self, name: str) -> str:
        token = new_token()
        self._token_epoch[name] = self._epoch + 1  # the epoch _changing_rights advances to
        hashes = {h: n for h, n in self._hashes.items() if n != name}
        hashes[hash_token(token)] = name
        self._hashes = hashes  # NOTE: swapped whole: authenticate reads it without the lock
        return token

    def create(self, name: str, role: Role = Role.TENANT, namespaces: Sequence[str] = ()) -> str:
        """Create a principal and return its token (shown once)."""
        check_name(name)
        ns = self._check_namespaces(role, namespaces)
        with self._changing_rights():
            return self._add(name, role, ns)

    def _add(self, name: str, role: Role, ns: tuple[str, ...]) -> str:
        """Add a principal; returns its token. Caller is in :meth:`_changing_rights`."""
        if name in self._principals:
            raise AlreadyExists(f"principal {name!r} already exists")
        if name in self._deleting:  # NOTE: its data may still be there: finish the deletion first
            raise FailedPrecondition(f"principal {name!r} is being deleted: delete it again to finish "
                                     "the deletion, then create it")
        self._principals[name] = Principal(name, role, ns, created=self._clock())
        return self._set_token(name)

    def rotate(self, name: str) -> str:
        """Replace a principal's token; the old one stops working at once. The caller is
        shown the new one: an admin's token not shown yet (:meth:`ensure_admin`) is shown now."""
        with self._changing_rights():
            self.get(name)
            token = self._set_token(name)
            if self._unshown == name:
                self._unshown = None
        return token

    def delete(self, name: str) -> Principal:
        """Remove a principal at once (:meth:`begin_delete` and :meth:`end_delete` in one):
        for principals that hold no data."""
        with self._changing_rights():
            p = self._mark(name)
            self._deleting.pop(name, None)
            self._policies.pop(name, None)
        return p

    def _mark(self, name: str) -> Principal:
        p = self.get(name)
        if p.role is Role.ADMIN and sum(q.role is Role.ADMIN for q in self._principals.values()) == 1:
            raise FailedPrecondition("cannot delete the last admin")
        del self._principals[name]
        self._hashes = {h: n for h, n in self._hashes.items() if n != name}
        self._token_epoch.pop(name, None)
        self._deleting[name] = p
        if self._unshown == name:
            self._unshown = None
        return p

    def begin_delete(self, name: str) -> Principal:
        """Mark ``name`` as being deleted, saved: its token is refused from now on (a call
        authenticated before fails its next :meth:`check`), and it is no principal to
        :meth:`get` or :meth:`list`; it stays in :meth:`deleting` until :meth:`end_delete`.
        Returns the principal as it was. A name marked already is returned as it is (a
        deletion run again). NotFound for a name that is neither."""
        if name in self._deleting:
            return self._deleting[name]
        with self._changing_rights():
            return self._mark(name)

    def end_delete(self, name: str) -> None:
        """Remove a principal marked by :meth:`begin_delete` (with its policy), saved; call it
        once its data and data key are gone. No-op for a name not marked."""
        if name not in self._deleting:
            return
        with self._lock, self._changing():
            self._deleting.pop(name, None)
            self._policies.pop(name, None)

    def deleting(self) -> dict[str, Principal]:
        """The principals marked as being deleted, by name (a deletion left unfinished)."""
        return dict(self._deleting)

    def grant(self, name: str, namespace: str, *, revoke: bool = False) -> Principal:
        """Add (or remove) a shared namespace to a tenant's read grants / a publisher's list."""
        check_shared(namespace)
        with self._changing_rights():
            p = self.get(name)
            if p.role is Role.ADMIN:
                raise InvalidArgument("admins have no namespaces")
            ns = set(p.namespaces)
            ns.discard(namespace) if revoke else ns.add(namespace)
            updated = replace(p, namespaces=self._check_namespaces(p.role, sorted(ns)))
            self._principals[name] = updated
        return updated

    def get(self, name: str) -> Principal:
        p = self._principals.get(name)
        if p is None:
            raise NotFound(f"no principal named {name!r}")
        return p

    def list(self) -> list[Principal]:
        return sorted(self._principals.values(), key=lambda p: p.name)

    def list_all(self) -> tuple[list[Principal], dict[str, Principal]]:
        """(:meth:`list`, :meth:`deleting`) read at one moment: a principal is in one or the
        other. NOTE: read by two calls, a deletion marked between them listed its principal
        twice (live and deleting)."""
        with self._lock:
            return self.list(), self.deleting()

    def ensure_admin(self) -> AdminToken | None:
        """The first admin's token for the caller to show, then to confirm with
        :meth:`admin_token_shown`: the ``admin`` principal created when no admin exists, or a
        new token for the admin whose token was never shown (the start that created it died
        before showing it; its token stops working); else None. Saved with the mark that the
        token is not shown yet, so a crash before :meth:`admin_token_shown` leaves the next
        start to show one."""
        has_admin = any(p.role is Role.ADMIN for p in self._principals.values())
        if self._unshown is None and has_admin:
            return None  # NOTE: a normal start: nothing written
        with self._changing_rights():
            name, self._unshown = self._unshown, None
            if name is not None and name in self._principals:
                token = AdminToken(name, self._set_token(name), replaced=True)
            elif any(p.role is Role.ADMIN for p in self._principals.values()):
                return None  # the mark outlived its admin (not saved otherwise): drop it
            else:
                token = AdminToken(ADMIN_NAME, self._add(ADMIN_NAME, Role.ADMIN, ()), replaced=False)
            self._unshown = token.name
        return token

    def admin_token_shown(self, token: AdminToken) -> None:
        """Record (saved) that ``token`` from :meth:`ensure_admin` was shown: no later start
        replaces it. Call it only once it was shown."""
        if self._unshown != token.name:
            return
        with self._lock, self._changing():
            if self._unshown == token.name:
                self._unshown = None

    # -- policies -----------------------------------------------------------------------------
    def policy(self, namespace: str) -> TenantPolicy:
        return self._policies.get(namespace, TenantPolicy())

    def policies(self) -> dict[str, TenantPolicy]:
        return dict(self._policies)

    def set_policy(self, namespace: str, policy: TenantPolicy) -> TenantPolicy:
        """Record a policy for a tenant or shared namespace that exists."""
        with self._lock, self._changing():
            if namespace.startswith(SHARED_PREFIX):
                check_shared(namespace)
            else:
                self.get(namespace)
            self._policies[namespace] = policy
        return policy

    def model_policy(self, fingerprint: bytes) -> ModelPolicy:
        return self._model_policies.get(fingerprint, ModelPolicy())

    def model_policies(self) -> dict[bytes, ModelPolicy]:
        return dict(self._model_policies)

    def set_model_policy(self, fingerprint: bytes, policy: ModelPolicy) -> ModelPolicy:
        """Record the policy of a model fingerprint (an empty one removes its entry), saved."""
        with self._lock, self._changing():
            if policy == ModelPolicy():
                self._model_policies.pop(fingerprint, None)
            else:
                self._model_policies[fingerprint] = policy
        return policy
