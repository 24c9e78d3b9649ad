"""Tenants on the remote tier: their deletion tombstones and their data keys' ids.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's keyring, namespace, clocks, lock,
counters and ``_call`` of :mod:`tiers.remote_calls` (every Redis read here goes through the
breaker: a hung Redis stalled every write for its timeouts and never opened it);
``_init_tenants`` makes its state.

The tenants' data keys are kept, wrapped by the master key, in the same Redis
(``<namespace>:keyring:...``) so every node with the same master key reads every other node's
blocks; a node with another master key fails at open (the keyring's check entry does not
unwrap). The keyring asserts the check entry again whenever it reads a key from Redis or makes
one there (``recheck``: a Redis restarted empty or evicting loses it, and a node with another
master key then wrote its own), refusing with FailedPrecondition naming the namespace.

Tombstones: a tenant deletion (``_shred_tenant``) records the deletion time in
``<namespace>:dropped:<hex tenant>`` (:class:`~tiers.remote_redis.TenantTombstones`, never
expiring) before it destroys the key. Every server refuses to write a block of that tenant made at
or before that time (``_admit``, counted ``put_tenant_deleted``: another server's local blocks or
queue would otherwise re-create the key and bring the deleted data back), and reads such a value
as a miss and deletes it. Blocks made after the deletion (a tenant created again under the name)
are written as usual. A server re-reads the tombstone whenever it re-reads the tenant's key
(after ``key_cache_ttl_s``), so it honours a deletion made elsewhere within that time; the times
are wall clocks of different servers (skew counts). A ``FLUSHALL`` removes the tombstones with
everything else.

Key ids (a tenant deleted and created again under its name gets a new data key, while other
servers may hold the old one cached for ``key_cache_ttl_s``): a reader that finds a value whose
key id is not its cached key's re-reads the key from Redis once (``_key_matches``, at most once
every :data:`KEY_REFRESH_S` per tenant) before anything else: the value then decodes, or is under
a key the tenant no longer has (a miss, deleted: nobody can read it), or — not confirmed — a miss
that deletes nothing. Only a value whose key id matches and still fails its check is damaged. A
writer reads the tenant's wrapped key and tombstone in the same pipelined round trip as its
``SET`` (``_tenant_key_reads``); when the key is not the one it encrypted with, or is gone and a
tombstone says the tenant was deleted (``_key_replaced``), it takes the value back, forgets the
key and the tombstone it had cached (``_forget_tenant_key``), and writes once more with what it
reads then, so no value is left under a destroyed key. A key gone without a tombstone (lost with
a cluster node, a flush) is not replaced: the cached copy goes on being used, as before.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import FailedPrecondition, KeyUnavailable, Unavailable
from kvstore.keyring import key_id
from tiers.remote_calls import fault_text, succeeded
from tiers.remote_redis import KeyringRace, TenantTombstones, keyring_key

#: least time between two forced re-reads of one tenant's data key (a value under a key id
#: other than the cached key's): a flood of such values must not become a flood of reads
KEY_REFRESH_S = 1.0


class TenantKeys:
    """RemoteTier methods of tombstones and data keys (see the module docstring)."""

    def _init_tenants(self) -> None:
        self._tombs = TenantTombstones(self._client, self._ns)
        # tenant -> (deletion time or None, monotonic time it was read)
        self._marks: dict[str, tuple[float | None, float]] = {}
        self._key_reads: dict[str, float] = {}  # tenant -> monotonic time of the last forced re-read

    def _keyring_key(self, tenant: str) -> str:
        """The Redis key of ``tenant``'s wrapped data key."""
        return keyring_key(f"{self._ns}:keyring:", tenant)

    def _dropped_at(self, tenant: str, *, strict: bool) -> float | None:
        """When ``tenant`` was last deleted (by any server), or None. The copy kept here is
        re-read when it is ``key_cache_ttl_s`` old and whenever the keyring re-reads the
        tenant's key — after that key (a deletion writes the tombstone before it destroys the
        key, so a server that finds the key gone finds the tombstone). Under the breaker; when
        it cannot be read: ``strict`` raises Unavailable, else the last copy (or None)."""
        now = self._monotonic()
        with self._lock:
            hit = self._marks.get(tenant)
        key_fresh = self._keyring is None or self._keyring.cached(tenant) is not None
        if hit is not None and key_fresh and now - hit[1] < self.config.key_cache_ttl_s:
            return hit[0]

        def read() -> float | None:
            if not key_fresh:
                assert self._keyring is not None
                try:
                    self._keyring.data_key(tenant, create=False)
                except (KeyUnavailable, FailedPrecondition):
                    pass  # no key (made by the write, if it may) or one that does not unwrap
            return self._tombs.get(tenant)

        res = self._call(self._tombs.key(tenant), read)
        if not succeeded(res):
            if strict:
                raise Unavailable(f"remote tier: tenant {tenant!r}'s deletion marker could not be "
                                  f"read ({fault_text(res)})")
            return hit[0] if hit is not None else None
        with self._lock:
            if len(self._marks) > 4096:
                self._marks.clear()
            self._marks[tenant] = (res, now)
        return res

    def _admit(self, tenant: str, created: float | None) -> bool:
        """Whether a block of ``tenant`` made at ``created`` may be written here (not when the
        tenant was deleted since: counted ``put_tenant_deleted``), with the tenant's data key
        ready (made when it has none). Every Redis read goes through the breaker."""
        try:
            dropped = self._dropped_at(tenant, strict=True)
        except Unavailable:
            return False
        if dropped is not None and (created is None or created <= dropped):
            self._count("put_tenant_deleted")
            return False
        if self._keyring is None or self._keyring.cached(tenant) is not None:
            return True
        keyring = self._keyring

        def make() -> None:
            try:
                keyring.data_key(tenant, create=True)
            except KeyringRace:  # another node made it first: read theirs
                keyring.data_key(tenant, create=True)

        res = self._call(self._keyring_key(tenant), make)
        return succeeded(res)

    def _tenant_key_reads(self, tenant: str) -> list[tuple[str, tuple[Any, ...]]]:
        """Commands (for ``_multi``) that read ``tenant``'s wrapped key and tombstone as Redis
        holds them now; :meth:`_key_replaced` reads their replies."""
        kkey, tkey = self._keyring_key(tenant), self._tombs.key(tenant)
        return [(kkey, ("GET", kkey)), (tkey, ("GET", tkey))]

    def _key_replaced(self, kid: bytes, wrapped: bytes | None, tomb: Any) -> bool:
        """Whether a value written with the data key ``kid`` is under a key the tenant no
        longer has, from the replies of :meth:`_tenant_key_reads` (both succeeded)."""
        if wrapped is not None:
            return key_id(wrapped) != kid
        # NOTE: no key in Redis: destroyed by a tenant deletion (which writes its tombstone
        # first), or lost with a node or a flush: then the copy cached here is the only one, and
        # the blocks written with it stay readable to the servers holding it, as before key ids
        self._count("put_key_absent")
        return tomb is not None

    def _forget_tenant_key(self, tenant: str) -> None:
        """Forget the data key and the tombstone cached for ``tenant``: both are read again."""
        self._keyring.forget(tenant)  # type: ignore[union-attr]
        with self._lock:
            self._marks.pop(tenant, None)

    def _key_matches(self, tenant: str, kid: bytes) -> bool | None:
        """Whether ``kid`` (a value's key id) is the id of ``tenant``'s data key: True; False
        when it is not the key Redis holds (read just now); None when that could not be
        confirmed (Redis not reached, or the key re-read less than :data:`KEY_REFRESH_S` ago).
        A key id other than the cached key's makes one re-read of the key (under the breaker):
        the cached copy may be the key of a tenant deleted and created again since. Raises
        KeyUnavailable when the tenant has no key (FailedPrecondition: it does not unwrap)."""
        keyring = self._keyring
        assert keyring is not None
        cur = keyring.key_id(tenant)
        if cur == kid:
            return True
        if cur is not None:
            now = self._monotonic()
            with self._lock:
                last = self._key_reads.get(tenant)
                if last is not None and now - last < KEY_REFRESH_S:
                    return None
                if len(self._key_reads) > 4096:
                    self._key_reads.clear()
                self._key_reads[tenant] = now
                self._marks.pop(tenant, None)  # a new key: the tenant was deleted meanwhile
            keyring.forget(tenant)
            self._count("key_rereads")
        res = self._call(self._keyring_key(tenant), lambda: keyring.data_key(tenant, create=False))
        if not succeeded(res):
            return None
        cur = keyring.key_id(tenant)
        return None if cur is None else cur == kid

    def _shred_tenant(self, tenant: str) -> None:
        """Leave ``tenant``'s tombstone, then destroy its data key in the shared keyring (its
        values left anywhere are unreadable from then on). Redis faults propagate."""
        # NOTE: the tombstone first: a server that then finds the key gone finds it too
        when = self._tombs.mark(tenant, self._clock())
        with self._lock:
            self._marks[tenant] = (when, self._monotonic())
        if self._keyring is not None:
            self._keyring.destroy(tenant)


__all__ = ["KEY_REFRESH_S", "TenantKeys"]
