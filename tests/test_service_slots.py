"""Shared-memory slots of a call that ended without the server's answer (deadline, cancel,
broken connection) are not reused until the server says that call is over: FenceRegion.

Before, the client gave such slots back at once; the server, still running the call, copied
into them after another call had taken them, so that call read another prompt's bytes (and a
put stored them), with no error (a prober: 68–131 wrong gets per run, 7–15 of 300 chains
stored with another chain's bytes)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.errors import KVStoreError, ParentNotStored, ResourceExhausted
from kvstore.service_resources import RegionTable, SlotUse


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_a_get_that_timed_out_does_not_write_into_the_next_calls_slots(sidecar, monkeypatch):
    """Call A times out while the server still works on it; call B (same client) runs, and A's
    late copy lands while B's bytes sit in the region: B must still get its own bytes."""
    c = sidecar.tenant("slots", local=True, timeout=0.5)
    assert c.uses_shared_memory
    ka, kb = (c.block_keys(SPEC, fresh_tokens(2)) for _ in range(2))
    kv_a, kv_b = random_kv(2, seed=1), random_kv(2, seed=2)
    c.put(SPEC, ka, kv_a)
    c.put(SPEC, kb, kv_b)
    plane = sidecar.server.data
    real_copy = plane._copy
    b_copied = threading.Event()
    calls = []

    def copy(pairs):
        calls.append(len(calls))
        if len(calls) == 1:  # A: held up until B has written its bytes into the region
            b_copied.wait(10)
            real_copy(pairs)
            return
        real_copy(pairs)
        b_copied.set()
        time.sleep(0.3)  # A's late copy lands now, before B's answer

    monkeypatch.setattr(plane, "_copy", copy)
    with pytest.raises(KVStoreError) as err:
        c.get(SPEC, ka)
    assert err.value.code == "DEADLINE_EXCEEDED"
    assert c._local.held == 1  # the server had not finished A: its slots are held
    got = c.get(SPEC, kb)
    assert _bits(got).equal(_bits(kv_b))  # was kv_a's bytes
    monkeypatch.setattr(plane, "_copy", real_copy)
    # A has ended: its slots come back (at most one fence attempt a second)
    c._local._fence_at = 0.0
    assert _bits(c.get(SPEC, ka)).equal(_bits(kv_a)) and c._local.held == 0


def test_a_put_still_queued_when_its_client_gave_up_is_refused_after_the_fence(sidecar, monkeypatch):
    """A call still queued at the server when its client gave up: the fence marks it, and it
    is refused when it arrives, so it never reads slots the client has reused."""
    c = sidecar.tenant("queued", local=True, timeout=0.3)
    keys = c.block_keys(SPEC, fresh_tokens(1))
    plane = sidecar.server.data
    real = plane.put_local
    started = threading.Event()
    release = threading.Event()
    outcome: list[object] = []

    def late(principal, b, region_id, offsets, session, ttl_s, seq=0):
        started.set()
        release.wait(10)  # the call is still on its way to the slots when the client gives up
        try:
            outcome.append(real(principal, b, region_id, offsets, session, ttl_s, seq))
        except KVStoreError as exc:
            outcome.append(exc)
            raise

    monkeypatch.setattr(plane, "put_local", late)
    with pytest.raises(KVStoreError) as err:
        c.put(SPEC, keys, random_kv(1, seed=3))
    assert err.value.code == "DEADLINE_EXCEEDED" and started.is_set()
    # the call had not reached the slots: the fence marked it, so its slots came back at once
    assert c._local.held == 0
    release.set()
    deadline = time.monotonic() + 10
    while not outcome and time.monotonic() < deadline:
        time.sleep(0.01)
    # ...and when it got there, it was refused before it read them
    assert isinstance(outcome[0], KVStoreError) and "given up by its client" in str(outcome[0])
    monkeypatch.setattr(plane, "put_local", real)
    assert c.lookup(SPEC, keys).num_blocks == 0
    kv = random_kv(1, seed=4)
    c.put(SPEC, keys, kv)
    assert _bits(c.get(SPEC, keys)).equal(_bits(kv))


