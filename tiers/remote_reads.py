"""The remote tier's reads: gets into the caller's buffers, existence checks of a chain.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's client, codec, keyring, config,
clock and counters, ``redis_key``, ``_call``/``_batch`` of :mod:`tiers.remote_calls`, the
accounting's ``_forget``, the tenants' ``_key_matches``/``_dropped_at`` and the deletions'
``delete``/``_unlink``.

* ``get_into`` / ``get_many_into`` / ``get_prefix_into`` — decode into the caller's buffers;
  pipelined (batches of at most ``max_inflight_bytes``). Any fault (node down, timeout,
  MOVED/ASK the client could not follow, evicted or expired key, failed authentication of the
  value, destroyed tenant key) is a *miss* plus a counter, never an exception and never other
  bytes. A value that fails its check is deleted. One encrypted while this server's ``encrypt``
  is off, or the reverse (:class:`~kvstore.errors.EncryptionMismatch`: servers of one namespace
  configured differently) is a miss that deletes nothing, counted ``config_mismatch`` and
  logged once: the servers that wrote it still read it. ``info=`` (a list) receives each served
  block's :class:`~tiers.remote_envelope.RemoteInfo`: the TTL deadline and creation time it was
  written with, so a promoted block keeps them.
* A value read at or past its deadline (on this server's clock) is a miss, and is deleted once
  ``skew_grace_s`` past it (the servers' clocks differ); one under a key id other than the
  tenant's is handled as :mod:`tiers.remote_tenants` says; one of a tenant deleted after it was
  made is a miss and deleted.
* ``contains_many`` / ``prefix_len`` — pipelined ``GETRANGE`` of the values' envelopes, in
  prefix order: a fault or a copy past its deadline reads as absent, as a get would find it.
* ``parents=`` (the reads and the existence checks): the parent key each block must have (None:
  any); a copy that records another parent is a miss (counted ``misses_parent``), nothing
  deleted. A block's key does not say whether it is a root or a link, nor of which chain: a
  roots call and a chain's continuation ask with the parent their keys imply. A copy that
  records none (written before envelope version 3) is served to a chain read, as before, and
  is a miss to a ``strict`` one (a roots call: such a copy cannot say it is a root). NOTE:
  refusing it to chain reads too made every copy written before the upgrade a miss until
  written again, and a server that believed Redis held its copy never wrote it again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from itertools import takewhile
from typing import Any

import numpy as np

from kvstore.errors import EncryptionMismatch, FailedPrecondition, IntegrityError, KeyUnavailable
from tiers.base import BlockRef, as_bytes_view
from tiers.remote_calls import FAULTS, succeeded
from tiers.remote_envelope import ENVELOPE, UNKNOWN, RemoteInfo, live_at, parent_of, split_value

log = logging.getLogger(__name__)


def _leading(flags: Iterable[bool]) -> int:
    """How many leading ``flags`` are true."""
    return sum(1 for _ in takewhile(bool, flags))


class Reads:
    """RemoteTier methods of gets and existence checks (see the module docstring)."""

    _mismatch_warned = False  # set on the tier once it logged an EncryptionMismatch

    def _warn_mismatch(self, ref: BlockRef, exc: EncryptionMismatch) -> None:
        """Log the first EncryptionMismatch of this tier (every later one is only counted)."""
        if self._mismatch_warned:
            return
        self._mismatch_warned = True
        log.warning("remote tier: a block of tenant %r in namespace %r cannot be read here: %s. The "
                    "servers sharing a namespace must agree on encrypt (RemoteConfig.encrypt); such "
                    "blocks are misses here and are kept (counted remote_config_mismatch)",
                    ref.tenant, self.config.namespace, exc)

    def _decode(self, ref: BlockRef, value: Any, out: np.ndarray,
                parent: bytes | None = None, strict: bool = False) -> RemoteInfo | None:
        """One fetched reply -> out; what its envelope says, or None (counted) on a miss.
        ``parent``, ``strict``: the parent the block must record (None: any; see the module
        docstring)."""
        if value is None:
            self._count("misses_absent")  # never written, expired, evicted or deleted
            self._forget(ref.ident)
            return None
        if not succeeded(value):
            return None
        try:
            body, info = split_value(value)
            if not _parent_ok(info.parent, parent, strict):
                self._count("misses_parent")  # another chain's link, or a parent not recorded
                return None
            now = self._clock()
            if info.deadline is not None and now >= info.deadline:
                # NOTE: Redis' expiry is the same deadline, but on Redis' clock; this one is
                # the Store's (and a value whose deadline was moved back may outlive it there).
                # Deleted only past the skew grace: a server whose clock runs ahead deleted
                # copies the others still served
                self._count("misses_expired")
                if now >= info.deadline + self.config.skew_grace_s:
                    self._unlink(ref)
                return None
            if info.kid is not None and self._keyring is not None:
                verdict = self._key_matches(ref.tenant, info.kid)
                if verdict is not True:
                    if verdict is None:  # the key here may be stale: a miss, nothing deleted
                        self._count("misses_key_unconfirmed")
                    else:  # under a key the tenant no longer has: nobody can read it
                        self._count("misses_foreign_key")
                        self._unlink(ref)
                    return None
            self.codec.decode(ref.tenant, ref.key, ref.spec, body, out=out)
            dropped = self._dropped_at(ref.tenant, strict=False)
            if dropped is not None and (info.created is None or info.created <= dropped):
                out.fill(0)
                self._count("misses_tenant_deleted")  # written by a server that missed it
                self._unlink(ref)
                return None
        except (IntegrityError, FailedPrecondition, *FAULTS) as exc:
            out.fill(0)  # NOTE: decryption may have written unauthenticated bytes there
            if isinstance(exc, EncryptionMismatch):
                # NOTE: was an IntegrityError, and deleted: one server with encrypt=False on a
                # shared namespace deleted every block the encrypting servers wrote
                self._count("config_mismatch")
                self._warn_mismatch(ref, exc)
            elif isinstance(exc, KeyUnavailable):
                self._count("key_unavailable")
                self.delete(ref)
            elif isinstance(exc, IntegrityError):
                self._count("integrity_failures")
                self.delete(ref)
            elif isinstance(exc, FailedPrecondition):  # the keyring cannot unwrap the key
                self._count("key_errors")
            else:  # the keyring's own round trip failed
                self._count("faults")
            return None
        self._count("hits")
        self._count("get_bytes", ref.nbytes)
        return info

    def get_into(self, ref: BlockRef, out: Any, *, info: list[RemoteInfo] | None = None,
                 parent: bytes | None = None, strict: bool = False) -> bool:
        """Copy the block into ``out`` (``ref.nbytes``); False on a miss of any kind.
        ``info``: a list that receives the block's :class:`RemoteInfo` when served.
        ``parent``: the parent it must record (see the module docstring; None: any)."""
        key = self.redis_key(ref)
        value = self._call(key, lambda: self._client.get(key))
        got = self._decode(ref, value, as_bytes_view(out), parent, strict)
        self._count("gets")
        if got is None:
            self._count("misses")
        elif info is not None:
            info.append(got)
        return got is not None

    def _fetch(self, refs: Sequence[BlockRef], outs: Sequence[Any], stop_at_miss: bool,
               info: list[RemoteInfo] | None, parents: Sequence[bytes | None] | None,
               strict: bool = False) -> list[bool]:
        got = [False] * len(refs)
        infos: list[RemoteInfo] = [UNKNOWN] * len(refs)
        budget = self.config.max_inflight_bytes
        i = 0
        while i < len(refs):
            j, nbytes = i, 0
            while j < len(refs) and (j == i or nbytes + refs[j].nbytes <= budget):
                nbytes += refs[j].nbytes
                j += 1
            values = self._batch("GET", [self.redis_key(r) for r in refs[i:j]])
            for k, value in enumerate(values):
                one = self._decode(refs[i + k], value, as_bytes_view(outs[i + k]),
                                   parents[i + k] if parents is not None else None, strict)
                if one is not None:
                    got[i + k], infos[i + k] = True, one
                if stop_at_miss and not got[i + k]:
                    break
            if stop_at_miss and not all(got[i:j]):
                break
            i = j
        self._count("gets", len(refs))
        self._count("misses", len(refs) - sum(got))
        if info is not None:
            info[:] = infos
        return got

    def get_many_into(self, refs: Sequence[BlockRef], outs: Sequence[Any], *,
                      info: list[RemoteInfo] | None = None,
                      parents: Sequence[bytes | None] | None = None, strict: bool = False) -> list[bool]:
        """Pipelined gets (batches of at most ``max_inflight_bytes``); per block: served?
        ``info``: a list set to one :class:`RemoteInfo` per block (meaningful where served).
        ``parents``: the parent each block must record (see the module docstring)."""
        return self._fetch(refs, outs, False, info, parents, strict)

    def get_prefix_into(self, refs: Sequence[BlockRef], outs: Sequence[Any], *,
                        info: list[RemoteInfo] | None = None,
                        parents: Sequence[bytes | None] | None = None, strict: bool = False) -> int:
        """Pipelined gets of a chain; returns how many leading blocks were served (a later
        block is not decoded once one misses). ``info``, ``parents``: as for
        :meth:`get_many_into`."""
        return _leading(self._fetch(refs, outs, True, info, parents, strict))

    def contains_many(self, refs: Sequence[BlockRef], *,
                      parents: Sequence[bytes | None] | None = None, strict: bool = False) -> list[bool]:
        """Pipelined existence checks in the given (prefix) order; a fault reads as absent,
        and so does a copy past its deadline (on this server's clock: each reply is the value's
        envelope, ``GETRANGE``, not the whole value), as a get would find it, and one that does
        not record the parent ``parents`` names for it (see the module docstring)."""
        replies = self._batch("GETRANGE", [self.redis_key(r) for r in refs], 0, ENVELOPE.size - 1)
        self._count("exists_checks", len(refs))
        now = self._clock()
        found = [succeeded(r) and bool(r) and live_at(r, now) for r in replies]
        if parents is not None:
            for i, (r, want) in enumerate(zip(replies, parents)):
                if found[i] and not _parent_ok(parent_of(r), want, strict):
                    found[i] = False
                    self._count("misses_parent")
        return found

    def prefix_len(self, refs: Sequence[BlockRef], *,
                   parents: Sequence[bytes | None] | None = None) -> int:
        """How many leading blocks of the chain ``refs`` exist remotely (``parents``: as for
        :meth:`contains_many`; a chain's read is never strict)."""
        return _leading(self.contains_many(refs, parents=parents))

    def contains(self, ref: BlockRef) -> bool:
        return self.contains_many([ref])[0]


__all__ = ["Reads"]


def _parent_ok(recorded: bytes | None, want: bytes | None, strict: bool) -> bool:
    """Whether a copy recording parent ``recorded`` (None: an envelope older than version 3)
    answers a read that wants parent ``want`` (None: any); see the module docstring."""
    if want is None:
        return True
    if recorded is None:
        return not strict
    return recorded == want
