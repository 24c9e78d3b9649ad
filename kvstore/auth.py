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
the per-tenant policies set through the Admin service so they survive restarts.

Errors: a missing or unknown token -> ``Unauthenticated``; a role or namespace the caller may not
use -> ``PermissionDenied``; unknown names -> ``NotFound``; bad names -> ``InvalidArgument``.
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
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
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
class TenantPolicy:
    """Operator policy of one tenant (or shared namespace). ``quota_bytes``: tier name -> bytes."""

    ttl_s: float | None = None
    quota_bytes: dict[str, int] = field(default_factory=dict)
    priority: int = 0


def check_name(name: str) -> str:
    """Validate a principal name (lower-case, digits, ``_.-``, at most 63 characters)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"bad name {name!r}: use 1-63 characters of a-z 0-9 _ . - starting with a letter or digit"
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


class AuthRegistry:
    """Principals (with hashed tokens) and tenant policies, persisted in ``path``. Thread-safe."""

    def __init__(self, path: str | Path, *, clock: Callable[[], float]) -> None:
        self.path = Path(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._principals: dict[str, Principal] = {}
        self._hashes: dict[str, str] = {}  # token hash -> name
        try:
            data = _load(self.path)
            for name, rec in data.get("principals", {}).items():
                self._principals[name] = Principal(
                    name=name, role=Role(rec["role"]), namespaces=tuple(rec.get("namespaces", ())),
                    created=float(rec.get("created", 0.0)),
                )
                self._hashes[rec["token_sha256"]] = name
            self._policies: dict[str, TenantPolicy] = {
                name: TenantPolicy(ttl_s=p.get("ttl_s"), quota_bytes=dict(p.get("quota_bytes", {})),
                                   priority=int(p.get("priority", 0)))
                for name, p in data.get("policies", {}).items()
            }
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
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
        before = (dict(self._principals), dict(self._hashes), dict(self._policies))
        try:
            yield
            self._save()
        except BaseException:
            self._principals, self._hashes, self._policies = before
            raise

    # -- authentication ---------------------------------------------------------------------
    def authenticate(self, token: str) -> Principal:
        name = self._hashes.get(hash_token(token))
        if name is None:
            raise Unauthenticated("invalid token")
        return self._principals[name]

    # -- principals ---------------------------------------------------------------------------
    def _check_namespaces(self, role: Role, namespaces: Sequence[str]) -> tuple[str, ...]:
        if role is Role.ADMIN and namespaces:
            raise InvalidArgument("admins have no namespaces")
        if role is Role.PUBLISHER and not namespaces:
            raise InvalidArgument("a publisher needs at least one shared namespace to publish")
        return tuple(sorted({check_shared(ns) for ns in namespaces}))

    def _set_token(self, name: str) -> str:
        token = new_token()
        self._hashes = {h: n for h, n in self._hashes.items() if n != name}
        self._hashes[hash_token(token)] = name
        return token

    def create(self, name: str, role: Role = Role.TENANT, namespaces: Sequence[str] = ()) -> str:
        """Create a principal and return its token (shown once)."""
        check_name(name)
        ns = self._check_namespaces(role, namespaces)
        with self._lock, self._changing():
            if name in self._principals:
                raise AlreadyExists(f"principal {name!r} already exists")
            self._principals[name] = Principal(name, role, ns, created=self._clock())
            token = self._set_token(name)
        return token

    def rotate(self, name: str) -> str:
        """Replace a principal's token; the old one stops working at once."""
        with self._lock, self._changing():
            self.get(name)
            token = self._set_token(name)
        return token

    def delete(self, name: str) -> Principal:
        with self._lock, self._changing():
            p = self.get(name)
            if p.role is Role.ADMIN and sum(q.role is Role.ADMIN for q in self._principals.values()) == 1:
                raise FailedPrecondition("cannot delete the last admin")
            del self._principals[name]
            self._hashes = {h: n for h, n in self._hashes.items() if n != name}
            self._policies.pop(name, None)
        return p

    def grant(self, name: str, namespace: str, *, revoke: bool = False) -> Principal:
        """Add (or remove) a shared namespace to a tenant's read grants / a publisher's list."""
        check_shared(namespace)
        with self._lock, self._changing():
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

    def ensure_admin(self) -> str | None:
        """Create the ``admin`` principal if no admin exists; return its token, else None."""
        if any(p.role is Role.ADMIN for p in self._principals.values()):
            return None
        return self.create(ADMIN_NAME, Role.ADMIN)

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
