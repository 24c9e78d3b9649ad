"""The remote tier, round 17: its breaker's probe, the deletions position, promotion and quotas.

1. The per-node breaker let every call through once an open period ended, not one probe: with
   Redis paused (SIGSTOP) and 8 threads getting misses, a prober saw 24 gets stall ~4 s each
   within 30 s. Now one call probes (half-open) while the others keep missing at once.
2. The deletions stream position was written without fsync, and a position file read empty or
   torn was taken for none: the server started from the stream's end and silently skipped the
   deletions made while it was down. Now such a file means "unknown": the whole retained stream
   is applied from its start (counted ``deletions_position_unknown``, logged).
3. A block promoted from the remote tier kept its copy's deadline as is: a copy written without
   one (by a server without the tenant's TTL policy) came in with none.
4. The remote quota check counted a block two or three times while a demotion of it was
   queued (a queued write-through and a queued eviction spill; a queued rewrite of a copy
   already written): a spill was refused though the first write was coming.

On a real Redis where a test needs one (``servers`` / ``redis_ns`` of conftest.py); clocks are
injected, and a Redis that hangs is a client whose pipeline waits for an event.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch
from conftest import MASTER, FakeClock, make_kv, tokens
from redis.backoff import ConstantBackoff

from kvstore.codec import Codec, CodecConfig
from kvstore.spec import ModelSpec
from tiers.base import BlockRef
from tiers.remote import RemoteTier
from tiers.remote_config import RemoteConfig
from tiers.remote_redis import CircuitBreaker, connect

SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)
N = SPEC.block_nbytes


def _ref(i: int, tenant: str = "acme") -> BlockRef:
    return BlockRef(tenant, bytes([i]) * 32, SPEC)


def _data(i: int) -> np.ndarray:
    return np.full(N, i, dtype=np.uint8)


# -- 1. one probe after an open period ------------------------------------------------------------
def test_a_breaker_lets_one_probe_through_after_its_open_period() -> None:
    """8 threads asking at once when the period has ended: one goes (the probe), 7 are
    skipped until its outcome is recorded; its fault opens the next period, its success
    closes the breaker."""
    now = FakeClock(0.0)
    b = CircuitBreaker(2, ConstantBackoff(5.0), now)
    b.record(False)
    assert b.record(False) and not b.allow()
    now.advance(5.0)
    start = threading.Barrier(8)
    allowed: list[bool] = []

    def ask() -> None:
        start.wait(10)
        allowed.append(b.allow())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(allowed) == [False] * 7 + [True]
    assert b.is_open and not b.allow()  # still skipped while the probe runs
    assert b.record(False)  # the probe failed: the next period
    now.advance(4.9)
    assert not b.allow()
    now.advance(0.1)
    assert b.allow() and not b.allow()
    assert not b.record(True) and not b.is_open  # the probe answered: closed
    assert b.allow() and b.allow()


class _Hanging:
    """A redis client in front of a real one. While ``hung``: the first command (a ``GET`` or a
    pipeline) waits for ``gate`` (a paused Redis, until its socket timeout), then raises a
    timeout; any other raises one at once (counted in ``sent`` all the same)."""

    def __init__(self, real: redis.Redis) -> None:
        self.real = real
        self.hung = False
        self.sent = 0
        self.entered = threading.Event()
        self.gate = threading.Event()
        self._lock = threading.Lock()

    def send(self, fn: Any) -> Any:
        with self._lock:
            self.sent += 1
            first = self.hung and not self.entered.is_set()
            if first:
                self.entered.set()
        if not self.hung:
            return fn()
        if first:
            assert self.gate.wait(30)
        raise redis.exceptions.TimeoutError("Timeout reading from socket")

    def get(self, key: Any) -> Any:
        return self.send(lambda: self.real.get(key))

    def pipeline(self, transaction: bool = False) -> Any:
        return _Pipe(self, self.real.pipeline(transaction=transaction))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _Pipe:
    def __init__(self, owner: _Hanging, pipe: Any) -> None:
        self.owner, self.pipe = owner, pipe

    def execute_command(self, *args: Any) -> None:
        self.pipe.execute_command(*args)

    def execute(self, raise_on_error: bool = True) -> Any:
        return self.owner.send(lambda: self.pipe.execute(raise_on_error=raise_on_error))


def test_gets_on_a_hung_redis_wait_for_one_probe_per_open_period(redis_ns) -> None:
    """Redis hangs; the breaker opened. When its period ends, one get waits (the probe) while
    8 others miss at once without reaching Redis (each waited a whole timeout before); the
    probe's timeout opens the next period; once Redis answers, the next probe closes it."""
    url, ns = redis_ns
    mono = FakeClock(0.0)
    cfg = RemoteConfig(urls=[url], namespace=ns, retries=0, breaker_failures=1, breaker_base_s=1.0,
                       breaker_cap_s=2.0)
    client = _Hanging(connect(cfg))
    t = RemoteTier(cfg, client, Codec(CodecConfig(encrypt=False), None), monotonic=mono)  # type: ignore[arg-type]
    out = np.empty(N, np.uint8)
    try:
        client.hung = True
        client.gate.set()  # the first timeout: at once
        assert not t.get_into(_ref(1), out)
        assert t.metrics()["breakers_open"] == 1 and client.sent == 1
        client.entered.clear()
        client.gate.clear()
        mono.advance(10.0)  # past any period: the next get is the probe
        probe = threading.Thread(target=t.get_into, args=(_ref(1), np.empty(N, np.uint8)))
        probe.start()
        assert client.entered.wait(30)
        missed = [t.get_into(_ref(i), np.empty(N, np.uint8)) for i in range(2, 6)]
        missed += t.get_many_into([_ref(i) for i in range(6, 10)], [np.empty(N, np.uint8)] * 4)
        assert missed == [False] * 8
        assert client.sent == 2, "gets went to the hung Redis besides the probe"
        assert t.metrics()["breaker_skips"] == 8
        client.gate.set()
        probe.join(30)
        m = t.metrics()
        assert m["breaker_trips"] == 2 and m["breakers_open"] == 1  # the next, longer period
        client.hung = False
        mono.advance(10.0)
        assert not t.get_into(_ref(1), out)  # the probe: Redis answers (nothing there)
        assert t.metrics()["breakers_open"] == 0
    finally:
        client.gate.set()
        t.close()


