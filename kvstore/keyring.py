"""Envelope keys: a master key, and per-tenant data keys wrapped by it.

Primitives and what each guarantees:

* :func:`load_master_key` finds the 32-byte master key: an explicit value first, then an
  environment variable (hex or base64), then a key file. With ``create=True`` and no key anywhere
  it generates one and writes the key file atomically with mode 0600 (the file is created with
  that mode, so it is never group/world-readable, not even momentarily). A key of the wrong
  length, or a key file with any group/other permission bit set, is refused with
  :class:`~kvstore.errors.InvalidArgument`.
* :class:`Keyring` hands out one random AES-256 data key per tenant. Keys are stored wrapped
  (AES-256-GCM under the master key, the tenant name as associated data, so a wrapped key cannot
  be moved to another tenant) in a caller-supplied ``MutableMapping[str, bytes]`` (the NVMe tier
  supplies an LMDB-backed one; tests use a dict), and cached unwrapped in memory.
  With ``cache_ttl_s`` a cached key is re-read from the backend once it is that old, so when
  the backend is shared (the remote tier's Redis) a key another server destroyed stops being
  used here within ``cache_ttl_s`` (injected ``clock``). :meth:`Keyring.cached` answers from the
  cache alone (the remote tier uses it to send only real backend reads through its breaker).
  :meth:`Keyring.destroy` deletes the wrapped key and the cached copy: every value encrypted
  under it becomes unreadable (crypto-shredding), and ``data_key(tenant, create=False)`` then
  raises :class:`~kvstore.errors.KeyUnavailable`. It is idempotent: a key already gone (another
  server sharing the backend destroyed it first) is no error.
* :meth:`Keyring.condemn` marks a key for destruction, durably (the backend's own write), without
  destroying it yet: the cached copy still works, but a key read from the backend is none
  (:meth:`data_key` makes a new one, or raises KeyUnavailable), :meth:`tenants` leaves it out and
  :meth:`condemned` names it, so whoever opens the backend next finishes the destruction. Why: a
  tenant's deletion commits its blocks' deletions, then destroys the key; killed between the two,
  the key stayed for good (freed pages may hold ciphertext it opens, and a tenant created again
  under the name got it). The mark is the wrapped key itself with another magic, one entry, so
  a key and its mark can never be apart.
* Every data key has a **key id** (:func:`key_id`: 8 bytes of a hash of its wrapped form, which
  is public anyway): :meth:`Keyring.key_id` answers it for the cached copy, so a reader can tell
  a value written under another key (a tenant deleted and created again: a server with the old
  key cached) from a damaged one, and :meth:`Keyring.forget` drops the cached copy so the next
  read goes to the backend.
* A wrong master key is detected when the keyring opens (a check entry under the reserved name
  ``""`` is stored in the backend on first use) and when a wrapped key fails to unwrap; both raise
  :class:`~kvstore.errors.FailedPrecondition` — deliberately NOT an IntegrityError, so a store
  that treats integrity failures as "delete the block" never wipes data because it was opened
  with the wrong key. With ``recheck`` (a backend that can lose entries: the remote tier's
  Redis, restarted empty, flushed or evicting) the check entry is asserted again at every key
  read from or created in the backend (not at cached uses): written when missing (the backend's
  create-if-absent), then read back and unwrapped. Checked at open only, a Redis restarted empty
  let a server with another master key open, write its own check entry and tenant keys, after
  which the original servers read none of its blocks and could not restart. ``where`` names the
  backend in those errors (the Redis namespace).

NOTE: Python cannot reliably zero ``bytes``; destroyed keys leave the in-memory cache but may
linger in freed memory until reused. Crypto-shredding is about the persisted wrapped key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore.errors import FailedPrecondition, InvalidArgument, KeyUnavailable, NVMeWriteFailed
from kvstore.paths import private_file_problem

KEY_BYTES = 32
DEFAULT_ENV_VAR = "KVSTORE_MASTER_KEY"

_WRAP_MAGIC = b"KVK1"
#: a wrapped key marked for destruction (:meth:`Keyring.condemn`): the same bytes, this magic
_CONDEMNED_MAGIC = b"KVX1"
_NONCE_BYTES = 12
_WRAPPED_BYTES = len(_WRAP_MAGIC) + _NONCE_BYTES + KEY_BYTES + 16
_AAD_PREFIX = b"kvstore-keyring-v1\x00"
#: backend entry holding a value wrapped under the master key, to detect a wrong master key.
_CHECK_NAME = ""
_CHECK_PLAINTEXT = b"kvstore master key check v1".ljust(KEY_BYTES, b"\x00")

RandomBytes = Callable[[int], bytes]
KEY_ID_BYTES = 8


def key_id(wrapped: bytes) -> bytes:
    """The id of a data key: 8 bytes of BLAKE2b of its wrapped form (what the backend stores;
    it says nothing of the key itself). Two keys of one tenant get different ids (the wrapping
    nonce alone differs), so a value can carry the id of the key it was written under."""
    return hashlib.blake2b(bytes(wrapped), digest_size=KEY_ID_BYTES, person=b"kvstore-keyid").digest()


# -- master key -------------------------------------------------------------------------------
def _parse_key_text(text: str, source: str) -> bytes:
    """A 32-byte key from hex (64 digits) or base64 (standard or URL-safe) text."""
    text = text.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    try:
        key = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(
            f"master key from {source} is neither hex nor base64 (expected {KEY_BYTES} bytes, "
            f"e.g. 64 hex digits)"
        ) from None
    return _check_key(key, source)


def parse_key_text(text: str, source: str) -> bytes:
    """A 32-byte key from hex (64 digits) or base64 text, as ``$KVSTORE_MASTER_KEY`` takes it;
    InvalidArgument naming ``source`` (never the text) otherwise. The config's ``master_key``
    uses it too (:class:`kvstore.config.StoreConfig`)."""
    return _parse_key_text(text, source)


def _check_key(key: object, source: str) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"master key from {source} must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise InvalidArgument(f"master key from {source} must be {KEY_BYTES} bytes, got {len(key)}")
    return key


def _read_key_file(path: Path) -> bytes:
    if problem := private_file_problem(path):
        raise InvalidArgument(f"master key file {path} {problem}")
    data = path.read_bytes()
    if len(data) == KEY_BYTES:
        return data
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise InvalidArgument(
            f"master key file {path} holds {len(data)} bytes: expected {KEY_BYTES} raw bytes, "
            f"or hex/base64 text"
        ) from None
    return _parse_key_text(text, f"key file {path}")


def _write_key_file(path: Path, key: bytes) -> bytes:
    """Create ``path`` holding ``key`` (hex) with mode 0600; no-clobber, atomic, durable.

    Returns the key now in the file: ours, or the one a concurrent creator wrote first.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # NOTE: a umask can only remove bits; this restores owner rw
        os.write(fd, key.hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and fails instead of replacing a key someone else wrote
    except FileExistsError:
        return _read_key_file(path)
    finally:
        os.unlink(tmp)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return key


def load_master_key(
    explicit: bytes | None = None,
    env_var: str = DEFAULT_ENV_VAR,
    key_file: Path | str | None = None,
    create: bool = False,
    *,
    environ: Mapping[str, str] | None = None,
    random_bytes: RandomBytes = os.urandom,
) -> bytes:
    """The 32-byte master key: ``explicit`` > ``environ[env_var]`` > ``key_file`` > generated.

    ``explicit`` is raw bytes (or hex/base64 text). The environment variable holds hex or base64.
    The key file holds 32 raw bytes or hex/base64 text and must not be group/other accessible.
    With ``create=True`` and no key found, a random key is written to ``key_file`` (mode 0600).
    Raises :class:`InvalidArgument` for a malformed key, a badly-permissioned file, or no key
    found with ``create=False`` (or with nowhere to create one).
    """
    if explicit is not None:
        if isinstance(explicit, str):
            return _parse_key_text(explicit, "the explicit setting")
        return _check_key(explicit, "the explicit setting")
    env = os.environ if environ is None else environ
    text = env.get(env_var) if env_var else None
    if text:
        return _parse_key_text(text, f"${env_var}")
    path = Path(key_file) if key_file is not None else None
    if path is not None and os.path.lexists(path):
        return _read_key_file(path)
    if not create or path is None:
        raise InvalidArgument(
            f"no master key: pass one explicitly, set ${env_var}"
            + (f", or create the key file {path}" if path is not None else ", or name a key file")
        )
    return _write_key_file(path, _check_key(random_bytes(KEY_BYTES), "the random generator"))


# -- keyring ----------------------------------------------------------------------------------
def _condemned(wrapped: bytes) -> bool:
    """Whether a backend entry is a key marked for destruction (:meth:`Keyring.condemn`)."""
    return bytes(wrapped[: len(_CONDEMNED_MAGIC)]) == _CONDEMNED_MAGIC


def _check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str) or not tenant:
        raise InvalidArgument("tenant must be a non-empty string")
    return tenant


