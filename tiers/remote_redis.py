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
  ``failures`` faults in a row open it for ``backoff.compute(trips)`` seconds of ``clock``
  (``backoff`` is injected, so is ``clock``: tests set both). ``admit()`` says whether a call
  goes: :attr:`Admit.SKIP` while open; when a period ends, exactly one caller gets
  :attr:`Admit.PROBE` and every other one keeps getting SKIP until the probe's outcome is
  recorded: a success closes the breaker, a fault opens the next, longer period, and a probe
  that ended without a word on the server (``release``) lets the next call probe instead.
  Thread-safe.
"""

from __future__ import annotations

import enum
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


class Admit(enum.Enum):
    """What :meth:`CircuitBreaker.admit` lets a call do."""

    SKIP = "skip"  # open (or another call is the probe): send nothing, a miss
    CALL = "call"  # closed: send it
    PROBE = "probe"  # the one call after an open period: send it; its outcome decides


class CircuitBreaker:
    """Consecutive-fault breaker for one server; open periods come from ``backoff``.

    Closed: every call goes; ``failures`` faults in a row open it. Open: calls are skipped
    until the period ends; then exactly one call is the probe (half-open) and the others are
    still skipped while it runs. The probe's success closes the breaker; its fault opens it for
    a longer period (``backoff.compute(trips)``). NOTE: every call went through once a period
    ended: with Redis paused (SIGSTOP), 8 threads of gets each waited a whole timeout per
    period (a prober saw 24 gets stall ~4 s each within 30 s), not one of them."""

    def __init__(self, failures: int, backoff: AbstractBackoff, clock: Clock) -> None:
        self._threshold = failures
        self._backoff = backoff
        self._clock = clock
        self._lock = threading.Lock()
        self._fails = 0  # faults in a row while closed
        self._trips = 0  # open periods in a row (the probe of each failed)
        self._open_until = 0.0
        self._probing = False  # a probe is under way (the period ended)

    def admit(self) -> Admit:
        """Whether one call may go (see the class docstring). A caller given
        :attr:`Admit.PROBE` must end it with :meth:`record` or :meth:`release`."""
        with self._lock:
            if not self._trips:
                return Admit.CALL
            if self._probing or self._clock() < self._open_until:
                return Admit.SKIP
            self._probing = True
            return Admit.PROBE

    def allow(self) -> bool:
        """``admit()`` is not SKIP (a True after an open period takes the probe: record its
        outcome)."""
        return self.admit() is not Admit.SKIP

    @property
    def is_open(self) -> bool:
        """Whether calls are being skipped (open, or half-open with a probe under way)."""
        with self._lock:
            return self._trips > 0

    def record(self, ok: bool, *, open_now: bool = False) -> bool:
        """Record one call's outcome; True when this fault opened the breaker (from closed,
        or the probe's fault: the next, longer period). A success closes it. A fault of a
        call let through before the breaker opened, ending while it is open, changes nothing.
        ``open_now``: this fault opens a closed breaker whatever the count (the engines' guard:
        a call that timed out cost a whole timeout)."""
        with self._lock:
            if ok:
                self._fails = self._trips = 0
                self._open_until = 0.0
                self._probing = False
                return False
            if self._trips:
                if not self._probing:
                    return False  # NOTE: a late fault of a call sent while closed
                self._open()
                return True
            self._fails += 1
            if self._fails < self._threshold and not open_now:
                return False
            self._open()
            return True

    def release(self) -> None:
        """The probe ended without a word on the server (it raised something that is not a
        Redis fault): the next call probes instead."""
        with self._lock:
            self._probing = False

    def _open(self) -> None:
        """Open for the next period (under the lock)."""
        self._trips += 1
        self._fails = 0
        self._probing = False
        self._open_until = self._clock() + self._backoff.compute(self._trips)


__all__ = ["Admit", "CircuitBreaker", "Clock", "KeyringRace", "RedisKeyBackend", "TenantTombstones", "connect",
           "keyring_key"]
