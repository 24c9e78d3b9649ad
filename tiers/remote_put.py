"""The remote tier's writes: encode a block, store it with its envelope, move its deadline.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's client, codec, keyring, config,
clock and counters, ``redis_key``, ``_call``/``_multi`` of :mod:`tiers.remote_calls`, the
accounting (``can_fit``, ``_account``, ``_held_deadline``), the writer's ``_want_resync``, the
tenants' ``_admit`` and key check, and the deletions' children and models sets
(``_add_child``, ``_add_model``); ``_init_puts`` makes its state.

* ``put(ref, data, ttl_deadline=, quant=, created=, parent=)`` — encode (the tenant's data key,
  AES-256-GCM; header bound as associated data) and ``SET ... PX``; True when the server stored
  it. A fault is False. ``created``: when the block was made (its ``BlockMeta.created``), see
  the tombstones of :mod:`tiers.remote_tenants`. The background writer
  (:mod:`tiers.remote_writer`) writes through ``_put_with`` too.
* ``update_ttl(ref, deadline, parent=)`` — moves a block's deadline: its envelope's and Redis'
  expiry together, and keeps its parent's children set alive as long.
* ``_cap_tenant(tenant, deadline)`` — lowers to ``deadline`` the deadline of every copy of the
  tenant's blocks in Redis (written by any server) that is later or has none (``SCAN`` of every
  primary by the tenant's prefix, then one pipelined conditional ``EVAL`` per 512 keys): a
  tenant's TTL set or lowered (:meth:`tiers.remote_writer.DemotionQueue.cap_ttl` runs it).
* ``_cap_model(fingerprint, deadline)`` — the same for every copy of a model's blocks, every
  tenant's (``SCAN`` by ``<namespace>:*:<fingerprint>:*``): a model's TTL set or lowered
  (:meth:`tiers.remote_writer.DemotionQueue.cap_model_ttl`).

Redis' own expiry (``PX``) is the deadline capped at ``ttl_cap_s``; the envelope
(:mod:`tiers.remote_envelope`) keeps the deadline itself, so a block promoted from here keeps it
(it got the tenant's default TTL before, and a re-spill then wrote it for the whole cap).

One write is one pipelined round trip: the block's key into its parent's children set and its
model into the models set (:mod:`tiers.remote_delete`), the ``SET``, and the tenant's wrapped key
and tombstone as Redis holds them now (:mod:`tiers.remote_tenants`). A value stored under a key
that is not the tenant's any more, or whose children set could not be updated (or that could not
be made sure of), is taken back; the first case is written once more with the key read again.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvstore.errors import FailedPrecondition
from kvstore.quantization import QuantArg
from tiers.base import BlockRef, as_bytes_view
from tiers.remote_calls import FAULTS, fault_text, succeeded
from tiers.remote_envelope import ENVELOPE, NO_KID, cap_ttl_command, pack_envelope, update_ttl_command

_STALE = object()  # a write made with a data key that is not the tenant's any more


class Writes:
    """RemoteTier methods of synchronous writes (see the module docstring)."""

    def _init_puts(self) -> None:
        self._put_lock = threading.Lock()  # put's scratch buffer (the writer thread has its own)
        self._put_scratch = np.empty(0, dtype=np.uint8)

    def _px(self, deadline: float | None) -> tuple[int | None, float | None]:
        """(Redis expiry in ms or None, local deadline); expiry 0 means already expired."""
        cap = self.config.ttl_cap_s
        now = self._clock()
        left = cap if deadline is None else min(deadline - now, cap or float("inf"))
        if left is None:
            return None, None
        if left <= 0:
            return 0, now
        return max(1, int(left * 1000)), now + left

    def _put_with(self, scratch: np.ndarray, ref: BlockRef, data: np.ndarray,
                  deadline: float | None, quant: QuantArg = None,
                  created: float | None = None,
                  parent: bytes | None = None) -> tuple[bool, np.ndarray]:
        px, local_deadline = self._px(deadline)
        if px == 0:
            self._count("put_expired")
            return False, scratch
        if not self.can_fit(ref.nbytes):
            self._count("put_refused")
            self._want_resync()
            return False, scratch
        for _ in range(2):  # NOTE: again (once) after finding the data key cached here stale
            res, scratch = self._put_once(scratch, ref, data, deadline, quant, created, parent, px)
            if res is not _STALE:
                break
        else:
            self._count("put_failures")
            return False, scratch
        if not res:
            return False, scratch
        self._account(ref, local_deadline, self.redis_key(ref), deadline)
        self._count("puts")
        self._count("put_bytes", ref.nbytes)
        self._count("put_stored_bytes", res)
        return True, scratch

    def _put_once(self, scratch: np.ndarray, ref: BlockRef, data: np.ndarray,
                  deadline: float | None, quant: QuantArg, created: float | None,
                  parent: bytes | None, px: int | None) -> tuple[Any, np.ndarray]:
        """One write of :meth:`_put_with`: the bytes stored (> 0), 0 (failed, counted), or
        ``_STALE``: the tenant's data key cached here is not the one in Redis any more (the
        tenant was deleted, maybe created again): nothing is left written, the cached key and
        tombstone are forgotten, and a second try reads both again."""
        tenant = ref.tenant
        keyring = self._keyring
        try:
            if not self._admit(tenant, created):
                self._count("put_failures")
                return 0, scratch
            kid = keyring.key_id(tenant) if keyring is not None else NO_KID
            if kid is None:  # the copy _admit made sure of expired meanwhile
                return _STALE, scratch
            need = ENVELOPE.size + self.codec.max_encoded_nbytes(ref.spec)
            if scratch.shape[0] < need:
                scratch = np.empty(need, dtype=np.uint8)
            n = self.codec.encode_into(tenant, ref.key, ref.spec, data,
                                       scratch[ENVELOPE.size:], quant=quant)
        except FAULTS + (FailedPrecondition,) as exc:  # keyring unreachable or unusable
            self._count("put_failures")
            self._count("key_errors" if isinstance(exc, FailedPrecondition) else "faults")
            return 0, scratch
        if keyring is not None and keyring.key_id(tenant) not in (None, kid):
            return _STALE, scratch  # re-read while encoding: which key the codec used is unsure
        pack_envelope(scratch, deadline, created, kid, parent)  # its parent: see remote_envelope
        key = self.redis_key(ref)
        value = memoryview(scratch)[:ENVELOPE.size + n]
        # NOTE: the child goes into its parent's children set (in the same round trip), so a
        # delete of any ancestor finds it (see delete_subtrees); its model into the models set,
        # so a server that never saw the model can delete its blocks
        fp = ref.spec.fingerprint
        add_model, model_needed = self._add_model(fp)
        cmds = self._add_child(ref, parent, px) + add_model
        at = len(cmds)
        optional = set() if model_needed else {at - 1}  # NOTE: the SADD repairs a lost set
        cmds.append((key, ("SET", key, value) if px is None else ("SET", key, value, "PX", px)))
        if keyring is not None:
            # NOTE: the tenant's key as Redis holds it now, in the same round trip: a key cached
            # here may have been destroyed (the tenant deleted, maybe created again) by another
            # server since; a value written with it would be unreadable (and, before key ids,
            # was read as damaged and deleted by every server that had the new key)
            cmds += self._tenant_key_reads(tenant)
        replies = self._multi(cmds)
        if replies[at] is not True:
            self._count("put_failures")
            return 0, scratch
        unsure = not all(succeeded(r) for i, r in enumerate(replies) if i != at and i not in optional)
        stale = keyring is not None and not unsure and self._key_replaced(kid, *replies[at + 1:])
        if stale or unsure:
            # stored, but with a key that is not the tenant's any more, or not where a delete
            # of an ancestor would find it (or that could not be made sure of): take it back
            self._call(key, lambda: self._client.unlink(key))
            if stale:
                self._count("put_stale_key")
                self._forget_tenant_key(tenant)
                return _STALE, scratch
            self._count("put_failures")
            return 0, scratch
        if model_needed:
            self._model_added(fp)
        return ENVELOPE.size + n, scratch

    def put(self, ref: BlockRef, data: Any, *, ttl_deadline: float | None = None,
            quant: QuantArg = None, created: float | None = None,
            parent: bytes | None = None) -> bool:
        """Encode and store synchronously; False on a fault, a full tier, a past deadline or a
        tenant deleted after ``created`` (when the block was made; None = unknown, refused
        once the tenant was ever deleted). ``quant``: store a quantized copy (the codec's
        formats; a get returns it dequantized). ``parent``: the key of the block's parent
        (``ROOT_KEY`` for a first block): recorded in the parent's children set, so deleting
        any ancestor deletes this copy too (:meth:`delete_subtrees`); None = not recorded."""
        view = as_bytes_view(data)
        with self._put_lock:
            ok, self._put_scratch = self._put_with(self._put_scratch, ref, view, ttl_deadline,
                                                   quant, created, parent)
        return ok

    def update_ttl(self, ref: BlockRef, ttl_deadline: float | None, *,
                   parent: bytes | None = None) -> bool:
        """Move a block's deadline (later only is the Store's business): its envelope's and
        Redis' expiry, together; False on a fault or when the block is not there. ``parent``:
        its parent's children set is kept alive as long (see :meth:`put`)."""
        px, local = self._px(ttl_deadline)
        if px == 0:
            return self.delete(ref)
        key = self.redis_key(ref)
        res = self._multi([(key, update_ttl_command(key, ttl_deadline, px)),
                           *self._add_child(ref, parent, px)])[0]
        if res == 1:
            self._held_deadline(ref.ident, local, ttl_deadline)
            return True
        return False

    def _cap_tenant(self, tenant: str, deadline: float) -> int:
        """Lower to ``deadline`` every deadline of ``tenant``'s copies in Redis that is later
        or none (see the module docstring); returns how many moved. A fault (the ``SCAN``, or a
        reply) raises it (the caller counts it): the copies not reached keep their deadlines."""
        return self._cap_matching(f"{self._ns}:{self._tenant_hex(tenant)}:*", deadline)

    def _cap_model(self, fingerprint: bytes, deadline: float) -> int:
        """:meth:`_cap_tenant` for every copy of model ``fingerprint``'s blocks, every tenant's."""
        return self._cap_matching(f"{self._ns}:*:{fingerprint.hex()}:*", deadline, fingerprint.hex().encode())

    def _cap_matching(self, pattern: str, deadline: float, fingerprint: bytes | None = None) -> int:
        """Cap (as :meth:`_cap_tenant`) the block copies among the keys ``pattern`` matches:
        ``<namespace>:<tenant hash>:<fingerprint>:<block key>`` (children sets, the keyring,
        tombstones and the other keys of the namespace are not blocks), of the model
        ``fingerprint`` (hex) when given."""
        px, _ = self._px(deadline)
        px = max(1, px or 0)  # NOTE: _px says 0 for a deadline passed: it expires at once
        moved = 0
        batch: list[bytes] = []

        def send() -> int:
            replies = self._multi([(k, cap_ttl_command(k, deadline, px)) for k in batch])
            bad = [r for r in replies if not succeeded(r)]
            if bad:
                raise ConnectionError(f"{len(bad)} of {len(batch)} copies not reached ({fault_text(bad[0])})")
            return sum(1 for r in replies if r == 1)

        ns = f"{self._ns}:".encode()
        for k in self._client.scan_iter(match=pattern, count=1000):
            k = bytes(k)
            parts = k[len(ns):].split(b":") if k.startswith(ns) else []
            # NOTE: <tenant hash>:<fingerprint>:<block key>; a children set has a fourth part
            if len(parts) != 3 or (fingerprint is not None and parts[1] != fingerprint):
                continue
            batch.append(k)
            if len(batch) >= 512:
                moved += send()
                batch = []
        if batch:
            moved += send()
        return moved


__all__ = ["Writes"]
