"""A sidecar that accepts calls and never answers (a wedged process): the engines' guard
(kvstore.integrations.guard) and the client's deadline.

Each failed on the code before: after an open period every call went through (not one probe),
the open periods were full jitter (the first ones ~0 s), a get that registered the client's
region again waited two timeouts (one per RPC), and an engine's client registered its region
as it was built, outside the guard."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.backoff import ConstantBackoff
from service_harness import SPEC

import kvstore.client as client_mod
from kvstore.client import Client
from kvstore.errors import KVStoreError, Unavailable
from kvstore.integrations.guard import EqualJitter, SidecarGuard

KEYS = [bytes([i]) * 32 for i in range(2)]


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def fault(code: str = "DEADLINE_EXCEEDED") -> KVStoreError:
    exc = KVStoreError(f"{code}: sidecar trouble")
    exc.code = code
    return exc


class Sidecar:
    """A callable that fails with ``error`` (when set), runs ``during`` inside the call (when
    set) and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.error: BaseException | None = None
        self.during = None

    def __call__(self) -> str:
        self.calls += 1
        if self.during is not None:
            self.during()
        if self.error is not None:
            raise self.error
        return "answer"


def trip(guard: SidecarGuard, side: Sidecar, failures: int) -> None:
    side.error = fault()
    for _ in range(failures):
        with pytest.raises(KVStoreError):
            guard.call(side)
    assert guard.is_open


# -- the state machine, on a fake clock ----------------------------------------------------------
def test_after_an_open_period_one_call_probes_and_the_others_still_miss():
    """While the probe is under way (here: a call made from inside it, as another request of
    the engine would), every other call is skipped without reaching the sidecar."""
    clock, side, other = Clock(), Sidecar(), Sidecar()
    guard = SidecarGuard("t", failures=2, clock=clock, backoff=ConstantBackoff(5.0))
    trip(guard, side, 2)
    clock.now += 5.0
    seen = []

    def another_request() -> None:
        with pytest.raises(Unavailable, match="skipped"):
            guard.call(other)
        seen.append("skipped")
    side.during = another_request
    with pytest.raises(KVStoreError, match="sidecar trouble"):
        guard.call(side)  # the probe: it fails
    assert seen == ["skipped"] and other.calls == 0 and side.calls == 3
    side.during = None
    for _ in range(5):  # the next period began at the probe's failure
        with pytest.raises(Unavailable):
            guard.call(other)
    assert other.calls == 0 and guard.is_open


def test_failed_probes_lengthen_the_period_and_a_good_one_closes():
    clock, side = Clock(), Sidecar()
    guard = SidecarGuard("t", failures=3, base_s=1.0, cap_s=30.0, clock=clock, rng=lambda: 0.5)
    trip(guard, side, 3)
    periods = []
    for _ in range(7):
        opened = clock.now
        while True:  # step 0.25 s at a time until the probe goes through
            clock.now += 0.25
            calls = side.calls
            with pytest.raises(KVStoreError) as err:
                guard.call(side)
            if side.calls > calls:
                assert not isinstance(err.value, Unavailable) and guard.is_open
                break
            assert isinstance(err.value, Unavailable)
        periods.append(clock.now - opened)
    # equal jitter at rng 0.5: 3/4 of min(30, 2**n), to the next 0.25 s step
    assert periods == [1.5, 3.0, 6.0, 12.0, 22.5, 22.5, 22.5]
    clock.now += 22.5
    side.error = None
    assert guard.call(side) == "answer" and not guard.is_open  # the probe succeeded: closed
    side.error = fault()
    for _ in range(2):  # closed again: faults are counted from zero, every call goes through
        with pytest.raises(KVStoreError, match="sidecar trouble"):
            guard.call(side)
    assert not guard.is_open


def test_the_first_open_period_is_not_next_to_nothing():
    """Full jitter drew the first period from [0, 2) s: with rng 0 the breaker let a call
    through (another whole timeout against a hung sidecar) at once."""
    clock, side = Clock(), Sidecar()
    guard = SidecarGuard("t", failures=1, clock=clock, rng=lambda: 0.0)
    trip(guard, side, 1)
    clock.now += 0.999
    with pytest.raises(Unavailable):
        guard.call(side)
    assert side.calls == 1


