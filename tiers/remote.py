"""Remote tier: encoded blocks in Redis/Valkey (standalone or cluster), shared across nodes.

:class:`RemoteTier` is the tier; each of its parts lives in a module of its own (mixins, as
:class:`kvstore.store.Store`'s are), whose docstring states what it guarantees:

* ``put`` / ``update_ttl`` — :mod:`tiers.remote_put`: encode (the tenant's data key, AES-256-GCM;
  header bound as associated data) and ``SET ... PX`` in one pipelined round trip with the
  block's children-set and models-set entries and a check of the tenant's key. A fault is False.
* ``submit`` / ``submit_ttl`` / ``flush`` — :mod:`tiers.remote_writer`: asynchronous demotion
  through a bounded queue and one writer thread; never blocks (False when full).
* ``get_into`` / ``get_many_into`` / ``get_prefix_into`` / ``contains_many`` / ``prefix_len`` —
  :mod:`tiers.remote_reads`: pipelined; any fault is a *miss* plus a counter, never an exception
  and never other bytes; a value that fails its check is deleted.
* ``delete`` / ``delete_many`` / ``delete_subtrees`` / ``delete_tenant`` / ``purge_tenant`` /
  ``delete_model`` / ``purge_model`` / ``models`` — :mod:`tiers.remote_delete`: ``UNLINK``; a
  subtree found through the children sets, a tenant or model through ``SCAN``; Unavailable when
  a copy may survive.
* ``on_deletion`` — :mod:`tiers.remote_invalidate`: every ``delete_subtrees``, ``purge_model``
  and ``purge_tenant`` is published in the stream ``<namespace>:deletions``, each entry with an
  HMAC under a key derived from the master key (:meth:`open`); a reader thread hands the other
  servers' authenticated entries to the Store (which drops its local copies) and cancels their
  queued demotions here.
* ``usage`` / ``tenant_bytes`` / ``can_fit`` / ``resync`` / ``holds`` —
  :mod:`tiers.remote_accounting`: raw block bytes this server wrote (quotas and capacity are per
  server), and whether its copy of a block is there (a spill of it is not written again).
* tombstones and tenant data keys (key ids) — :mod:`tiers.remote_tenants`.
* the value envelope (deadline, creation time, key id) — :mod:`tiers.remote_envelope`.
* commands under the per-node circuit breaker — :mod:`tiers.remote_calls`; the client
  (``connect``), the keyring's Redis store, the tombstones and the breaker themselves —
  :mod:`tiers.remote_redis`.

Eviction policy: at :meth:`open` the servers' ``maxmemory-policy`` is read (``CONFIG GET``; a
server that refuses it, an ACL or a managed Redis, is skipped silently). An ``allkeys-*`` policy
evicts the tier's bookkeeping keys (the check entry, data keys, tombstones, the models set, the
deletions stream), which have no expiry, with the blocks: a warning is logged and the gauge
``allkeys_eviction`` is 1. A ``volatile-*`` policy (blocks carry a TTL, ``ttl_cap_s``) or
``noeviction`` is required.

This module keeps the tier's shared state (config, client, codec, keyring, clocks, the lock of
counters, accounting, breakers and tombstone copies), its Redis keys, counters and lifecycle.

Keys: ``<namespace>:<tenant hash hex>:<fingerprint hex>:<block key hex>`` (no hash tags, so a
cluster spreads one prefix over every node); ``<block's key>:c``: the children set of a block;
``<namespace>:models``: every model written; ``<namespace>:deletions``: the deletions stream;
``<namespace>:keyring:...``: the tenants' wrapped data keys; ``<namespace>:dropped:...``: the
tenants' tombstones.

Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from redis import Redis
from redis.cluster import RedisCluster

from kvstore.block import Tier
from kvstore.codec import Codec, CodecConfig, tenant_hash
from kvstore.errors import FailedPrecondition
from kvstore.keyring import Keyring
from tiers.base import BlockRef
from tiers.remote_accounting import Accounting
from tiers.remote_calls import FAULTS, BreakerCalls
from tiers.remote_config import RemoteConfig
from tiers.remote_delete import Deletes
from tiers.remote_envelope import ENVELOPE, ENVELOPE_MAGIC, ENVELOPE_V1, ENVELOPE_VERSION, RemoteInfo
from tiers.remote_invalidate import SharedDeletions, derive_deletions_key
from tiers.remote_put import Writes
from tiers.remote_reads import Reads
from tiers.remote_redis import Clock, RedisKeyBackend, connect
from tiers.remote_tenants import KEY_REFRESH_S, TenantKeys
from tiers.remote_writer import DemotionQueue

log = logging.getLogger(__name__)


#: every count the remote tier keeps (``RemoteTier.metrics``, ``remote_*`` in the Store's
#: counters); each starts at 0. NOTE: a count appeared only at its first event, already at 1,
#: so Prometheus' increase() and rate() missed it (an alert on the first fault never fired).
#: A name counted anywhere in tiers/ must be listed here (a test greps the code).
REMOTE_COUNTERS: tuple[str, ...] = (
    "breaker_skips", "breaker_trips", "config_mismatch", "copy_not_verified", "copy_verified",
    "delete_failures", "deletes", "deletions_applied", "deletions_apply_errors",
    "deletions_blocks_dropped", "deletions_demotions_cancelled", "deletions_malformed",
    "deletions_missed", "deletions_own", "deletions_position_unknown", "deletions_publish_failed",
    "deletions_published", "deletions_read_errors", "deletions_rewritten",
    "deletions_rewritten_failed", "deletions_unauthenticated", "error_replies", "exists_checks",
    "faults", "get_bytes", "gets", "hits", "integrity_failures", "key_errors", "key_rereads",
    "key_unavailable", "misses", "misses_absent", "misses_expired", "misses_foreign_key",
    "misses_key_unconfirmed", "misses_parent", "misses_tenant_deleted", "model_keys_deleted",
    "oom", "put_bytes", "put_expired", "put_failures", "put_key_absent", "put_refused",
    "put_stale_key", "put_stored_bytes", "put_tenant_deleted", "puts", "queue_cancelled",
    "queue_dropped", "queue_errors", "queue_failed", "queue_rejected", "queue_skipped_held",
    "queue_submitted", "queue_written", "quota_rejected", "resync_errors", "resync_forgotten",
    "resyncs", "subtree_blocks_deleted", "tenant_keys_deleted", "ttl_cap_failures", "ttl_capped",
    "ttl_moved", "ttl_rejected", "ttl_submitted",
)


class RemoteTier(Reads, Writes, Deletes, SharedDeletions, DemotionQueue, TenantKeys, Accounting,
                 BreakerCalls):
    """See the module docstring. Build with :meth:`open` (or inject a client and codec)."""

    tier = Tier.REMOTE

    def __init__(self, config: RemoteConfig, client: Redis | RedisCluster, codec: Codec, *,
                 keyring: Keyring | None = None, deletions_key: bytes | None = None,
                 clock: Clock = time.time, monotonic: Clock = time.monotonic) -> None:
        self.config = config
        self.capacity = config.capacity_bytes
        self.codec = codec
        self._client = client
        self._keyring = keyring
        self._clock = clock
        self._monotonic = monotonic
        self._ns = config.namespace
        self._th: dict[str, str] = {}  # tenant -> its hash, hex (see _tenant_hex)
        self._counts: Counter[str] = Counter(dict.fromkeys(REMOTE_COUNTERS, 0))
        self._allkeys_eviction = False  # a server's maxmemory-policy is allkeys-* (see open)
        self._lock = threading.Lock()  # counters, accounting, breakers, tombstone copies
        self._init_breakers()
        self._init_accounting()
        self._init_tenants()
        self._init_puts()
        self._init_trees()
        self._init_deletions(deletions_key)  # its reader starts with on_deletion
        self._init_queue()  # NOTE: last: starts the writer thread

    @classmethod
    def open(cls, config: RemoteConfig, master_key: bytes, *, clock: Clock = time.time,
             monotonic: Clock = time.monotonic) -> RemoteTier:
        """Connect, open the shared keyring (raises FailedPrecondition when the master key is
        not the one the keyring was made with, or the server is unreachable) and the codec, and
        derive from the master key the key that authenticates the deletions stream
        (:func:`~tiers.remote_invalidate.derive_deletions_key`; kept on the tier, never logged)."""
        client = connect(config)
        keyring = None
        try:
            if config.encrypt:
                # NOTE: recheck: a Redis restarted empty (or evicting) loses the check entry,
                # and a server with another master key could then make its own
                keyring = Keyring(master_key, RedisKeyBackend(client, config.namespace),
                                  cache_ttl_s=config.key_cache_ttl_s, clock=monotonic, recheck=True,
                                  where=f"the Redis namespace {config.namespace!r}")
        except FAULTS as exc:
            client.close()
            raise FailedPrecondition(f"remote tier unreachable at open: {exc}") from None
        codec = Codec(CodecConfig(compression_level=config.compression_level,
                                  min_compress_ratio=config.min_compress_ratio,
                                  encrypt=config.encrypt, threads=config.codec_threads), keyring)
        tier = cls(config, client, codec, keyring=keyring,
                   deletions_key=derive_deletions_key(master_key, config.namespace),
                   clock=clock, monotonic=monotonic)
        tier._check_eviction_policy()
        return tier

    def _eviction_policies(self) -> dict[str, str]:
        """Each server's (each primary's) ``maxmemory-policy``; Redis faults and refusals
        propagate."""
        client = self._client
        if not isinstance(client, RedisCluster):
            return {"server": str(client.config_get("maxmemory-policy").get("maxmemory-policy"))}
        return {n.name: str(client.config_get("maxmemory-policy", target_nodes=n).get("maxmemory-policy"))
                for n in client.get_primaries()}

    def _check_eviction_policy(self) -> None:
        """Warn (log, gauge ``allkeys_eviction``) when a server evicts keys without a TTL: the
        tier's bookkeeping keys went with the blocks (a deletion then left blocks readable, a
        deleted tenant's tombstone went, another master key could join). Skipped silently when
        ``CONFIG GET`` is refused (ACLs, managed Redis) or fails."""
        try:
            policies = self._eviction_policies()
        except FAULTS:
            return
        bad = sorted({p for p in policies.values() if p.startswith("allkeys-")})
        if not bad:
            return
        self._allkeys_eviction = True
        log.warning("remote tier %r: Redis evicts keys without a TTL (maxmemory-policy %s): the tier's "
                    "data keys, tombstones, models set and deletions stream can be evicted with the blocks; "
                    "use a volatile-* policy (blocks expire, ttl_cap_s) or noeviction", self._ns, "/".join(bad))

    # -- keys, counters -------------------------------------------------------------------------
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
        """Monotonic counters plus gauges (``queue_blocks``, ``queue_bytes``, ``breakers_open``,
        ``allkeys_eviction``: 1 when a server's ``maxmemory-policy`` is ``allkeys-*``)."""
        with self._lock:
            out = dict(self._counts)
            out["breakers_open"] = sum(b.is_open for b in self._breakers.values())
            out["allkeys_eviction"] = int(self._allkeys_eviction)
        out.update(self._queue_gauges())
        return out

    # -- lifecycle ------------------------------------------------------------------------------
    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except FAULTS:
            return False

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Stop the deletions reader, write what is queued (up to ``drain_timeout_s``), stop
        the writer, disconnect."""
        self.stop_deletions()
        self.flush(drain_timeout_s)
        self._stop_writer()
        self.codec.close()
        self._client.close()


__all__ = ["ENVELOPE", "ENVELOPE_MAGIC", "ENVELOPE_V1", "ENVELOPE_VERSION", "FAULTS", "KEY_REFRESH_S", "RemoteInfo",
           "RemoteTier"]