class Keyring:
    """Per-tenant AES-256 data keys, wrapped by a master key, persisted in ``backend``.

    Thread-safe: one lock guards the cache, another serialises every backend access, so a key
    already cached is handed out without waiting on a backend read in progress (a slow or hung
    remote Redis held every other tenant's cached key before).
    """

    def __init__(
        self,
        master_key: bytes,
        backend: MutableMapping[str, bytes],
        *,
        random_bytes: RandomBytes = os.urandom,
        cache_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        recheck: bool = False,
        where: str | None = None,
    ) -> None:
        if cache_ttl_s is not None and not cache_ttl_s > 0:
            raise InvalidArgument(f"Keyring(cache_ttl_s) must be positive or None, got {cache_ttl_s!r}")
        self._wrapper = AESGCM(_check_key(master_key, "Keyring(master_key)"))
        self._backend = backend
        self._random = random_bytes
        self._ttl = cache_ttl_s
        self._clock = clock
        # tenant -> (key, when it was read, key id)
        self._cache: dict[str, tuple[bytes, float, bytes]] = {}
        self._lock = threading.Lock()  # the cache
        self._io = threading.Lock()  # backend access; taken before _lock, never after
        self._recheck = recheck
        self._where = f" in {where}" if where else ""
        with self._io:
            self._assert_check()

    def _assert_check(self) -> None:
        """The backend's check entry unwraps under this master key; written when absent (a
        creation that lost a race to another writer is read back). FailedPrecondition when it
        does not unwrap. Caller holds ``_io``."""
        check = self._backend.get(_CHECK_NAME)
        if check is None:
            try:
                self._backend[_CHECK_NAME] = self._wrap(_CHECK_NAME, _CHECK_PLAINTEXT)
                return
            except FailedPrecondition:  # NOTE: another writer's entry came first: check it
                check = self._backend.get(_CHECK_NAME)
                if check is None:
                    return
        if self._unwrap(_CHECK_NAME, check) != _CHECK_PLAINTEXT:
            raise FailedPrecondition(f"keyring check entry{self._where} is corrupted")

    # -- wrapping ---------------------------------------------------------------------------
    def _wrap(self, tenant: str, key: bytes) -> bytes:
        nonce = self._random(_NONCE_BYTES)
        return _WRAP_MAGIC + nonce + self._wrapper.encrypt(nonce, key, _AAD_PREFIX + tenant.encode())

    def _unwrap(self, tenant: str, wrapped: bytes) -> bytes:
        wrapped = bytes(wrapped)
        who = f"the keyring check entry{self._where}" if tenant == _CHECK_NAME else f"tenant {tenant!r}'s data key"
        if len(wrapped) != _WRAPPED_BYTES or not wrapped.startswith(_WRAP_MAGIC):
            raise FailedPrecondition(f"{who} is not a wrapped key of this format (corrupted keyring?)")
        nonce = wrapped[len(_WRAP_MAGIC) : len(_WRAP_MAGIC) + _NONCE_BYTES]
        try:
            return self._wrapper.decrypt(
                nonce, wrapped[len(_WRAP_MAGIC) + _NONCE_BYTES :], _AAD_PREFIX + tenant.encode()
            )
        except InvalidTag:
            raise FailedPrecondition(
                f"{who} does not unwrap: the master key is wrong (or the keyring is corrupted)"
            ) from None

    # -- public -----------------------------------------------------------------------------
    def data_key(self, tenant: str, create: bool = True) -> bytes:
        """The tenant's 32-byte data key; generated and persisted on first use when ``create``.

        Raises :class:`KeyUnavailable` when the tenant has no key and ``create`` is false
        (never created, or destroyed), :class:`FailedPrecondition` when it does not unwrap.
        """
        tenant = _check_tenant(tenant)
        key = self.cached(tenant)
        if key is not None:
            return key
        with self._io:
            key = self.cached(tenant)  # read by another thread while this one waited
            if key is not None:
                return key
            now = self._clock()
            if self._recheck:
                self._assert_check()  # NOTE: the backend may have lost it (see the module doc)
            wrapped = self._backend.get(tenant)
            if wrapped is not None and _condemned(wrapped):
                wrapped = None  # NOTE: being destroyed: a new key (replacing it) or none, never it
            if wrapped is not None:
                key = self._unwrap(tenant, wrapped)
            elif not create:
                raise KeyUnavailable(f"tenant {tenant!r} has no data key (deleted or never written)")
            else:
                key = _check_key(self._random(KEY_BYTES), "the random generator")
                wrapped = self._wrap(tenant, key)
                self._backend[tenant] = wrapped
            with self._lock:
                self._cache[tenant] = (key, now, key_id(wrapped))
            return key

    def _entry(self, tenant: str) -> tuple[bytes, float, bytes] | None:
        with self._lock:
            hit = self._cache.get(tenant)
            if hit is None:
                return None
            if self._ttl is not None and self._clock() - hit[1] >= self._ttl:
                del self._cache[tenant]
                return None
            return hit

    def cached(self, tenant: str) -> bytes | None:
        """The tenant's key when this keyring holds a copy it still trusts (younger than
        ``cache_ttl_s``), else None; never touches the backend."""
        hit = self._entry(tenant)
        return None if hit is None else hit[0]

    def key_id(self, tenant: str) -> bytes | None:
        """The :func:`key_id` of the tenant's key when a trusted copy is cached (as
        :meth:`cached`), else None; never touches the backend."""
        hit = self._entry(tenant)
        return None if hit is None else hit[2]

    def cached_tenants(self) -> list[str]:
        """The tenants whose key is cached now."""
        with self._lock:
            return list(self._cache)

    def forget(self, tenant: str) -> None:
        """Drop the cached copy of the tenant's key: the next :meth:`data_key` reads the backend."""
        with self._lock:
            self._cache.pop(tenant, None)

    def destroy(self, tenant: str) -> bool:
        """Crypto-shred: delete the tenant's wrapped and cached key. True if it existed here.
        Idempotent: a key the backend no longer holds (another keyring sharing it destroyed
        it between the check and the deletion) is already destroyed, not an error."""
        tenant = _check_tenant(tenant)
        with self._io:
            with self._lock:
                cached = self._cache.pop(tenant, None)
            try:
                del self._backend[tenant]
                existed = True
            except KeyError:
                existed = False
            return existed or cached is not None

    def condemn(self, tenant: str) -> bool:
        """Mark the tenant's key for destruction, durably as the backend writes; True if it
        had one. The cached copy stays usable until :meth:`destroy`; from the backend, the key
        is gone at once (see the module docstring). Call it before deleting what the key
        encrypts, :meth:`destroy` after; whoever opens the backend after a crash between them
        destroys what :meth:`condemned` names."""
        tenant = _check_tenant(tenant)
        with self._io:
            wrapped = self._backend.get(tenant)
            if wrapped is None:
                return False
            wrapped = bytes(wrapped)
            if wrapped.startswith(_WRAP_MAGIC):
                try:
                    self._backend[tenant] = _CONDEMNED_MAGIC + wrapped[len(_WRAP_MAGIC):]
                except NVMeWriteFailed as exc:  # NOTE: the backend says it could not *store* a key
                    raise NVMeWriteFailed(f"could not destroy tenant {tenant!r}'s data key (marking it "
                                          f"for destruction failed: {exc})") from None
            return True

    def condemned(self) -> list[str]:
        """Sorted names of tenants whose key was condemned and not destroyed yet."""
        return self._names(condemned=True)

    def tenants(self) -> list[str]:
        """Sorted names of tenants that hold a data key (a condemned key is none)."""
        return self._names(condemned=False)

    def _names(self, *, condemned: bool) -> list[str]:
        with self._io:
            out = []
            for name in list(self._backend):
                wrapped = self._backend.get(name) if name != _CHECK_NAME else None
                if wrapped is not None and _condemned(wrapped) == condemned:
                    out.append(name)
            return sorted(out)


__all__ = ["DEFAULT_ENV_VAR", "KEY_BYTES", "KEY_ID_BYTES", "Keyring", "key_id", "load_master_key"]
