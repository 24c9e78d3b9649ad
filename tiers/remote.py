"""Remote tier: encoded blocks in Redis/Valkey (standalone or cluster), shared across nodes.

Primitives and what each guarantees:

* ``put(ref, data, ttl_deadline=)`` — encode (the tenant's data key, AES-256-GCM; header bound
  as associated data) and ``SET ... PX``; True when the server stored it. A fault is False.
* ``submit(ref, data, ttl_deadline=)`` — asynchronous demotion: queued for a background writer
  and True, or False at once when the queue is full (depth or bytes): never blocks. ``data``
  then belongs to the tier (the caller must not change it).
* ``get_into`` / ``get_many_into`` / ``get_prefix_into`` — decode into the caller's buffers;
  pipelined. Any fault (node down, timeout, MOVED/ASK the client could not follow, evicted or
  expired key, failed authentication of the value, destroyed tenant key) is a *miss* plus a
  counter, never an exception and never other bytes. A value that fails its check is deleted.
* ``contains_many`` — pipelined ``EXISTS`` of a chain's keys, in prefix order.
* ``delete`` / ``delete_tenant`` / ``delete_model`` — ``UNLINK``; tenant and model deletion
  ``SCAN`` every primary by key prefix. ``delete_tenant`` also destroys the tenant's data key in
  the shared keyring first, so a straggler (or a copy the operator kept) is unreadable.
* ``usage`` / ``tenant_bytes`` — raw block bytes this node wrote (accounted locally: the
  server's own eviction shows up as misses, and the accounting forgets those blocks then).

Keys: ``<namespace>:<tenant hash hex>:<fingerprint hex>:<block key hex>`` (no hash tags, so a
cluster spreads one prefix over every node). Values: :mod:`kvstore.codec` values. The tenants'
data keys are kept, wrapped by the master key, in the same Redis (``<namespace>:keyring:...``)
so every node with the same master key reads every other node's blocks; a node with another
master key fails at open (the keyring's check entry does not unwrap).

Faults are tracked per server (per cluster node) by a circuit breaker: after
``breaker_failures`` consecutive faults the node is skipped (a miss without network) for a
backoff period from ``redis.backoff``; the first call after the period is a probe, which closes
the breaker on success. Command retries are redis-py's ``Retry``. Thread-safe. The client
(``connect``), the keyring's Redis store and the breaker live in :mod:`tiers.remote_redis`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from redis import Redis
from redis.backoff import EqualJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from kvstore.block import Tier
from kvstore.codec import Codec, CodecConfig, tenant_hash
from kvstore.errors import FailedPrecondition, IntegrityError, KeyUnavailable
from kvstore.keyring import Keyring
from kvstore.quantization import QuantArg
from tiers.base import BlockRef, TierUsage, as_bytes_view
from tiers.remote_config import RemoteConfig
from tiers.remote_redis import (
    CircuitBreaker,
    Clock,
    KeyringRace,
    RedisKeyBackend,
    connect,
)

#: Everything a Redis round trip can raise (RedisClusterException is not a RedisError).
FAULTS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
_SKIPPED = object()  # a call not sent because its node's breaker is open
_STANDALONE = "server"


class RemoteTier:
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
        self._lock = threading.Lock()  # counters, accounting, breakers, tenant epochs
        self._breakers: dict[str, CircuitBreaker] = {}
        self._held: dict[tuple[str, bytes], tuple[int, float | None]] = {}
        self._tenant_used: dict[str, int] = {}
        self._used = 0
        self._epochs: dict[str, int] = {}
        self._th: dict[str, str] = {}
        self._put_lock = threading.Lock()
        self._put_scratch = np.empty(0, dtype=np.uint8)
        # asynchronous demotion: a bounded deque drained by one writer thread
        self._cond = threading.Condition()
        self._queue: deque[tuple[BlockRef, np.ndarray, float | None, int, QuantArg]] = deque()
        self._queued_bytes = 0
        self._tenant_queued: dict[str, int] = {}
        self._pending = 0
        self._closed = False
        self._worker = threading.Thread(target=self._drain, name="kvstore-remote-demote",
                                        daemon=True)
        self._worker.start()

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
    def redis_key(self, ref: BlockRef) -> bytes:
        """The Redis key of ``ref`` (namespaced by tenant hash and model fingerprint)."""
        th = self._th.get(ref.tenant)
        if th is None:
            if len(self._th) > 4096:
                self._th.clear()
            th = self._th[ref.tenant] = tenant_hash(ref.tenant).hex()
        return f"{self._ns}:{th}:{ref.spec.fingerprint.hex()}:{ref.key.hex()}".encode()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def metrics(self) -> dict[str, int]:
        """Monotonic counters plus gauges (``queue_blocks``, ``queue_bytes``, ``breakers_open``)."""
        with self._lock:
            out = dict(self._counts)
            out["breakers_open"] = sum(b.is_open for b in self._breakers.values())
        with self._cond:
            out["queue_blocks"], out["queue_bytes"] = len(self._queue), self._queued_bytes
        return out

    def _node(self, key: bytes) -> str:
        if not isinstance(self._client, RedisCluster):
            return _STANDALONE
        try:
            return self._client.get_node_from_key(key).name
        except FAULTS:
            return "?"  # slot not covered yet: one breaker for the unknown

    def _breaker(self, node: str) -> CircuitBreaker:
        with self._lock:
            b = self._breakers.get(node)
            if b is None:
                # NOTE: equal jitter keeps at least half the period (full jitter may give ~0).
                backoff = EqualJitterBackoff(cap=self.config.breaker_cap_s,
                                             base=self.config.breaker_base_s)
                b = self._breakers[node] = CircuitBreaker(self.config.breaker_failures, backoff,
                                                          self._monotonic)
            return b

    def _outcome(self, node: str, ok: bool) -> None:
        if self._breaker(node).record(ok):
            self._count("breaker_trips")
        if not ok:
            self._count("faults")

    def _call(self, key: bytes, fn: Callable[[], Any]) -> Any:
        """Run one command under its node's breaker: the result, or ``_SKIPPED`` / a fault."""
        node = self._node(key)
        if not self._breaker(node).allow():
            self._count("breaker_skips")
            return _SKIPPED
        try:
            res = fn()
        except FAULTS as exc:
            self._outcome(node, False)
            return exc
        self._outcome(node, True)
        return res

    def _batch(self, cmd: str, keys: Sequence[bytes], *args: Any) -> list[Any]:
        """``cmd key *args`` for every key, pipelined; per key: the reply, a fault, or
        ``_SKIPPED``. In cluster mode a pipeline that fails as a whole (a node unreachable) is
        replayed one command at a time, so the live nodes still answer."""
        nodes = [self._node(k) for k in keys]
        out: list[Any] = [_SKIPPED] * len(keys)
        send = []
        for i, n in enumerate(nodes):
            if self._breaker(n).allow():
                send.append(i)
            else:
                self._count("breaker_skips")
        if not send:
            return out
        try:
            pipe = self._client.pipeline(transaction=False)
            for i in send:
                pipe.execute_command(cmd, keys[i], *args)
            replies = pipe.execute(raise_on_error=False)
        except FAULTS as exc:
            if not isinstance(self._client, RedisCluster):
                self._outcome(_STANDALONE, False)
                for i in send:
                    out[i] = exc
                return out
            for i in send:
                out[i] = self._call(keys[i], lambda i=i: self._client.execute_command(
                    cmd, keys[i], *args))
            return out
        failed: set[str] = set()
        for i, r in zip(send, replies):
            out[i] = r
            if isinstance(r, BaseException):
                failed.add(nodes[i])
        for n in {nodes[i] for i in send}:
            self._outcome(n, n not in failed)
        return out

    # -- accounting -----------------------------------------------------------------------------
    def _account(self, ref: BlockRef, deadline: float | None) -> None:
        with self._lock:
            old = self._held.pop(ref.ident, None)
            if old is not None:
                self._used -= old[0]
                self._tenant_used[ref.tenant] -= old[0]
            self._held[ref.ident] = (ref.nbytes, deadline)
            self._used += ref.nbytes
            self._tenant_used[ref.tenant] = self._tenant_used.get(ref.tenant, 0) + ref.nbytes

    def _forget(self, ident: tuple[str, bytes]) -> None:
        with self._lock:
            old = self._held.pop(ident, None)
            if old is not None:
                self._used -= old[0]
                self._tenant_used[ident[0]] -= old[0]

    def _prune_expired(self) -> None:
        now = self._clock()
        with self._lock:
            gone = [k for k, (_, d) in self._held.items() if d is not None and now >= d]
        for k in gone:
            self._forget(k)

    def usage(self) -> TierUsage:
        self._prune_expired()
        with self._lock:
            return TierUsage(Tier.REMOTE, self._used, self.capacity, len(self._held))

    def tenant_bytes(self, tenant: str) -> int:
        """Raw bytes of ``tenant``'s blocks this node wrote that have not expired or gone."""
        self._prune_expired()
        with self._lock:
            return self._tenant_used.get(tenant, 0)

    def can_fit(self, nbytes: int) -> bool:
        with self._lock:
            return self._used + nbytes <= self.capacity

    def charge(self, nbytes: int) -> int:
        return nbytes

    def contains(self, ref: BlockRef) -> bool:
        return self.contains_many([ref])[0]

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

    def _ensure_key(self, tenant: str) -> None:
        if self._keyring is None:
            return
        try:
            self._keyring.data_key(tenant, create=True)
        except KeyringRace:
            self._keyring.data_key(tenant, create=True)

    def _put_with(self, scratch: np.ndarray, ref: BlockRef, data: np.ndarray,
                  deadline: float | None, quant: QuantArg = None) -> tuple[bool, np.ndarray]:
        px, local_deadline = self._px(deadline)
        if px == 0:
            self._count("put_expired")
            return False, scratch
        if not self.can_fit(ref.nbytes):
            self._count("put_refused")
            return False, scratch
        try:
            self._ensure_key(ref.tenant)
            need = self.codec.max_encoded_nbytes(ref.spec)
            if scratch.shape[0] < need:
                scratch = np.empty(need, dtype=np.uint8)
            n = self.codec.encode_into(ref.tenant, ref.key, ref.spec, data, scratch, quant=quant)
        except FAULTS + (FailedPrecondition,) as exc:  # keyring unreachable or unusable
            self._count("put_failures")
            self._count("key_errors" if isinstance(exc, FailedPrecondition) else "faults")
            return False, scratch
        key = self.redis_key(ref)
        value = memoryview(scratch)[:n]
        res = self._call(key, lambda: self._client.set(key, value, px=px))
        if res is not True:
            self._count("put_failures")
            return False, scratch
        self._account(ref, local_deadline)
        self._count("puts")
        self._count("put_bytes", ref.nbytes)
        self._count("put_stored_bytes", n)
        return True, scratch

    def put(self, ref: BlockRef, data: Any, *, ttl_deadline: float | None = None,
            quant: QuantArg = None) -> bool:
        """Encode and store synchronously; False on a fault, a full tier or a past deadline.
        ``quant``: store a quantized copy (the codec's formats; a get returns it dequantized)."""
        view = as_bytes_view(data)
        with self._put_lock:
            ok, self._put_scratch = self._put_with(self._put_scratch, ref, view, ttl_deadline, quant)
        return ok

    def submit(self, ref: BlockRef, data: Any, *, ttl_deadline: float | None = None,
               quant: QuantArg = None, quota: int | None = None) -> bool:
        """Queue an asynchronous put; False (nothing queued) when the queue is full or closed,
        or when the tenant's blocks here, written and queued, would pass ``quota`` bytes.
        ``data`` (a buffer of ``ref.nbytes``) is owned by the tier from now on."""
        view = as_bytes_view(data)
        with self._cond:
            if (self._closed or len(self._queue) >= self.config.queue_depth
                    or self._queued_bytes + ref.nbytes > self.config.max_inflight_bytes):
                with self._lock:
                    self._counts["queue_rejected"] += 1
                return False
            queued = self._tenant_queued.get(ref.tenant, 0)
            if quota is not None:
                with self._lock:
                    held = self._tenant_used.get(ref.tenant, 0)
                    if ref.ident in self._held:  # written over: its old bytes go
                        held -= self._held[ref.ident][0]
                    if held + queued + ref.nbytes > quota:
                        self._counts["quota_rejected"] += 1
                        return False
            epoch = self._epochs.get(ref.tenant, 0)
            self._queue.append((ref, view, ttl_deadline, epoch, quant))
            self._queued_bytes += ref.nbytes
            self._tenant_queued[ref.tenant] = queued + ref.nbytes
            self._pending += 1
            self._cond.notify_all()
        self._count("queue_submitted")
        return True

    def _drain(self) -> None:
        scratch = np.empty(0, dtype=np.uint8)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                ref, data, deadline, epoch, quant = self._queue.popleft()
            try:
                if self._epochs.get(ref.tenant, 0) != epoch:
                    self._count("queue_dropped")  # the tenant was deleted meanwhile
                else:
                    ok, scratch = self._put_with(scratch, ref, data, deadline, quant)
                    self._count("queue_written" if ok else "queue_failed")
            except Exception:  # noqa: BLE001 - NOTE: counted; the writer must outlive any item
                self._count("queue_failed")
                self._count("queue_errors")
            finally:
                with self._cond:
                    self._queued_bytes -= ref.nbytes
                    self._unqueue(ref)
                    self._pending -= 1
                    self._cond.notify_all()

    def _unqueue(self, ref: BlockRef) -> None:
        left = self._tenant_queued.get(ref.tenant, 0) - ref.nbytes
        if left > 0:
            self._tenant_queued[ref.tenant] = left
        else:
            self._tenant_queued.pop(ref.tenant, None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued demotion was attempted; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    # -- get ------------------------------------------------------------------------------------
    def _decode(self, ref: BlockRef, value: Any, out: np.ndarray) -> bool:
        """One fetched reply -> out; False (and counted) on a miss of any kind."""
        if value is None:
            self._count("misses_absent")  # never written, expired, evicted or deleted
            self._forget(ref.ident)
            return False
        if isinstance(value, BaseException) or value is _SKIPPED:
            return False
        try:
            self.codec.decode(ref.tenant, ref.key, ref.spec, value, out=out)
        except (IntegrityError, FailedPrecondition, *FAULTS) as exc:
            out.fill(0)  # NOTE: decryption may have written unauthenticated bytes there
            if isinstance(exc, KeyUnavailable):
                self._count("key_unavailable")
                self.delete(ref)
            elif isinstance(exc, IntegrityError):
                self._count("integrity_failures")
                self.delete(ref)
            elif isinstance(exc, FailedPrecondition):  # the keyring cannot unwrap the key
                self._count("key_errors")
            else:  # the keyring's own round trip failed
                self._count("faults")
            return False
        self._count("hits")
        self._count("get_bytes", ref.nbytes)
        return True

    def get_into(self, ref: BlockRef, out: Any) -> bool:
        """Copy the block into ``out`` (``ref.nbytes``); False on a miss of any kind."""
        key = self.redis_key(ref)
        value = self._call(key, lambda: self._client.get(key))
        ok = self._decode(ref, value, as_bytes_view(out))
        self._count("gets")
        if not ok:
            self._count("misses")
        return ok

    def _fetch(self, refs: Sequence[BlockRef], outs: Sequence[Any], stop_at_miss: bool) -> list[bool]:
        got = [False] * len(refs)
        budget = self.config.max_inflight_bytes
        i = 0
        while i < len(refs):
            j, nbytes = i, 0
            while j < len(refs) and (j == i or nbytes + refs[j].nbytes <= budget):
                nbytes += refs[j].nbytes
                j += 1
            values = self._batch("GET", [self.redis_key(r) for r in refs[i:j]])
            for k, value in enumerate(values):
                got[i + k] = self._decode(refs[i + k], value, as_bytes_view(outs[i + k]))
                if stop_at_miss and not got[i + k]:
                    break
            if stop_at_miss and not all(got[i:j]):
                break
            i = j
        self._count("gets", len(refs))
        self._count("misses", len(refs) - sum(got))
        return got

    def get_many_into(self, refs: Sequence[BlockRef], outs: Sequence[Any]) -> list[bool]:
        """Pipelined gets (batches of at most ``max_inflight_bytes``); per block: served?"""
        return self._fetch(refs, outs, stop_at_miss=False)

    def get_prefix_into(self, refs: Sequence[BlockRef], outs: Sequence[Any]) -> int:
        """Pipelined gets of a chain; returns how many leading blocks were served (a later
        block is not decoded once one misses)."""
        got = self._fetch(refs, outs, stop_at_miss=True)
        n = 0
        while n < len(got) and got[n]:
            n += 1
        return n

    def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        """Pipelined existence checks in the given (prefix) order; a fault reads as absent."""
        replies = self._batch("EXISTS", [self.redis_key(r) for r in refs])
        self._count("exists_checks", len(refs))
        return [r == 1 for r in replies]

    def prefix_len(self, refs: Sequence[BlockRef]) -> int:
        """How many leading blocks of the chain ``refs`` exist remotely."""
        n = 0
        for found in self.contains_many(refs):
            if not found:
                break
            n += 1
        return n

    # -- delete ---------------------------------------------------------------------------------
    def delete(self, ref: BlockRef) -> bool:
        """Remove one block; True if the server had it (False also on a fault)."""
        self._forget(ref.ident)
        key = self.redis_key(ref)
        res = self._call(key, lambda: self._client.unlink(key))
        self._count("deletes")
        return res == 1

    def update_ttl(self, ref: BlockRef, ttl_deadline: float | None) -> bool:
        """Move a block's expiry (later only is the Store's business); False on a fault."""
        px, local = self._px(ttl_deadline)
        if px == 0:
            return self.delete(ref)
        key = self.redis_key(ref)
        fn = (lambda: self._client.persist(key)) if px is None else \
            (lambda: self._client.pexpire(key, px))
        res = self._call(key, fn)
        if res is True or res == 1:
            with self._lock:
                if ref.ident in self._held:
                    self._held[ref.ident] = (ref.nbytes, local)
            return True
        return False

    def _purge(self, pattern: str) -> int:
        n = 0
        batch: list[bytes] = []
        for k in self._client.scan_iter(match=pattern, count=1000):
            batch.append(k)
            if len(batch) >= 512:
                n += self._unlink_all(batch)
                batch = []
        return n + (self._unlink_all(batch) if batch else 0)

    def _unlink_all(self, keys: list[bytes]) -> int:
        replies = self._batch("UNLINK", keys)
        bad = [r for r in replies if not isinstance(r, int)]
        if bad:
            raise FailedPrecondition(f"remote tier: {len(bad)} keys could not be deleted "
                                     f"({bad[0]!r}); retry the deletion")
        return sum(replies)

    def delete_tenant(self, tenant: str) -> int:
        """Destroy the tenant's data key (shared keyring), drop its queued demotions and
        ``UNLINK`` every key under its prefix on every primary; returns keys deleted.
        Raises FailedPrecondition when a server cannot be reached (safe to retry)."""
        with self._cond:
            self._epochs[tenant] = self._epochs.get(tenant, 0) + 1
        try:
            if self._keyring is not None:
                self._keyring.destroy(tenant)
            th = tenant_hash(tenant).hex()
            n = self._purge(f"{self._ns}:{th}:*")
        except FAULTS as exc:
            raise FailedPrecondition(f"remote tier: deleting tenant {tenant!r} failed: {exc}; "
                                     f"retry") from None
        with self._lock:
            for ident in [i for i in self._held if i[0] == tenant]:
                self._used -= self._held.pop(ident)[0]
            self._tenant_used.pop(tenant, None)
        self._count("tenant_keys_deleted", n)
        return n

    def delete_model(self, fingerprint: bytes) -> int:
        """``UNLINK`` every block of a model fingerprint (all tenants); returns keys deleted."""
        try:
            n = self._purge(f"{self._ns}:*:{fingerprint.hex()}:*")
        except FAULTS as exc:
            raise FailedPrecondition(f"remote tier: purging a model failed: {exc}") from None
        with self._lock:
            self._counts["model_keys_deleted"] += n
        return n

    # -- lifecycle ------------------------------------------------------------------------------
    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except FAULTS:
            return False

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Write what is queued (up to ``drain_timeout_s``), stop the writer, disconnect."""
        self.flush(drain_timeout_s)
        with self._cond:
            self._closed = True
            self._pending -= len(self._queue)
            self._queued_bytes -= sum(item[0].nbytes for item in self._queue)
            self._queue.clear()
            self._tenant_queued.clear()
            self._cond.notify_all()
        # NOTE: the item being written ends within one command's timeouts and retries.
        cfg = self.config
        self._worker.join(timeout=(cfg.op_timeout_s + cfg.connect_timeout_s) * (cfg.retries + 1) + 1)
        self.codec.close()
        self._client.close()


__all__ = ["FAULTS", "RemoteTier"]
