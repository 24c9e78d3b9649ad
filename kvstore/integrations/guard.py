"""A circuit breaker between an engine and its sidecar.

An engine asks the sidecar from its scheduling loop. While the sidecar is down, a call fails
at once (connection refused) and costs nothing; while it hangs, every call waits its whole
timeout, once per request and per step. :class:`SidecarGuard` stops that: after ``failures``
calls in a row end in a transport fault, the breaker opens and calls raise
:class:`kvstore.errors.Unavailable` at once for an open period. When the period ends, exactly
one call goes through as a probe; every other call keeps being skipped while it runs. A probe
that succeeds closes the breaker; one that fails opens it for a longer period. So a hung
sidecar costs the engine one timeout per open period, never one per caller or per request.
The engine sees each skipped call as a miss, as it sees a failed one. Opening and closing are
logged once each (warning, info), not once per call.

With ``probe`` (a cheap call to the sidecar, e.g. the client's ``whoami``), the probe after an
open period runs in a background thread instead of an engine's call: every call keeps missing
at once while it runs, and its answer closes the breaker or opens the next period. With
``timeouts_open``, one DEADLINE_EXCEEDED opens the breaker (a refused connection costs nothing,
so those are counted up to ``failures``; a call that timed out cost the engine a whole timeout).
So a hung sidecar costs the engine one timeout in all, not one per open period. NOTE: with the
probe taking an engine call, a hung sidecar with the default 10 s timeout still held the vLLM
scheduler 80 of the first 150 s (each probe a whole timeout, and three timeouts to open).

Open periods are *equal jitter* (:class:`EqualJitter`): the n-th period in a row lasts between
half and all of ``min(cap_s, base_s * 2**n)``, so with the defaults 1-2 s, 2-4 s, ... up to
15-30 s. NOTE: full jitter (``random() * 2**n``, redis-py's ExponentialWithJitterBackoff, used
here before) made the first periods last 0-2 s, often next to nothing: against a hung sidecar
the engine then waited a whole timeout again almost at once. The clock and the random source
are injected, so tests set them.

Transport faults are the statuses that say nothing about the request: UNAVAILABLE,
DEADLINE_EXCEEDED, INTERNAL, UNKNOWN. Any other answer (NOT_FOUND, RESOURCE_EXHAUSTED,
INVALID_ARGUMENT...) means the sidecar is working.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from redis.backoff import AbstractBackoff

from kvstore.errors import KVStoreError, Unavailable
from tiers.remote_redis import Admit, CircuitBreaker

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

#: statuses of a failed call that count against the sidecar
FAULTS = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN"})


class EqualJitter(AbstractBackoff):
    """Open period after the ``n``-th failure in a row: ``d/2 + rng() * d/2`` seconds with
    ``d = min(cap_s, base_s * 2**n)``, so never under ``min(base_s, cap_s / 2)``."""

    def __init__(self, base_s: float = 1.0, cap_s: float = 30.0, rng: Callable[[], float] = random.random) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got base_s={base_s}, cap_s={cap_s}")
        self.base_s, self.cap_s, self._rng = base_s, cap_s, rng

    def compute(self, failures: int) -> float:
        # NOTE: the exponent is capped: base_s * 2**n overflows a float past n ~ 1000
        d = min(self.cap_s, self.base_s * 2.0 ** min(failures, 64))
        return d / 2 + self._rng() * d / 2


class SidecarGuard:
    """Fail fast while the sidecar at ``target`` keeps failing; see the module docstring. The
    state machine (closed, open, one probe) is the remote tier's
    :class:`~tiers.remote_redis.CircuitBreaker`; this adds what an engine needs around it: the
    background probe, ``timeouts_open``, the count of skipped calls and the log lines.

    ``clock`` (monotonic seconds) and ``rng`` (uniform in [0, 1)) drive the open periods;
    ``backoff`` replaces :class:`EqualJitter` (its ``compute(n)``: the n-th period in a row).
    Thread-safe: one probe at a time across threads."""

    def __init__(self, target: str, *, failures: int = 3, base_s: float = 1.0, cap_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, rng: Callable[[], float] = random.random,
                 backoff: AbstractBackoff | None = None, probe: Callable[[], object] | None = None,
                 timeouts_open: bool = False,
                 spawn: Callable[[Callable[[], None]], None] | None = None) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        self.target = target
        self._breaker = CircuitBreaker(failures, backoff or EqualJitter(base_s, cap_s, rng), clock)
        self._probe = probe
        self._timeouts_open = timeouts_open
        self._spawn = spawn or _in_background
        self._lock = threading.Lock()  # over _skipped
        self._skipped = 0

    @property
    def is_open(self) -> bool:
        """Whether the breaker is open: calls are skipped, but for one probe after each period."""
        return self._breaker.is_open

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)``; :class:`Unavailable` at once while the breaker is open
        (but for the one probe after each open period)."""
        probe = self._admit()
        verdict: bool | None = None  # True: the sidecar works; False: a fault; None: no word
        try:
            out = fn(*args, **kwargs)
            verdict = True
            return out
        except KVStoreError as exc:
            verdict = exc.code not in FAULTS
            if not verdict and self._fault(hung=exc.code == "DEADLINE_EXCEEDED") and not probe:
                log.warning("kvstore sidecar at %s failed %s: skipping calls to it for a while "
                            "(each a miss), then trying one", self.target, exc)
            raise
        finally:
            if verdict:
                self._working()
            elif verdict is None and probe:
                # the probe ended without a word on the sidecar (an exception not of the
                # client, e.g. a bad argument caught before any call): the next call probes
                self._breaker.release()

    def _admit(self) -> bool:
        """Whether this call may go through (raises Unavailable when not); True when it is the
        probe of an ended open period. With ``probe``, that probe is started in the background
        instead, and this call is skipped too."""
        admit = self._breaker.admit()
        if admit is Admit.CALL:
            return False
        if admit is Admit.PROBE:
            if self._probe is None:
                return True
            try:
                self._spawn(self._run_probe)
            except Exception as exc:  # noqa: BLE001 - no thread (exhausted, interpreter exiting)
                # NOTE: the breaker stayed probing for good (every later call skipped, the
                # sidecar answering or not) and the engine's call got the RuntimeError
                log.debug("kvstore sidecar probe of %s could not start: %r", self.target, exc)
                self._fault()
        with self._lock:
            self._skipped += 1
        raise Unavailable(f"kvstore sidecar at {self.target} keeps failing: call skipped")

    def _run_probe(self) -> None:
        """The background probe: its answer closes the breaker, a fault (or anything it raises
        that is not the sidecar's answer: it must not be retried at once, in a loop of threads)
        opens the next, longer period."""
        assert self._probe is not None
        try:
            self._probe()
            working = True
        except KVStoreError as exc:
            working = exc.code not in FAULTS
        except Exception as exc:  # noqa: BLE001 - a thread's exception would only be printed
            log.debug("kvstore sidecar probe of %s raised %r", self.target, exc)
            working = False
        if working:
            self._working()
        else:
            self._fault()

    def _fault(self, *, hung: bool = False) -> bool:
        """Count a transport fault (``hung``: a timeout); True when it opened the breaker."""
        return self._breaker.record(False, open_now=hung and self._timeouts_open)

    def _working(self) -> None:
        was_open = self._breaker.is_open
        self._breaker.record(True)
        with self._lock:
            skipped, self._skipped = self._skipped, 0
        if was_open:
            log.info("kvstore sidecar at %s answers again (%d calls were skipped)", self.target, skipped)

    def level(self) -> int:
        """The log level for one failed call: DEBUG while the breaker is open (its opening was
        logged as a warning), else WARNING."""
        return logging.DEBUG if self.is_open else logging.WARNING


def _in_background(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="kvstore-sidecar-probe", daemon=True).start()