# -- 2. an empty or torn deletions position -------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"\x00" * 24, b"kv", b"{ns} 17"],
                         ids=["empty", "zeros", "torn-namespace", "no-newline"])
def test_a_torn_position_applies_the_whole_retained_stream(redis_ns, tmp_path: Path, caplog,
                                                           content: bytes) -> None:
    """A position file read empty or torn (a power loss before its data reached the disk) is
    "unknown": B applies every deletion the stream holds, from its start, before its open
    returns, counts it and says so. (Read as none, B started from the stream's end and applied
    nothing: a deleted tenant's blocks were served from its NVMe.)"""
    url, ns = redis_ns
    cfg = RemoteConfig(urls=[url], namespace=ns)
    a = RemoteTier.open(cfg, MASTER)
    b = RemoteTier.open(cfg, MASTER)
    pos = tmp_path / "remote-deletions.pos"
    pos.write_bytes(content.replace(b"{ns}", ns.encode()))
    seen: list[Any] = []
    try:
        a.publish_deletion("acme", [bytes([1]) * 32])
        a.publish_deletion("acme", [bytes([2]) * 32])
        with caplog.at_level(logging.WARNING, logger="tiers.remote_invalidate"):
            b.on_deletion(lambda d: seen.append(d) or 0, position=pos)
        assert [sorted(d.keys) for d in seen] == [[bytes([1]) * 32], [bytes([2]) * 32]]
        assert b.metrics()["deletions_position_unknown"] == 1
        assert "applying every deletion the stream" in caplog.text
        text = pos.read_text()
        assert text.startswith(f"{ns} ") and text.endswith("\n")  # whole again
        assert not pos.with_name(pos.name + ".tmp").exists()
    finally:
        a.close()
        b.close()


def test_a_missing_or_whole_position_is_read_as_before(redis_ns, tmp_path: Path) -> None:
    """No file (a first start): from the stream's end, nothing counted; a whole file: from the
    entry it names."""
    url, ns = redis_ns
    cfg = RemoteConfig(urls=[url], namespace=ns)
    a = RemoteTier.open(cfg, MASTER)
    pos = tmp_path / "remote-deletions.pos"
    seen: list[Any] = []
    try:
        a.publish_deletion("acme", [bytes([1]) * 32])
        b = RemoteTier.open(cfg, MASTER)
        b.on_deletion(lambda d: seen.append(d) or 0, position=pos)
        b.close()
        assert seen == [] and b.metrics().get("deletions_position_unknown", 0) == 0
        a.publish_deletion("acme", [bytes([2]) * 32])
        b = RemoteTier.open(cfg, MASTER)
        b.on_deletion(lambda d: seen.append(d) or 0, position=pos)
        b.close()
        assert [sorted(d.keys) for d in seen] == [[bytes([2]) * 32]]
        assert b.metrics().get("deletions_position_unknown", 0) == 0
    finally:
        a.close()