def test_slot_use_fence_waits_for_a_running_call_and_refuses_a_late_one():
    use = SlotUse()
    entered, leave = threading.Event(), threading.Event()

    def call():
        with use.using(7):
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=call)
    t.start()
    entered.wait(10)
    assert use.fence(7, timeout=0.05) is False  # still running
    leave.set()
    assert use.fence(7, timeout=5) is True
    t.join()
    assert use.fence(9, timeout=0) is True  # not arrived yet: marked
    with pytest.raises(KVStoreError, match="given up by its client"), use.using(9):
        pass
    with use.using(9):  # refused once; the number is not kept
        pass
    with use.using(0), use.using(0):  # calls without a number are not tracked
        pass


def test_concurrent_registrations_cannot_pass_the_region_limit(monkeypatch):
    """The count was checked, then the region mapped, then inserted, in separate lock
    sections: concurrent registrations all passed the check (a prober saw 5 of limit 2)."""
    import kvstore.service_resources as res

    class FakeRegion:
        nonce = b"n"

        def alive(self) -> bool:
            return True

        def close(self) -> None:
            pass

    def slow_attach(kind, name, size, handle):
        time.sleep(0.05)
        return FakeRegion()

    monkeypatch.setattr(res, "attach_region", slow_attach)
    table = RegionTable(max_per_principal=2, max_bytes=1 << 20)
    ok, refused = [], []

    def register(i: int) -> None:
        try:
            ok.append(table.register("t", "posix_shm", f"r{i}", 4096, nonce=b"n"))
        except ResourceExhausted:
            refused.append(i)

    threads = [threading.Thread(target=register, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ok) == 2 and len(refused) == 10


def test_a_staged_put_with_a_parent_not_stored_is_an_error(sidecar):
    """A parent the caller gives that is not stored is an error, on a put staged through the
    region as on one larger than it (which goes in-band). (A staged put no longer goes in
    pieces that continue from each other: see tests/test_shm_put_atomic.py.)"""
    c = sidecar.tenant("pieces", local=True, region_bytes=4 * SPEC.block_nbytes + 8192)
    for n in (2, 12):
        other = c.block_keys(SPEC, fresh_tokens(n))
        with pytest.raises(ParentNotStored):
            c.put(SPEC, other[1:], random_kv(n - 1), parent=other[0])
        assert c.lookup(SPEC, other[1:], parent=other[0]).num_blocks == 0


def test_closing_a_client_while_other_threads_use_it_gives_only_typed_errors(sidecar):
    """close() waits for the shared-memory calls under way; later calls are refused with
    FailedPrecondition. It pulled the arena from under them: AttributeError ('LocalPlane'
    object has no attribute 'arena') and ValueError (released memoryview)."""
    from kvstore.errors import FailedPrecondition

    c = sidecar.tenant("closing", local=True)
    keys = c.block_keys(SPEC, fresh_tokens(4))
    kv = random_kv(4, seed=6)
    c.put(SPEC, keys, kv)
    stop = threading.Event()
    seen: list[BaseException] = []
    wrong = []

    def worker() -> None:
        while not stop.is_set():
            try:
                got = c.get(SPEC, keys)
                if not _bits(got).equal(_bits(kv[: got.shape[0]])):
                    wrong.append(1)
                c.put(SPEC, keys, kv)
            except BaseException as exc:  # noqa: BLE001 - what the test looks at
                seen.append(exc)
                if isinstance(exc, FailedPrecondition):
                    return

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    c.close()
    stop.set()
    for t in threads:
        t.join(10)
    assert not wrong
    assert seen and all(type(e) is FailedPrecondition for e in seen), {type(e).__name__ for e in seen}