def test_a_probe_that_ends_without_a_verdict_lets_the_next_call_probe():
    """A probe that raised something not from the sidecar (a bad argument, a bug) must not
    leave the breaker waiting for it for ever."""
    clock, side = Clock(), Sidecar()
    guard = SidecarGuard("t", failures=1, clock=clock, backoff=ConstantBackoff(1.0))
    trip(guard, side, 1)
    clock.now += 1.0
    side.error = TypeError("not the sidecar's doing")
    with pytest.raises(TypeError):
        guard.call(side)
    side.error = None
    assert guard.call(side) == "answer" and not guard.is_open and side.calls == 3


@given(n=st.integers(1, 200), r=st.floats(0.0, 1.0, exclude_max=True),
       base=st.floats(0.01, 5.0), cap=st.floats(5.0, 120.0))
def test_equal_jitter_periods_stay_between_half_and_all_of_the_exponential(n, r, base, cap):
    d = min(cap, base * 2**min(n, 64))
    period = EqualJitter(base, cap, rng=lambda: r).compute(n)
    assert d / 2 <= period <= d and period >= min(base, cap / 2)


# -- end to end: a gRPC server that accepts every call and never answers ---------------------------
class Hung:
    """A gRPC server whose every method blocks until :meth:`stop`; counts the calls it got."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []
        hung = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                def never(request, context):
                    hung.calls.append(details.method)
                    hung.release.wait(30)
                    context.abort(grpc.StatusCode.UNAVAILABLE, "released")
                if details.method.endswith("/Get"):
                    return grpc.unary_stream_rpc_method_handler(never)
                if details.method.endswith("/Put"):
                    return grpc.stream_unary_rpc_method_handler(never)
                return grpc.unary_unary_rpc_method_handler(never)
        self.server = grpc.server(futures.ThreadPoolExecutor(16), handlers=[Handler()])
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.release.set()
        self.server.stop(0)


@pytest.fixture
def hung() -> Iterator[Hung]:
    h = Hung()
    yield h
    h.stop()


def timed_get(guard: SidecarGuard, client: Client) -> tuple[BaseException, float]:
    began = time.monotonic()
    with pytest.raises(KVStoreError) as err:
        guard.call(client.get, SPEC, KEYS)
    return err.value, time.monotonic() - began


def test_a_guarded_get_on_a_hung_sidecar_misses_within_its_timeout(hung):
    """As an engine builds it (register at first use), the client makes no call until its first
    get; that get registers its region and fails within one timeout, not one per RPC. Once the
    breaker opens, gets miss without reaching the sidecar."""
    timeout = 0.5
    client = Client(hung.target, "t", region_bytes=1 << 20, timeout=timeout, register="at_first_use")
    try:
        assert hung.calls == []  # built without a call
        guard = SidecarGuard(hung.target, failures=2)
        for _ in range(2):
            exc, took = timed_get(guard, client)
            assert exc.code == "DEADLINE_EXCEEDED"
            # NOTE: a correctness bound (one deadline, not two), generous for a loaded machine
            assert took < timeout + 1.0, f"{took:.2f} s for a {timeout} s timeout"
        assert guard.is_open
        reached = len(hung.calls)
        exc, took = timed_get(guard, client)
        assert isinstance(exc, Unavailable) and len(hung.calls) == reached
    finally:
        client.close()


def test_a_get_that_registers_the_region_again_shares_its_deadline(hung, monkeypatch):
    """A client whose registration timed out tries again from a get REGISTER_RETRY_S later:
    the registration and the get had a whole timeout each."""
    monkeypatch.setattr(client_mod, "REGISTER_RETRY_S", 0.0)
    timeout = 1.0
    client = Client(hung.target, "t", region_bytes=1 << 20, timeout=timeout)  # its registration times out
    try:
        assert not client.uses_shared_memory
        began = time.monotonic()
        with pytest.raises(KVStoreError) as err:
            client.get(SPEC, KEYS)
        took = time.monotonic() - began
        assert err.value.code == "DEADLINE_EXCEEDED"
        assert any(m.endswith("/RegisterRegion") for m in hung.calls[1:])  # it did register again
        # NOTE: a correctness bound: two timeouts (2.0 s) before; slack for a loaded machine
        assert took < timeout + 0.75, f"{took:.2f} s for a {timeout} s timeout"
    finally:
        client.close()