# -- 3. the tenant's TTL caps a promoted block ----------------------------------------------------
def test_a_promoted_copy_without_a_deadline_gets_the_tenants_ttl(servers) -> None:
    """B (no policy) wrote a chain without a deadline; A, whose tenant TTL is 10 s, promotes
    it: it expires on A 10 s later (before: never), and its copy in Redis with it."""
    a, b = servers("a"), servers("b")
    clock = servers.clock
    a.set_tenant_policy("t", ttl_s=10.0)
    a.flush()
    keys = b.block_keys("t", SPEC, tokens(2, SPEC))
    kv = make_kv(SPEC, 2)
    b.put("t", SPEC, keys, kv)
    b.flush()
    assert torch.equal(a.get("t", SPEC, keys), kv)  # promoted into A's HBM
    assert a.lookup("t", SPEC, keys).tiers == ["hbm", "hbm"]
    a.flush()
    clock.advance(9.0)
    assert a.lookup("t", SPEC, keys).num_blocks == 2
    clock.advance(1.0)
    assert a.lookup("t", SPEC, keys).num_blocks == 0  # here, and no remote copy either


def test_a_promoted_copy_keeps_a_sooner_deadline(servers) -> None:
    """A copy whose deadline comes before the tenant's TTL keeps it."""
    a, b = servers("a"), servers("b")
    clock = servers.clock
    a.set_tenant_policy("t", ttl_s=10.0)
    keys = b.block_keys("t", SPEC, tokens(2, SPEC))
    b.put("t", SPEC, keys, make_kv(SPEC, 2), ttl_s=4.0)
    b.flush()
    assert a.get("t", SPEC, keys).shape[0] == 2
    clock.advance(3.9)
    assert a.lookup("t", SPEC, keys).tiers == ["hbm", "hbm"]
    clock.advance(0.1)
    assert a.lookup("t", SPEC, keys).num_blocks == 0


# -- 4. a block with a queued demotion counts once against its tenant's remote quota --------------
@pytest.fixture
def held_writer(servers):
    """A Store's remote tier whose writer is held in its writes until ``gate`` is set (a
    ``put`` of the test's own thread is not held)."""
    tier = servers("a")._remote
    inner, gate, entered = tier._put_with, threading.Event(), threading.Event()

    def held_put(*args: Any, **kw: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():  # the writer's
            entered.set()
            assert gate.wait(30)
        return inner(*args, **kw)

    tier._put_with = held_put
    yield tier, gate, entered
    gate.set()


def test_a_spill_queued_behind_its_write_through_counts_once(held_writer) -> None:
    """Quota 2 blocks: Z is being written, X's write-through queued; X's eviction spill (skip
    held) was refused (Z + X + X = 3 blocks), though the first write of X was coming."""
    tier, gate, entered = held_writer
    assert tier.submit(_ref(9), _data(9))
    assert entered.wait(30)
    assert tier.submit(_ref(1), _data(1), quota=2 * N)
    assert tier.submit(_ref(1), _data(1), quota=2 * N, skip_held=True), "the spill was refused"
    assert not tier.submit(_ref(2), _data(2), quota=2 * N)  # a third block is over it
    gate.set()
    assert tier.flush(30)
    m = tier.metrics()
    assert m["queue_written"] == 2 and m["queue_skipped_held"] == 1
    assert tier.tenant_bytes("acme") == 2 * N


def test_a_queued_rewrite_of_a_written_copy_counts_once(held_writer) -> None:
    """X written (held); its rewrite queued (a later deadline) behind Z: a third block Y with a
    quota of 3 was refused (X held + Z + X queued + Y = 4 blocks)."""
    tier, gate, entered = held_writer
    assert tier.put(_ref(1), _data(1), parent=b"")
    assert tier.submit(_ref(9), _data(9))
    assert entered.wait(30)
    assert tier.submit(_ref(1), _data(1), ttl_deadline=2e9, quota=3 * N)
    assert tier.submit(_ref(2), _data(2), quota=3 * N), "X was counted twice"
    assert not tier.submit(_ref(3), _data(3), quota=3 * N)
    gate.set()
    assert tier.flush(30)
    assert tier.tenant_bytes("acme") == 3 * N
