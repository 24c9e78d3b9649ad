"""kvstore.integrations.guard: the engines' circuit breaker in front of the sidecar."""

from __future__ import annotations

import logging

import pytest
from redis.backoff import ConstantBackoff

from kvstore.errors import InvalidArgument, KVStoreError, NotFound, Unavailable
from kvstore.integrations.guard import SidecarGuard


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def fault(code: str) -> KVStoreError:
    exc = KVStoreError(f"{code}: sidecar trouble")
    exc.code = code
    return exc


class Sidecar:
    """A callable that fails with ``error`` (when set) and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.error: KVStoreError | None = None

    def __call__(self, x: int) -> int:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return x * 2


def test_three_faults_in_a_row_skip_calls_until_the_probe(caplog):
    clock, side = Clock(), Sidecar()
    guard = SidecarGuard("127.0.0.1:1", failures=3, clock=clock, backoff=ConstantBackoff(5.0))
    assert guard.call(side, 1) == 2
    side.error = fault("DEADLINE_EXCEEDED")
    with caplog.at_level(logging.INFO, logger="kvstore.integrations.guard"):
        for _ in range(3):
            with pytest.raises(KVStoreError):
                guard.call(side, 1)
        assert guard.is_open and side.calls == 4
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # opened: once
        for _ in range(10):  # skipped: no call reaches the sidecar, nothing logged
            with pytest.raises(Unavailable, match="skipped"):
                guard.call(side, 1)
        assert side.calls == 4 and len(caplog.records) == 1
        assert guard.level() == logging.DEBUG
        clock.now += 5.0  # the open period ends: one probe goes through and fails
        with pytest.raises(KVStoreError, match="sidecar trouble"):
            guard.call(side, 1)
        assert side.calls == 5 and guard.is_open  # reopened at once
        clock.now += 5.0
        side.error = None
        assert guard.call(side, 3) == 6 and not guard.is_open
        assert guard.level() == logging.WARNING
        assert any("answers again (10 calls were skipped)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("answer", [NotFound("no such session"), InvalidArgument("bad spec"),
                                    fault("RESOURCE_EXHAUSTED")])
def test_answers_are_not_faults(answer):
    """Errors that are the sidecar's answer to the request never open the breaker, and reset
    the count of faults in a row."""
    clock, side = Clock(), Sidecar()
    guard = SidecarGuard("t", failures=2, clock=clock, backoff=ConstantBackoff(5.0))
    for error in (fault("UNAVAILABLE"), answer, fault("UNAVAILABLE"), answer, answer):
        side.error = error
        with pytest.raises(type(error)):
            guard.call(side, 1)
        assert not guard.is_open
    side.error = fault("INTERNAL")
    for _ in range(2):
        with pytest.raises(KVStoreError):
            guard.call(side, 1)
    assert guard.is_open
