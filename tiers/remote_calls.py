"""Redis commands of the remote tier, each under its node's circuit breaker.

A mixin of :class:`tiers.remote.RemoteTier`: it uses the tier's client, config, monotonic clock,
lock and counters (``_count``); ``_init_breakers`` makes its state.

Faults are tracked per server (per cluster node) by a :class:`~tiers.remote_redis.CircuitBreaker`:
after ``breaker_failures`` consecutive faults the node is skipped (a miss without network) for a
backoff period from ``redis.backoff``; when the period ends exactly one call is a probe (the others
are still skipped while it runs: with Redis hung, one caller waits a timeout per period, not every
one), which closes the breaker on success and opens a longer period on a fault. A pipeline holds
one admission per node for all its commands. Command retries are redis-py's ``Retry`` (see
:func:`tiers.remote_redis.connect`).

Only a node that cannot serve counts toward its breaker: a connection or a timeout error, a
cluster redirection or outage (``MOVED``/``ASK``/``CLUSTERDOWN``/``TRYAGAIN``), a busy server.
An error *reply* (:func:`error_reply`: ``OOM`` from a full Redis under ``noeviction``,
``NOPERM``, ``READONLY``, a wrong type, ...) fails that command only: the node answered, and
the commands it still serves (a full Redis serves every ``GET``) are not skipped. Such replies
are counted under their own counters (``oom``, ``error_replies``) and logged, at most once a
minute per kind, with Redis' own text. (Every error counted as a node fault: a Redis that was
full refused the demotions, the breaker opened and the blocks it held were misses, with the OOM
shown nowhere.)

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

import logging
from collections.abc import Callable, Sequence
from typing import Any

from redis.backoff import EqualJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    OutOfMemoryError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

from tiers.remote_redis import Admit, CircuitBreaker

#: Everything a Redis round trip can raise (RedisClusterException is not a RedisError).
FAULTS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError)
#: the reply of a call not sent because its node's breaker is open
SKIPPED = object()
#: one command for ``_multi``: (the key that routes it, (name, *args))
Command = tuple[bytes | str, tuple[Any, ...]]
_STANDALONE = "server"
#: least seconds between two log lines of error replies of one kind
_LOG_EVERY_S = 60.0

log = logging.getLogger(__name__)


def error_reply(exc: BaseException) -> str | None:
    """The counter of an error reply (the node answered, refusing this command): ``oom`` or
    ``error_replies``; None for a fault of the node (not reached, timed out, not serving the
    slot: ``MOVED``/``ASK``/``CLUSTERDOWN``/``TRYAGAIN``; ``BUSY`` running a script)."""
    if not isinstance(exc, ResponseError) or isinstance(exc, (AskError, TryAgainError, ClusterDownError)):
        return None
    if isinstance(exc, OutOfMemoryError):
        return "oom"
    return None if str(exc).startswith("BUSY") else "error_replies"


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
        self._replies_logged: dict[str, float] = {}  # error reply kind -> monotonic time logged

    def _error_reply(self, exc: BaseException) -> bool:
        """Whether ``exc`` is an error reply (counted and logged, see :func:`error_reply`)
        rather than a fault of its node."""
        kind = error_reply(exc)
        if kind is None:
            return False
        self._count(kind)
        now = self._monotonic()
        with self._lock:
            last = self._replies_logged.get(kind)
            if last is not None and now - last < _LOG_EVERY_S:
                return True
            self._replies_logged[kind] = now
        log.warning("remote tier %r: Redis refused a command (%s)%s", self.config.namespace, exc,
                    ": it is full (maxmemory) with nothing it may evict; writes fail until it has room"
                    if kind == "oom" else "")
        return True

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
        admit = self._breaker(node).admit()
        if admit is Admit.SKIP:
            self._count("breaker_skips")
            return SKIPPED
        return self._sent(node, admit, fn)

    def _sent(self, node: str, admit: Admit, fn: Callable[[], Any]) -> Any:
        """Run one command admitted by ``node``'s breaker (``admit``: CALL or PROBE) and record
        its outcome: the result, or the fault. A probe that raises anything else is released
        (the next call probes)."""
        try:
            res = fn()
        except FAULTS as exc:
            self._outcome(node, self._error_reply(exc))  # NOTE: an error reply: the node answered
            return exc
        except BaseException:
            if admit is Admit.PROBE:
                self._breaker(node).release()
            raise
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
        # NOTE: one admission per node: after an open period the pipeline is that node's one probe
        admits = {n: self._breaker(n).admit() for n in dict.fromkeys(nodes)}
        out: list[Any] = [SKIPPED] * len(cmds)
        send = []
        for i, n in enumerate(nodes):
            if admits[n] is not Admit.SKIP:
                send.append(i)
            else:
                self._count("breaker_skips")
        if not send:
            return out
        probes = {n for n, a in admits.items() if a is Admit.PROBE}
        try:
            pipe = self._client.pipeline(transaction=False)
            for i in send:
                pipe.execute_command(*cmds[i][1])
            replies = pipe.execute(raise_on_error=False)
        except FAULTS as exc:
            if not isinstance(self._client, RedisCluster):
                self._outcome(_STANDALONE, self._error_reply(exc))
                for i in send:
                    out[i] = exc
                return out
            self._replay(cmds, nodes, send, probes, out)
            return out
        except BaseException:
            self._release(probes)
            raise
        failed: set[str] = set()
        for i, r in zip(send, replies):
            out[i] = r
            if isinstance(r, BaseException) and not self._error_reply(r):
                failed.add(nodes[i])
        for n in {nodes[i] for i in send}:
            self._outcome(n, n not in failed)
        return out

    def _replay(self, cmds: Sequence[Command], nodes: list[str], send: list[int], probes: set[str],
                out: list[Any]) -> None:
        """A cluster pipeline that failed as a whole, one command at a time into ``out``: the
        first command of a node whose probe the pipeline held is that probe; the others ask
        their breaker again."""
        try:
            for i in send:
                fn = (lambda i=i: self._client.execute_command(*cmds[i][1]))
                if nodes[i] in probes:
                    probes.discard(nodes[i])
                    out[i] = self._sent(nodes[i], Admit.PROBE, fn)
                else:
                    out[i] = self._call(cmds[i][0], fn)
        finally:
            self._release(probes)

    def _release(self, probes: set[str]) -> None:
        """Release the probes of ``probes``' nodes that were not sent."""
        for n in probes:
            self._breaker(n).release()


__all__ = ["FAULTS", "SKIPPED", "BreakerCalls", "Command", "error_reply", "fault_text", "succeeded"]
