"""Redis commands of the remote tier, each under its node's circuit breaker.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's client, config, monotonic clock,
lock and counters (``_count``); ``_init_breakers`` makes its state.

Faults are tracked per server (per cluster node) by a :class:`~tiers.remote_redis.CircuitBreaker`:
after ``breaker_failures`` consecutive faults the node is skipped (a miss without network) for a
backoff period from ``redis.backoff``; the first call after the period is a probe, which closes
the breaker on success. Command retries are redis-py's ``Retry`` (see
:func:`tiers.remote_redis.connect`).

* ``_call(key, fn)`` — one command (any callable that talks to the node of ``key``): its result,
  or :data:`SKIPPED` (the breaker is open: nothing sent), or the fault it raised (one of
  :data:`FAULTS`), never an exception.
* ``_batch(cmd, keys, *args)`` / ``_multi(cmds)`` — commands pipelined (not a transaction; in
  order on each node); per command the reply, a fault or :data:`SKIPPED`. In cluster mode a
  pipeline that fails as a whole (a node unreachable) is replayed one command at a time, so the
  live nodes still answer.
* ``succeeded(reply)`` / ``fault_text(reply)`` — whether one such reply is a success, and what
  to say of one that is not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from redis.backoff import EqualJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from tiers.remote_redis import CircuitBreaker

#: Everything a Redis round trip can raise (RedisClusterException is not a RedisError).
FAULTS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
#: the reply of a call not sent because its node's breaker is open
SKIPPED = object()
#: one command for ``_multi``: (the key that routes it, (name, *args))
Command = tuple[bytes | str, tuple[Any, ...]]
_STANDALONE = "server"


def succeeded(reply: Any) -> bool:
    """Whether one reply of ``_call``/``_multi`` is a success (not a fault, not skipped)."""
    return reply is not SKIPPED and not isinstance(reply, BaseException)


def fault_text(reply: Any) -> str:
    """What went wrong with a reply that did not succeed: ``breaker open`` or the fault."""
    return "breaker open" if reply is SKIPPED else str(reply)


class BreakerCalls:
    """RemoteTier methods that send commands (see the module docstring)."""

    def _init_breakers(self) -> None:
        self._breakers: dict[str, CircuitBreaker] = {}  # node name -> its breaker (under _lock)

    def _node(self, key: bytes | str) -> str:
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

    def _call(self, key: bytes | str, fn: Callable[[], Any]) -> Any:
        """Run one command under its node's breaker: the result, or ``SKIPPED`` / a fault."""
        node = self._node(key)
        if not self._breaker(node).allow():
            self._count("breaker_skips")
            return SKIPPED
        try:
            res = fn()
        except FAULTS as exc:
            self._outcome(node, False)
            return exc
        self._outcome(node, True)
        return res

    def _batch(self, cmd: str, keys: Sequence[bytes], *args: Any) -> list[Any]:
        """``cmd key *args`` for every key, pipelined; per key: the reply, a fault, or
        ``SKIPPED`` (see :meth:`_multi`)."""
        return self._multi([(k, (cmd, k, *args)) for k in keys])

    def _multi(self, cmds: Sequence[Command]) -> list[Any]:
        """Commands ``(routing key, (name, *args))``, pipelined (not a transaction; in order on
        each node); per command: the reply, a fault, or ``SKIPPED``. In cluster mode a pipeline
        that fails as a whole (a node unreachable) is replayed one command at a time, so the
        live nodes still answer."""
        nodes = [self._node(k) for k, _ in cmds]
        out: list[Any] = [SKIPPED] * len(cmds)
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
                pipe.execute_command(*cmds[i][1])
            replies = pipe.execute(raise_on_error=False)
        except FAULTS as exc:
            if not isinstance(self._client, RedisCluster):
                self._outcome(_STANDALONE, False)
                for i in send:
                    out[i] = exc
                return out
            for i in send:
                out[i] = self._call(cmds[i][0], lambda i=i: self._client.execute_command(*cmds[i][1]))
            return out
        failed: set[str] = set()
        for i, r in zip(send, replies):
            out[i] = r
            if isinstance(r, BaseException):
                failed.add(nodes[i])
        for n in {nodes[i] for i in send}:
            self._outcome(n, n not in failed)
        return out


__all__ = ["FAULTS", "SKIPPED", "BreakerCalls", "Command", "fault_text", "succeeded"]
