"""Redis primitives of the remote tier: the client, the shared keyring's store, the breaker.

Primitives and what each guarantees:

* ``connect(config)`` — a redis-py client for a :class:`~tiers.remote_config.RemoteConfig`:
  ``Redis`` (standalone, TLS picked from the config) or ``RedisCluster`` (serves the slots of
  live nodes while one is down). Connects lazily; command retries are redis-py's ``Retry``
  with exponential jittered backoff (``retries``, ``retry_base_s``, ``retry_cap_s``).
* ``RedisKeyBackend(client, namespace)`` — the :class:`kvstore.keyring.Keyring`'s mapping
  store in Redis: ``<namespace>:keyring:<hex(tenant)>`` -> wrapped data key. Creation is
  ``SET NX``, so a tenant's data key is never overwritten; when another node created a
  different key first, ``__setitem__`` raises :class:`KeyringRace` and the next read returns
  the winner's key. Reads and deletes raise ``KeyError`` for an absent tenant; Redis faults
  propagate to the caller.
* ``KeyringRace`` — a :class:`kvstore.errors.FailedPrecondition`: lost creation race, resolved
  by reading the key again.
* ``TenantTombstones(client, namespace)`` — ``<namespace>:dropped:<hex(tenant)>`` -> the wall-clock
  time a tenant was last deleted (``mark`` keeps the latest time: a Lua script, one key, so it
  works on a cluster too). The markers never expire: a server that still holds blocks of the
  tenant made before its deletion (its own local tiers, its queue) must find the marker whenever
  it would write them. Redis faults propagate to the caller.
* ``CircuitBreaker(failures, backoff, clock)`` — consecutive-fault breaker of one server:
  ``failures`` faults in a row open it for ``backoff.compute(trips)`` seconds of ``clock``;
  ``allow()`` is False while open; after the period the first fault reopens it at once (for a
  longer period) and a success closes it. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from redis import Redis
from redis.backoff import AbstractBackoff, ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvstore.errors import FailedPrecondition
from tiers.remote_config import RemoteConfig

Clock = Callable[[], float]


def connect(config: RemoteConfig) -> Redis | RedisCluster:
    """A redis-py client for ``config`` (``RedisCluster`` in cluster mode); connects lazily."""
    retry = Retry(ExponentialWithJitterBackoff(cap=config.retry_cap_s, base=config.retry_base_s),
                  config.retries)
    kw: dict[str, Any] = {
        "socket_timeout": config.op_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "retry": retry, "max_connections": config.max_connections, "username": config.username,
        "password": config.password.get_secret_value() if config.password else None}
    if config.use_tls:
        kw.update(ssl=True, ssl_ca_certs=str(config.tls_ca_file) if config.tls_ca_file else None,
                  ssl_certfile=str(config.tls_cert_file) if config.tls_cert_file else None,
                  ssl_keyfile=str(config.tls_key_file) if config.tls_key_file else None,
                  ssl_cert_reqs="required" if config.tls_verify else "none",
                  ssl_check_hostname=config.tls_verify)
    if not config.cluster:
        url = config.urls[0]
        if kw.pop("ssl", False) and url.startswith("redis://"):
            url = "rediss://" + url[len("redis://"):]  # from_url picks TLS from the scheme
        return Redis.from_url(url, **kw)
    nodes = []
    for u in config.urls:
        parts = urlsplit(u)
        nodes.append(ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379))
    # NOTE: require_full_coverage=False keeps serving the slots of live nodes while one is down.
    return RedisCluster(startup_nodes=nodes, require_full_coverage=False, **kw)


def keyring_key(prefix: str, tenant: str) -> str:
    """The Redis key of ``tenant``'s wrapped data key under ``prefix`` (``<ns>:keyring:``)."""
    return prefix + tenant.encode().hex()


class KeyringRace(FailedPrecondition):
    """Another node created the same tenant's data key first; reading it again resolves it."""


