"""Remote tier: encoded blocks in Redis/Valkey (standalone or cluster), shared across nodes.

Primitives and what each guarantees:

* ``put(ref, data, ttl_deadline=, created=)`` — encode (the tenant's data key, AES-256-GCM;
  header bound as associated data) and ``SET ... PX``; True when the server stored it. A fault
  is False. ``created``: when the block was made (its ``BlockMeta.created``), see tombstones.
* ``submit(ref, data, ttl_deadline=, created=)`` — asynchronous demotion: queued for a
  background writer and True, or False at once when the queue is full (depth or bytes): never
  blocks. ``data`` then belongs to the tier (the caller must not change it).
* ``get_into`` / ``get_many_into`` / ``get_prefix_into`` — decode into the caller's buffers;
  pipelined. Any fault (node down, timeout, MOVED/ASK the client could not follow, evicted or
  expired key, failed authentication of the value, destroyed tenant key) is a *miss* plus a
  counter, never an exception and never other bytes. A value that fails its check is deleted.
  ``info=`` (a list) receives each served block's :class:`RemoteInfo`: the TTL deadline and
  creation time it was written with, so a promoted block keeps them.
* ``contains_many`` — pipelined ``EXISTS`` of a chain's keys, in prefix order.
* ``delete`` / ``delete_many`` / ``delete_subtrees`` / ``delete_tenant`` / ``delete_model`` —
  ``UNLINK``; tenant and model deletion ``SCAN`` every primary by key prefix. ``delete_many``
  also cancels the blocks' queued demotions and raises :class:`~kvstore.errors.Unavailable` when
  any copy could not be reached (``delete`` answers False then: it is the miss path's).
  ``delete_subtrees`` (the Store's ``delete``) does the same for blocks and every block written
  under them by any server, found through the children sets (below).
  ``delete_tenant`` leaves a tombstone, then destroys the tenant's data key in the shared
  keyring, so a straggler (or a copy the operator kept) is unreadable.
* ``usage`` / ``tenant_bytes`` — raw block bytes this node wrote (accounted locally: the
  server's own eviction shows up as misses, and the accounting forgets those blocks then; a
  write refused for capacity or quota re-counts them with ``EXISTS``, at most once every
  ``accounting_resync_s``, so blocks that vanished unseen — a ``FLUSHALL``, a purge by another
  server — stop counting).

Keys: ``<namespace>:<tenant hash hex>:<fingerprint hex>:<block key hex>`` (no hash tags, so a
cluster spreads one prefix over every node). ``<namespace>:models``: the fingerprints of every
model written (each server adds one the first time it writes a block of it), so a server that
never saw a model (restarted, another replica; a service Delete carries keys, no model) deletes
its blocks too. Children sets: a write that knows the block's parent
(``parent=``: the Store always passes it) adds the block's key to the Redis set
``<parent's key>:c`` in the same pipelined round trip (a Lua script that keeps the set alive at
least as long as its longest-lived member; a write whose set could not be updated is taken back),
so a deletion finds every descendant written by any server without a ``SCAN``: one pipelined
``SMEMBERS`` round trip per level of the subtree. Costs: one more command per write (same round
trip), about 40 bytes of Redis memory per non-root block, and a deletion as many round trips as
the deleted subtree has levels (a 1,000-block chain: 1,000 round trips). A queued demotion of a
block under a block being deleted is dropped. Blocks written before this (no children set) are
found only through the local subtree the deleting server passes. Values: a 32-byte envelope of this tier
(:data:`ENVELOPE`: magic, version, the block's TTL deadline and creation time, NaN = none, and
the id of the tenant data key it was encrypted with) then a :mod:`kvstore.codec` value (the
24-byte version 1, without the key id, is still read). Redis' own expiry (``PX``) is the deadline capped at
``ttl_cap_s``; the envelope keeps the deadline itself, so a block promoted from here keeps it
(it got the tenant's default TTL before, and a re-spill then wrote it for the whole cap), and a
value read at or past its deadline is a miss, and is deleted once ``skew_grace_s`` past it
(the servers' clocks differ). NOTE: the envelope is not
authenticated (the codec header is): whoever can write the Redis can move a deadline, as they
can already put back a value deleted before. A value without the envelope (an older version)
is read with nothing known (``RemoteInfo.known`` False). The tenants' data keys are kept,
wrapped by the master key, in the same Redis (``<namespace>:keyring:...``) so every node with
the same master key reads every other node's blocks; a node with another master key fails at
open (the keyring's check entry does not unwrap).

Key ids (a tenant deleted and created again under its name gets a new data key, while other
servers may hold the old one cached for ``key_cache_ttl_s``): a reader that finds a value whose
key id is not its cached key's re-reads the key from Redis once (under the breaker, at most once
every :data:`KEY_REFRESH_S` per tenant) before anything else: the value then decodes, or is
under a key the tenant no longer has (a miss, deleted: nobody can read it), or — not confirmed
— a miss that deletes nothing. Only a value whose key id matches and still fails its check is
damaged (deleted, ``integrity_failures``). A writer reads the tenant's wrapped key and tombstone
in the same pipelined round trip as its ``SET``: when the key is not the one it encrypted with
(or is gone and a tombstone says the tenant was deleted), it takes the value back, forgets the
key and the tombstone it had cached, and writes once more with what it reads then
(``put_stale_key``), so no value is left under a destroyed key. A key gone without a tombstone
(lost with a cluster node, a flush) is not replaced: the cached copy goes on being used, as
before.

Tombstones: ``delete_tenant`` records the deletion time in ``<namespace>:dropped:<hex tenant>``
(:class:`~tiers.remote_redis.TenantTombstones`, never expiring) before it destroys the key. Every
server refuses to write a block of that tenant made at or before that time (counted
``put_tenant_deleted``: another server's local blocks or queue would otherwise re-create the key
and bring the deleted data back), and reads such a value as a miss and deletes it. Blocks made
after the deletion (a tenant created again under the name) are written as usual. A server
re-reads the tombstone whenever it re-reads the tenant's key (after ``key_cache_ttl_s``), so it
honours a deletion made elsewhere within that time; the times are wall clocks of different
servers (skew counts). A ``FLUSHALL`` removes the tombstones with everything else.

Quotas and capacity are per server: each server counts the blocks it wrote itself (see
``RemoteConfig.capacity_bytes``), so servers sharing one Redis together may hold up to their
number times a tenant's remote quota there.

Faults are tracked per server (per cluster node) by a circuit breaker: after
``breaker_failures`` consecutive faults the node is skipped (a miss without network) for a
backoff period from ``redis.backoff``; the first call after the period is a probe, which closes
the breaker on success. Keyring and tombstone reads go through the breaker too (a hung Redis
stalled every write for its timeouts and never opened it). Command retries are redis-py's
``Retry``. Thread-safe. The client (``connect``), the keyring's Redis store, the tombstones and
the breaker live in :mod:`tiers.remote_redis`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import numpy as np
from redis import Redis
from redis.cluster import RedisCluster

from kvstore.block import Tier
from kvstore.codec import Codec, CodecConfig, tenant_hash
from kvstore.errors import FailedPrecondition
from kvstore.keyring import Keyring
from kvstore.quantization import QuantArg
from tiers.base import BlockRef, as_bytes_view
from tiers.remote_accounting import Accounting
from tiers.remote_calls import FAULTS, BreakerCalls, succeeded
from tiers.remote_config import RemoteConfig
from tiers.remote_delete import Deletes
from tiers.remote_envelope import (
    ENVELOPE,
    ENVELOPE_MAGIC,
    ENVELOPE_V1,
    ENVELOPE_VERSION,
    NO_KID,
    RemoteInfo,
    pack_envelope,
    update_ttl_command,
)
from tiers.remote_reads import Reads
from tiers.remote_redis import (
    Clock,
    RedisKeyBackend,
    connect,
)
from tiers.remote_tenants import KEY_REFRESH_S, TenantKeys
from tiers.remote_writer import DemotionQueue

_STALE = object()  # a write made with a data key that is not the tenant's any more

class RemoteTier(Reads, Deletes, DemotionQueue, TenantKeys, Accounting, BreakerCalls):
    """See the module docstring. Build with :meth:`open` (or inject a client and codec)."""

    tier = Tier.REMOTE

    def __init__(self, config: RemoteConfig, client: Redis | RedisCluster, codec: Codec, *,
                 keyring: Keyring | None = None, clock: Clock = time.time,
                 monotonic: Clock = time.monotonic) -> None:
        self.config = config
        self.capacity = config.capacity_bytes
        self.codec = codec
        self._client = client
        self._keyring = keyring
        self._clock = clock
        self._monotonic = monotonic
        self._ns = config.namespace
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # counters, accounting, breakers, marks
        self._init_breakers()
        self._init_accounting()
        self._init_tenants()
        self._th: dict[str, str] = {}
        self._put_lock = threading.Lock()
        self._put_scratch = np.empty(0, dtype=np.uint8)
        self._init_trees()
        self._init_queue()  # NOTE: last: starts the writer thread

    @classmethod
    def open(cls, config: RemoteConfig, master_key: bytes, *, clock: Clock = time.time,
             monotonic: Clock = time.monotonic) -> RemoteTier:
        """Connect, open the shared keyring (raises FailedPrecondition when the master key is
        not the one the keyring was made with, or the server is unreachable) and the codec."""
        client = connect(config)
        keyring = None
        try:
            if config.encrypt:
                keyring = Keyring(master_key, RedisKeyBackend(client, config.namespace),
                                  cache_ttl_s=config.key_cache_ttl_s, clock=monotonic)
        except FAULTS as exc:
            client.close()
            raise FailedPrecondition(f"remote tier unreachable at open: {exc}") from None
        codec = Codec(CodecConfig(compression_level=config.compression_level,
                                  min_compress_ratio=config.min_compress_ratio,
                                  encrypt=config.encrypt, threads=config.codec_threads), keyring)
        return cls(config, client, codec, keyring=keyring, clock=clock, monotonic=monotonic)

    # -- keys, counters, breakers -------------------------------------------------------------
    def _tenant_hex(self, tenant: str) -> str:
        th = self._th.get(tenant)
        if th is None:
            if len(self._th) > 4096:
                self._th.clear()
            th = self._th[tenant] = tenant_hash(tenant).hex()
        return th

    def _value_key(self, tenant: str, fingerprint: bytes, key: bytes) -> bytes:
        return f"{self._ns}:{self._tenant_hex(tenant)}:{fingerprint.hex()}:{key.hex()}".encode()

    def redis_key(self, ref: BlockRef) -> bytes:
        """The Redis key of ``ref`` (namespaced by tenant hash and model fingerprint)."""
        return self._value_key(ref.tenant, ref.spec.fingerprint, ref.key)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def metrics(self) -> dict[str, int]:
        """Monotonic counters plus gauges (``queue_blocks``, ``queue_bytes``, ``breakers_open``)."""
        with self._lock:
            out = dict(self._counts)
            out["breakers_open"] = sum(b.is_open for b in self._breakers.values())
        out.update(self._queue_gauges())
        return out

    # -- put ------------------------------------------------------------------------------------
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
        self._account(ref, local_deadline, self.redis_key(ref))
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
        pack_envelope(scratch, deadline, created, kid)
        key = self.redis_key(ref)
        value = memoryview(scratch)[:ENVELOPE.size + n]
        # NOTE: the child goes into its parent's children set (in the same round trip), so a
        # delete of any ancestor finds it (see delete_subtrees); its model into the models set,
        # so a server that never saw the model can delete its blocks
        fp = ref.spec.fingerprint
        new_model = self._add_model(fp)
        cmds = self._add_child(ref, parent, px) + new_model
        at = len(cmds)
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
        unsure = not all(succeeded(r) for i, r in enumerate(replies) if i != at)
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
        if new_model:
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
            self._held_deadline(ref.ident, local)
            return True
        return False

    # -- lifecycle ------------------------------------------------------------------------------
    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except FAULTS:
            return False

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Write what is queued (up to ``drain_timeout_s``), stop the writer, disconnect."""
        self.flush(drain_timeout_s)
        self._stop_writer()
        self.codec.close()
        self._client.close()


__all__ = ["ENVELOPE", "ENVELOPE_MAGIC", "ENVELOPE_V1", "ENVELOPE_VERSION", "FAULTS", "KEY_REFRESH_S", "RemoteInfo",
           "RemoteTier"]
