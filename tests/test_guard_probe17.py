"""The engines' guard with a background probe (``probe=``) and ``timeouts_open``: a hung
sidecar costs the engine one timeout in all. Before, the probe after each open period was an
engine call, a whole timeout each, and it took three timeouts to open: at the default 10 s a
hung sidecar held vLLM's scheduler 80 of the first 150 s."""

from __future__ import annotations

import time

import pytest
from redis.backoff import ConstantBackoff
from service_harness import SPEC
from test_guard_hung17 import KEYS, Clock, Hung, Sidecar, fault, trip

from kvstore.client import Client
from kvstore.errors import KVStoreError, Unavailable
from kvstore.integrations.guard import SidecarGuard


def now(fn):
    """A spawn that runs the probe at once, on the calling thread (deterministic)."""
    fn()


def test_the_probe_runs_in_the_background_and_every_engine_call_misses_meanwhile():
    clock, side, probe = Clock(), Sidecar(), Sidecar()
    probe.error = fault()
    guard = SidecarGuard("t", failures=2, clock=clock, backoff=ConstantBackoff(5.0), probe=probe, spawn=now)
    trip(guard, side, 2)
    assert side.calls == 2
    for _ in range(3):  # the period ends: the call that finds it over starts the probe, and misses
        clock.now += 5.0
        with pytest.raises(Unavailable):
            guard.call(side)
        assert guard.is_open
    assert side.calls == 2 and probe.calls == 3  # no engine call reached the sidecar
    clock.now += 5.0
    probe.error = None
    with pytest.raises(Unavailable):
        guard.call(side)  # this one started the probe that succeeded
    assert not guard.is_open and probe.calls == 4
    side.error = None
    assert guard.call(side) == "answer" and side.calls == 3


def test_a_probe_that_raises_something_else_reopens_rather_than_spinning():
    clock, side = Clock(), Sidecar()
    probe = Sidecar()
    probe.error = TypeError("a bug")
    started = []
    guard = SidecarGuard("t", failures=1, clock=clock, backoff=ConstantBackoff(5.0), probe=probe,
                         spawn=lambda fn: started.append(fn) or fn())
    trip(guard, side, 1)
    clock.now += 5.0
    with pytest.raises(Unavailable):
        guard.call(side)
    for _ in range(5):  # within the new period: no further probe
        with pytest.raises(Unavailable):
            guard.call(side)
    assert len(started) == 1 and guard.is_open


def test_with_timeouts_open_one_timeout_opens_but_refusals_are_counted():
    side = Sidecar()
    guard = SidecarGuard("t", failures=3, clock=Clock(), timeouts_open=True)
    side.error = fault("UNAVAILABLE")
    for _ in range(2):
        with pytest.raises(KVStoreError):
            guard.call(side)
    assert not guard.is_open  # two refusals of three
    side.error = fault("DEADLINE_EXCEEDED")
    with pytest.raises(KVStoreError):
        guard.call(side)
    assert guard.is_open
    fresh = SidecarGuard("t", failures=3, clock=Clock(), timeouts_open=True)
    with pytest.raises(KVStoreError):
        fresh.call(side)
    assert fresh.is_open  # one timeout is enough


@pytest.fixture
def hung():
    h = Hung()
    yield h
    h.stop()


def test_a_hung_sidecar_costs_the_engine_one_timeout(hung):
    timeout = 0.5
    client = Client(hung.target, "t", region_bytes=1 << 20, timeout=timeout, register="at_first_use")
    try:
        guard = SidecarGuard(hung.target, failures=3, base_s=0.1, cap_s=0.2, probe=client.whoami,
                             timeouts_open=True)
        began = time.monotonic()
        with pytest.raises(KVStoreError) as err:
            guard.call(client.get, SPEC, KEYS)
        assert err.value.code == "DEADLINE_EXCEEDED" and guard.is_open
        first = time.monotonic() - began
        longest, calls = 0.0, 0
        end = time.monotonic() + 2.0  # many open periods of 0.1-0.2 s, each ending in a probe
        while time.monotonic() < end:
            t0 = time.monotonic()
            with pytest.raises(Unavailable):
                guard.call(client.get, SPEC, KEYS)
            longest = max(longest, time.monotonic() - t0)
            calls += 1
            time.sleep(0.01)
        # NOTE: correctness bounds (no engine call waits out a timeout), generous for a loaded machine
        assert first < timeout + 1.0
        assert longest < timeout / 2, f"an engine call took {longest:.2f} s while the breaker was open"
        assert any(m.endswith("/WhoAmI") for m in hung.calls)  # the probes went to the sidecar
        assert sum(m.endswith("/Get") for m in hung.calls) <= 1 and calls > 10
    finally:
        client.close()


def test_a_probe_that_cannot_start_reopens_and_the_call_misses():
    """A probe thread that could not start (threads exhausted, the interpreter exiting) left the
    breaker probing for good, every later call skipped, and gave the engine's call a RuntimeError."""
    clock, side = Clock(), Sidecar()
    spawned = []

    def spawn(fn):
        if not spawned:
            spawned.append("refused")
            raise RuntimeError("can't start new thread")
        spawned.append("ran")
        fn()

    guard = SidecarGuard("t", failures=1, clock=clock, backoff=ConstantBackoff(5.0), probe=lambda: None, spawn=spawn)
    trip(guard, side, 1)
    clock.now += 5.0
    with pytest.raises(Unavailable):
        guard.call(side)
    assert guard.is_open
    clock.now += 5.0  # the next period ends: this probe starts, and the sidecar answers
    with pytest.raises(Unavailable):
        guard.call(side)
    assert spawned == ["refused", "ran"] and not guard.is_open
