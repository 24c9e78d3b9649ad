"""A circuit breaker between an engine and its sidecar.

An engine asks the sidecar from its scheduling loop. While the sidecar is down, a call fails
at once (connection refused) and costs nothing; while it hangs, every call waits its whole
timeout, once per request and per step. :class:`SidecarGuard` stops that: after ``failures``
calls in a row end in a transport fault, calls raise :class:`kvstore.errors.Unavailable` at once
for an open period (jittered exponential from ``base_s`` up to ``cap_s``: redis-py's backoff,
in :class:`tiers.remote_redis.CircuitBreaker`, the remote tier's breaker); when it ends, the
next call goes through as a probe and either closes the breaker or opens it for longer. The
engine sees each skipped call as a miss, as it sees a failed one. Opening and closing are
logged once each (warning, info), not once per call.

Transport faults are the statuses that say nothing about the request: UNAVAILABLE,
DEADLINE_EXCEEDED, INTERNAL, UNKNOWN. Any other answer (NOT_FOUND, RESOURCE_EXHAUSTED,
INVALID_ARGUMENT...) means the sidecar is working.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from redis.backoff import AbstractBackoff, ExponentialWithJitterBackoff

from kvstore.errors import KVStoreError, Unavailable
from tiers.remote_redis import CircuitBreaker

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

#: statuses of a failed call that count against the sidecar
FAULTS = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN"})


class SidecarGuard:
    """Fail fast while the sidecar at ``target`` keeps failing; see the module docstring."""

    def __init__(self, target: str, *, failures: int = 3, base_s: float = 1.0, cap_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, backoff: AbstractBackoff | None = None) -> None:
        self.target = target
        backoff = backoff or ExponentialWithJitterBackoff(cap=cap_s, base=base_s)
        self._breaker = CircuitBreaker(failures, backoff, clock)
        self._skipped = 0

    @property
    def is_open(self) -> bool:
        """Whether calls are being skipped now."""
        return self._breaker.is_open

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)``; :class:`Unavailable` at once while the breaker is open."""
        if not self._breaker.allow():
            self._skipped += 1
            raise Unavailable(f"kvstore sidecar at {self.target} keeps failing: call skipped")
        try:
            out = fn(*args, **kwargs)
        except KVStoreError as exc:
            if exc.code in FAULTS and self._breaker.record(False):
                log.warning("kvstore sidecar at %s failed %s: skipping calls to it for a while "
                            "(each a miss), then trying again", self.target, exc)
            elif exc.code not in FAULTS:
                self._working()
            raise
        self._working()
        return out

    def _working(self) -> None:
        self._breaker.record(True)
        if self._skipped:
            log.info("kvstore sidecar at %s answers again (%d calls were skipped)", self.target, self._skipped)
            self._skipped = 0

    def level(self) -> int:
        """The log level for one failed call: DEBUG while the breaker is open (its opening was
        logged as a warning), else WARNING."""
        return logging.DEBUG if self.is_open else logging.WARNING