class RedisKeyBackend(MutableMapping[str, bytes]):
    """The keyring's store in Redis: ``<ns>:keyring:<hex(tenant)>`` -> wrapped data key.

    Creation is ``SET NX``: when two nodes create a tenant's key at once, the loser raises
    :class:`KeyringRace` (the Keyring then caches nothing) and its next read gets the winner's."""

    def __init__(self, client: Redis | RedisCluster, namespace: str) -> None:
        self._client = client
        self._prefix = f"{namespace}:keyring:"

    def _k(self, tenant: str) -> str:
        return keyring_key(self._prefix, tenant)

    def __getitem__(self, tenant: str) -> bytes:
        v = self._client.get(self._k(tenant))
        if v is None:
            raise KeyError(tenant)
        return bytes(v)

    def __setitem__(self, tenant: str, wrapped: bytes) -> None:
        if (not self._client.set(self._k(tenant), wrapped, nx=True)
                and self._client.get(self._k(tenant)) != wrapped):
            raise KeyringRace(f"tenant {tenant!r}'s data key was created by another node")

    def __delitem__(self, tenant: str) -> None:
        if not self._client.delete(self._k(tenant)):
            raise KeyError(tenant)

    def __iter__(self) -> Iterator[str]:
        names = [bytes(k).decode()[len(self._prefix):] for k in
                 self._client.scan_iter(match=self._prefix + "*", count=1000)]
        return iter([bytes.fromhex(n).decode() for n in names])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class TenantTombstones:
    """Deletion markers of tenants, shared by every server on the Redis (see the module doc)."""

    # NOTE: keeps the later of the stored and the given time (a server whose clock lags must
    # not move a deletion back); returns the time now stored
    _MARK = ("local v = redis.call('GET', KEYS[1]) "
             "if (not v) or tonumber(v) < tonumber(ARGV[1]) then "
             "redis.call('SET', KEYS[1], ARGV[1]) return ARGV[1] end return v")

    def __init__(self, client: Redis | RedisCluster, namespace: str) -> None:
        self._client = client
        self._prefix = f"{namespace}:dropped:"

    def key(self, tenant: str) -> str:
        return self._prefix + tenant.encode().hex()

    def get(self, tenant: str) -> float | None:
        """When ``tenant`` was last deleted (seconds since the epoch), or None: never."""
        v = self._client.get(self.key(tenant))
        return None if v is None else float(v)

    def mark(self, tenant: str, when: float) -> float:
        """Record a deletion of ``tenant`` at ``when``; returns the time now recorded."""
        return float(self._client.eval(self._MARK, 1, self.key(tenant), repr(float(when))))


class CircuitBreaker:
    """Consecutive-fault breaker for one server; open periods come from ``backoff``.

    ``allow()`` is False while open. When the period ends calls go through again; the first
    fault then reopens it at once, for a longer period (``backoff.compute(trips)``)."""

    def __init__(self, failures: int, backoff: AbstractBackoff, clock: Clock) -> None:
        self._threshold = failures
        self._backoff = backoff
        self._clock = clock
        self._lock = threading.Lock()
        self._fails = 0
        self._trips = 0
        self._open_until = 0.0

    def allow(self) -> bool:
        return self._clock() >= self._open_until

    @property
    def is_open(self) -> bool:
        return not self.allow()

    def record(self, ok: bool) -> bool:
        """Record one call's outcome; True when this fault opened the breaker."""
        with self._lock:
            if ok:
                self._fails = self._trips = 0
                self._open_until = 0.0
                return False
            self._fails += 1
            if self._fails < self._threshold:
                return False
            self._trips += 1
            self._fails = self._threshold - 1  # the probe after the open period decides
            self._open_until = self._clock() + self._backoff.compute(self._trips)
            return True


__all__ = ["CircuitBreaker", "Clock", "KeyringRace", "RedisKeyBackend", "TenantTombstones", "connect",
           "keyring_key"]
