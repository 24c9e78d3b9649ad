"""Deletion on the remote tier: blocks, subtrees (through the children sets), tenants, models.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's client, namespace, lock and
counters, its Redis keys (``redis_key``, ``_value_key``, ``_tenant_hex``), ``_call``/``_batch``
of :mod:`tiers.remote_calls`, the accounting's ``_forget``/``_unheld``/``_unheld_where``, the
writer's cancellation (``_cancel``, ``_doomed_subtree``, ``_drop_tenant_queue``), the
tenants' ``_shred_tenant`` and the deletions stream's ``_deletion_entries``, ``_model_entry``,
``_tenant_entry`` and ``_published`` (:mod:`tiers.remote_invalidate`); ``_init_trees`` makes its state.

* ``deleting`` — holds the writer's filter for a deletion across the caller's own part too.
* ``delete`` / ``delete_many`` / ``delete_subtrees`` / ``delete_tenant`` / ``delete_model`` —
  ``UNLINK``; tenant and model deletion ``SCAN`` every primary by key prefix. ``delete_many``
  also cancels the blocks' queued demotions and raises :class:`~kvstore.errors.Unavailable` when
  any copy could not be reached (``delete`` answers False then: it is the miss path's).
  ``delete_subtrees`` (the Store's ``delete``) does the same for blocks and every block written
  under them by any server, found through the children sets (below). ``delete_tenant`` leaves
  a tombstone, then destroys the tenant's data key in the shared keyring, so a straggler (or a
  copy the operator kept) is unreadable (see :mod:`tiers.remote_tenants`).
* ``models`` — the set ``<namespace>:models``: the fingerprints of every model written (every
  write adds its model, ``_add_model``: a ``SADD`` in the write's round trip), so a server that
  never saw a model (restarted, another replica; a service Delete carries keys, no model)
  deletes its blocks too. (Added once per model per process, a set lost to an eviction or a
  restarted Redis was never made again, and deletions on such servers left the blocks readable.)
  The write's success needs the ``SADD`` only the first time this server writes the model
  (``_model_added``); later it is a repair, so a cluster node down (the set's) fails no other
  node's writes.

Children sets: a write that knows the block's parent (``parent=``: the Store always passes it)
adds the block's key to the Redis set ``<parent's key>:c`` in the same pipelined round trip
(``_add_child``: a Lua script that keeps the set alive at least as long as its longest-lived
member; a write whose set could not be updated is taken back), so a deletion finds every
descendant written by any server without a ``SCAN``: one pipelined ``SMEMBERS`` round trip per
level of the subtree. Costs: one more command per write (same round trip), about 40 bytes of
Redis memory per non-root block, and a deletion as many round trips as the deleted subtree has
levels (a 1,000-block chain: 1,000 round trips). A queued demotion of a block under a block being
deleted is dropped. Blocks written before this (no children set) are found only through the
local subtree the deleting server passes.

Deletions stream: ``delete_subtrees``, ``purge_model`` and ``purge_tenant`` record what they removed in
``<namespace>:deletions`` (the commands and the reader that applies the other servers' entries:
:mod:`tiers.remote_invalidate`), so the other servers sharing the Redis drop their local copies.
Each also forgets the writes it removed from the writer's record of recent writes
(:class:`~tiers.remote_writer.RecentWrites`): an entry applied later does not look for them.
``_delete_subtrees(publish_unfound=False)`` is the reader's deletion of this server's own
rewrites (``delete_rewritten``): published only when a value was found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

from kvstore.errors import Unavailable
from kvstore.keys import ROOT_KEY
from tiers.base import BlockRef
from tiers.remote_calls import FAULTS, Command, fault_text, succeeded

_T = TypeVar("_T")

#: ``doom(more)`` of an open deletion: adds blocks, cancels their queued demotions, returns their keys
Doom = Callable[[Iterable[bytes]], set[bytes]]

# Records a child in its parent's children set and makes the set outlive it: a new set gets the
# child's expiry, a set that expires sooner is extended to it, a child without one makes the set
# persistent. KEYS: the set; ARGV: the child's block key, its expiry in ms or ''.
_ADD_CHILD = ("local new = redis.call('EXISTS', KEYS[1]) == 0 "
              "redis.call('SADD', KEYS[1], ARGV[1]) "
              "if ARGV[2] == '' then redis.call('PERSIST', KEYS[1]) return 1 end "
              "local t = redis.call('PTTL', KEYS[1]) "
              "if new or (t >= 0 and t < tonumber(ARGV[2])) then "
              "redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 1")
_CHILDREN = b"c"  # last segment of a children set's key
_PART = 512  # keys per pipelined UNLINK


def _parts(items: Sequence[_T]) -> Iterator[Sequence[_T]]:
    """``items`` in slices of at most :data:`_PART`."""
    for i in range(0, len(items), _PART):
        yield items[i:i + _PART]


def _undeleted(why: Any, what: str) -> Unavailable:
    """The error of a deletion that could not reach Redis (``why``: the reply that failed)."""
    return Unavailable(f"remote tier (Redis) unreachable ({fault_text(why)}): {what}; retry the delete "
                       f"once the remote tier answers")


@contextmanager
def _unreachable(what: str) -> Iterator[None]:
    """Turns a Redis fault inside into Unavailable: ``what`` failed, retry."""
    try:
        yield
    except FAULTS as exc:
        raise Unavailable(f"remote tier (Redis) unreachable: {what} failed ({exc}); "
                          f"retry once the remote tier answers") from None


class Deletes:
    """RemoteTier methods of deletion and of the children and models sets (see the module
    docstring)."""

    def _init_trees(self) -> None:
        self._models_key = f"{self._ns}:models"
        self._models_seen: set[bytes] = set()  # fingerprints this server has added there

    def _children_key(self, tenant: str, fingerprint: bytes, key: bytes) -> bytes:
        """The Redis set of the keys of the blocks written under ``key`` (its children)."""
        return self._value_key(tenant, fingerprint, key) + b":" + _CHILDREN

    def _add_child(self, ref: BlockRef, parent: bytes | None, px: int | None) -> list[Command]:
        """The command that records ``ref`` in its parent's children set, kept alive at least
        ``px`` ms (None: persistent); none when the parent is not known (None) or is the root."""
        if parent is None or parent == ROOT_KEY:
            return []
        ckey = self._children_key(ref.tenant, ref.spec.fingerprint, parent)
        return [(ckey, ("EVAL", _ADD_CHILD, 1, ckey, ref.key, "" if px is None else str(px)))]

    def _add_model(self, fingerprint: bytes) -> tuple[list[Command], bool]:
        """The command that adds ``fingerprint`` to ``<namespace>:models`` (with every write:
        the set may have been lost since this server last added it), and whether a write needs
        it to succeed: until this server added it once (:meth:`_model_added`)."""
        return [(self._models_key, ("SADD", self._models_key, fingerprint))], fingerprint not in self._models_seen

    def _model_added(self, fingerprint: bytes) -> None:
        with self._lock:
            self._models_seen.add(fingerprint)

    def _unlink(self, ref: BlockRef) -> Any:
        self._forget(ref.ident)
        key = self.redis_key(ref)
        return self._call(key, lambda: self._client.unlink(key))

    def delete(self, ref: BlockRef) -> bool:
        """Remove one block; True if the server had it (False also on a fault: a caller that
        must know the copy is gone uses :meth:`delete_many`)."""
        res = self._unlink(ref)
        self._count("deletes")
        return res == 1

    def delete_many(self, refs: Sequence[BlockRef]) -> int:
        """Remove blocks (pipelined ``UNLINK``) after cancelling their queued demotions;
        returns how many the servers had. Raises :class:`Unavailable` when any of them could not
        be reached (a fault, an open breaker): their copies may survive, so the caller must not
        report them deleted (it is safe to retry)."""
        if not refs:
            return 0
        self._cancel({r.ident for r in refs})
        for r in refs:
            self._forget(r.ident)
        n = failed = 0
        why: Any = None
        for part in _parts(refs):
            for r in self._batch("UNLINK", [self.redis_key(x) for x in part]):
                if isinstance(r, int):
                    n += r
                else:
                    failed += 1
                    why = why or r
        self._count("deletes", len(refs))
        if failed:
            self._count("delete_failures", failed)
            raise _undeleted(why, f"{failed} of {len(refs)} remote copies could not be deleted")
        return n

    def models(self) -> set[bytes]:
        """The fingerprints of every model any server sharing this namespace has written a
        block of (the set ``<namespace>:models``, never expiring: a handful of entries).
        Raises :class:`Unavailable` when it cannot be read."""
        res = self._call(self._models_key, lambda: self._client.smembers(self._models_key))
        if not succeeded(res):
            raise _undeleted(res, "the models written there could not be listed")
        return {bytes(fp) for fp in res}

    def deleting(self, tenant: str, keys: Iterable[bytes]) -> AbstractContextManager[Doom]:
        """Hold the writer's filter for a deletion of the blocks ``keys`` of ``tenant`` across
        more than :meth:`delete_subtrees`: while open, no queued demotion of one of them, or of
        a block under one, is written (it is dropped when its turn comes). Yields ``doom(more)``,
        which adds blocks and cancels their queued demotions now (returns their keys); pass it
        to :meth:`delete_subtrees`. The Store holds it over its local part too: a block demoted
        between the remote part and the local one is not written back behind the deletion."""
        return self._doomed_subtree(tenant, keys)

    def publish_deletion(self, tenant: str, keys: Sequence[bytes]) -> None:
        """Publish the deletion of the blocks ``keys`` of ``tenant`` (and what is under them) in
        the deletions stream without deleting anything here: for a delete that found no model
        to delete them under (a server that never saw one, while none was written to Redis),
        whose blocks other servers may still hold."""
        if entries := self._deletion_entries(tenant, keys, ()):
            self._published(self._multi(entries))

    def delete_subtrees(self, tenant: str, roots: Sequence[tuple[bytes, bytes]],
                        doom: Doom | None = None) -> set[bytes]:
        """Remove the blocks ``roots`` (``(block key, model fingerprint)`` pairs) of ``tenant``
        and every block written under them, by any server: each write recorded the block in its
        parent's children set, so the subtree is found level by level (one pipelined round trip
        per level: ``SMEMBERS``), then its values are unlinked, then the children sets, in the
        same round trip as the deletion's entry in the deletions stream (the other servers drop
        their local copies: :mod:`tiers.remote_invalidate`; a publish that fails is counted).
        Queued demotions of these blocks or of children of them are cancelled (the one being
        written is waited for, and unlinked again once written). Returns the keys of the blocks
        removed (a value found, or a demotion cancelled). Raises :class:`Unavailable` when any
        part could not be reached: a retry finds what is left (the sets go last).

        Blocks written by an older version recorded no children: the caller passes the ones it
        knows (its local subtree) among ``roots``. ``doom``: from an open :meth:`deleting` of
        these blocks (default: one held for this call only)."""
        return self._delete_subtrees(tenant, roots, doom)[0]

    def _delete_subtrees(self, tenant: str, roots: Sequence[tuple[bytes, bytes]], doom: Doom | None,
                         *, publish_unfound: bool = True) -> tuple[set[bytes], set[bytes]]:
        """:meth:`delete_subtrees`; returns (what it returns, the keys of the values it
        unlinked). ``publish_unfound`` False: the entry is published only when a value was
        unlinked (a deletion of this server's rewrites: when none was left, there is nothing
        the other servers have to drop, and an entry would only echo the one applied)."""
        roots = list(dict.fromkeys(roots))
        if not roots:
            return set(), set()
        if doom is None:
            with self.deleting(tenant, (k for k, _ in roots)) as held:
                return self._delete_subtrees(tenant, roots, held, publish_unfound=publish_unfound)
        gone = doom(k for k, _ in roots)
        found = set(roots)
        level = roots
        while level:  # breadth-first: one round trip per level
            replies = self._checked(self._batch(
                "SMEMBERS", [self._children_key(tenant, fp, k) for k, fp in level]),
                len(level), "its descendants could not be listed")
            nxt = [(bytes(c), fp) for (_, fp), r in zip(level, replies) for c in r]
            level = [x for x in dict.fromkeys(nxt) if x not in found]
            found.update(level)
            gone |= doom(k for k, _ in level)
        found_list = list(found)
        with self._lock:
            for k, _ in found_list:
                self._unheld((tenant, k))
        unlinked: set[bytes] = set()
        for part in _parts(found_list):
            replies = self._checked(self._batch(
                "UNLINK", [self._value_key(tenant, fp, k) for k, fp in part]),
                len(found_list), "remote copies could not be deleted")
            unlinked.update(k for (k, _), r in zip(part, replies) if r)
        gone |= unlinked
        self._recent.forget(tenant, found_list)  # deleted: no later entry deletes them again
        parts = list(_parts(found_list))
        for i, part in enumerate(parts):  # NOTE: last: a retry walks them again
            cmds: list[Command] = [(ck, ("UNLINK", ck)) for ck in
                                   (self._children_key(tenant, fp, k) for k, fp in part)]
            if i == len(parts) - 1 and (publish_unfound or unlinked):  # the other servers drop
                cmds += self._deletion_entries(  # their local copies (same round trip)
                    tenant, [*(k for k, _ in found_list), *gone], (fp for _, fp in found_list))
            replies = self._multi(cmds)
            self._checked(replies[:len(part)], len(found_list), "children sets could not be deleted")
            self._published(replies[len(part):])
        self._count("deletes", len(found))
        self._count("subtree_blocks_deleted", len(gone))
        return gone, unlinked

    def _checked(self, replies: list[Any], total: int, what: str) -> list[Any]:
        """``replies`` when every one is a success, else Unavailable (counted)."""
        bad = [r for r in replies if not succeeded(r)]
        if not bad:
            return replies
        self._count("delete_failures", len(bad))
        raise _undeleted(bad[0], f"{len(bad)} of {total} blocks' {what}")

    def _purge(self, pattern: str) -> set[tuple[str, bytes]]:
        """``UNLINK`` every key matching ``pattern`` (``SCAN`` on every primary); returns the
        blocks removed, as (tenant hash hex, block key) (children sets are not blocks)."""
        gone: set[tuple[str, bytes]] = set()
        batch: list[bytes] = []
        for k in self._client.scan_iter(match=pattern, count=1000):
            batch.append(bytes(k))
            if len(batch) >= _PART:
                gone |= self._unlink_all(batch)
                batch = []
        return gone | (self._unlink_all(batch) if batch else set())

    def _unlink_all(self, keys: list[bytes]) -> set[tuple[str, bytes]]:
        replies = self._batch("UNLINK", keys)
        bad = [r for r in replies if not isinstance(r, int)]
        if bad:
            raise Unavailable(f"remote tier: {len(bad)} keys could not be deleted "
                              f"({bad[0]!r}); retry the deletion")
        gone = set()
        for k, r in zip(keys, replies):
            parts = k.split(b":")
            if r and len(parts) == 4:  # <ns>:<tenant hash>:<fingerprint>:<block key>
                gone.add((parts[1].decode(), bytes.fromhex(parts[3].decode())))
        return gone

    def delete_tenant(self, tenant: str) -> int:
        """:meth:`purge_tenant`; returns how many blocks it removed."""
        return len(self.purge_tenant(tenant))

    def purge_tenant(self, tenant: str) -> set[bytes]:
        """Leave the tenant's tombstone (see :mod:`tiers.remote_tenants`), destroy its data key
        (shared keyring), drop its queued demotions and ``UNLINK`` every key under its prefix
        on every primary, then publish the deletion in the deletions stream (the other servers
        drop their local blocks of the tenant; a publish that fails is counted, the deletion
        stands); returns the keys of the blocks removed. Raises
        :class:`~kvstore.errors.Unavailable` when a server cannot be reached (safe to retry;
        once the tombstone is written every server refuses the tenant's older copies)."""
        self._drop_tenant_queue(tenant)
        with _unreachable(f"deleting tenant {tenant!r}"):
            self._shred_tenant(tenant)
            gone = self._purge(f"{self._ns}:{self._tenant_hex(tenant)}:*")
            n = len(gone)
        if entry := self._tenant_entry(tenant):  # the other servers drop their local copies
            self._published(self._multi(entry))
        with self._lock:
            self._unheld_where(lambda ident, _: ident[0] == tenant)
        self._recent.forget_where(lambda w: w.tenant == tenant)
        self._count("tenant_keys_deleted", n)
        return {key for _, key in gone}

    def delete_model(self, fingerprint: bytes) -> int:
        """:meth:`purge_model`; returns how many blocks it removed."""
        return len(self.purge_model(fingerprint))

    def purge_model(self, fingerprint: bytes) -> set[tuple[str, bytes]]:
        """``UNLINK`` every block of a model fingerprint (all tenants), then publish the purge
        in the deletions stream; returns the blocks removed as (tenant hash hex, block key).
        Raises :class:`~kvstore.errors.Unavailable`
        when a server cannot be reached (safe to retry)."""
        with _unreachable("purging a model"):
            gone = self._purge(f"{self._ns}:*:{fingerprint.hex()}:*")
        if entry := self._model_entry(fingerprint):  # the other servers drop their local copies
            self._published(self._multi(entry))
        with self._lock:
            self._unheld_where(lambda _, h: h.fingerprint == fingerprint)
            self._counts["model_keys_deleted"] += len(gone)
        self._recent.forget_where(lambda w: w.fingerprint == fingerprint)
        return gone


__all__ = ["Deletes"]
