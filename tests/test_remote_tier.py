"""Remote tier against a real Redis (127.0.0.1:6379, or a private redis-server).

Every test writes under its own random namespace and deletes it afterwards, so tests can share
a Redis with other users."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote_harness import Procs, redis_url

from kvstore.codec import Codec, CodecConfig
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.keyring import Keyring
from kvstore.spec import ModelSpec
from tiers.base import BlockRef
from tiers.remote import RemoteTier
from tiers.remote_config import RemoteConfig
from tiers.remote_redis import CircuitBreaker, connect

MASTER = bytes(range(32))
SPEC = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                 dtype="float16", block_tokens=4)


class Clock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    procs = Procs()
    yield redis_url(procs, tmp_path_factory.mktemp("redis"))
    procs.stop()


@pytest.fixture
def raw(url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(url)
    yield c
    c.close()


@pytest.fixture
def make(url: str, raw: redis.Redis) -> Iterator:
    """``make(**config) -> RemoteTier`` on a fresh namespace (shared by the calls of a test)."""
    ns = f"test-{uuid.uuid4().hex[:12]}"
    clock = Clock()
    made: list[RemoteTier] = []

    def _make(**kw: object) -> RemoteTier:
        kw.setdefault("urls", [url])
        cfg = RemoteConfig(namespace=ns, **kw)
        t = RemoteTier.open(cfg, MASTER, clock=clock)
        made.append(t)
        return t

    _make.ns, _make.clock = ns, clock  # type: ignore[attr-defined]
    yield _make
    for t in made:
        t.close()
    for k in raw.scan_iter(match=f"{ns}:*", count=1000):
        raw.unlink(k)


def ref(i: int, tenant: str = "a", spec: ModelSpec = SPEC) -> BlockRef:
    return BlockRef(tenant, bytes([i % 256]) * 31 + bytes([i // 256]), spec)


def block(i: int, spec: ModelSpec = SPEC) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, spec.block_nbytes, dtype=np.uint8)


def out() -> np.ndarray:
    return np.zeros(SPEC.block_nbytes, dtype=np.uint8)


def test_put_get_bit_exact(make) -> None:
    t = make()
    for i in range(3):
        assert t.put(ref(i), block(i))
    for i in range(3):
        o = out()
        assert t.get_into(ref(i), o)
        assert np.array_equal(o, block(i))
    m = t.metrics()
    assert m["puts"] == 3 and m["hits"] == 3 and m.get("misses", 0) == 0
    u = t.usage()
    assert (u.used_bytes, u.blocks) == (3 * SPEC.block_nbytes, 3)
    assert t.tenant_bytes("a") == 3 * SPEC.block_nbytes and t.tenant_bytes("b") == 0


def test_encrypted_at_rest(make, raw: redis.Redis) -> None:
    t = make()
    data = np.frombuffer((b"SECRET-PROMPT-KV-" * 1000)[: SPEC.block_nbytes], dtype=np.uint8)
    assert t.put(ref(1, "alice"), data)
    value = raw.get(t.redis_key(ref(1, "alice")))
    assert value is not None and len(value) >= SPEC.block_nbytes
    assert b"SECRET-PROMPT" not in value and b"alice" not in value
    assert b"alice" not in t.redis_key(ref(1, "alice"))  # the key carries a hash only
    o = out()
    assert t.get_into(ref(1, "alice"), o) and o.tobytes() == data.tobytes()


def test_compression_obeys_min_compress_ratio(make, raw: redis.Redis) -> None:
    """A block that shrinks ~2x is stored compressed under a ratio floor of 1.0 and raw under
    one of 4.0; both read back exactly."""
    spec = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype="float16", block_tokens=256)  # 32 KiB: the header is noise
    data = np.zeros(spec.block_nbytes, dtype=np.uint8)
    data[::2] = block(7, spec)[::2]  # every other byte random: ~2x with zstd
    sizes = {}
    for floor in (1.0, 4.0):
        t = make(compression_level=1, min_compress_ratio=floor, encrypt=False)
        r = ref(int(floor), spec=spec)
        assert t.put(r, data)
        sizes[floor] = len(raw.get(t.redis_key(r)))
        o = np.zeros(spec.block_nbytes, dtype=np.uint8)
        assert t.get_into(r, o) and np.array_equal(o, data)
    assert sizes[1.0] < 0.7 * spec.block_nbytes < spec.block_nbytes <= sizes[4.0]
    with pytest.raises(ValueError):
        RemoteConfig(urls=["redis://127.0.0.1:6379"], min_compress_ratio=0.5)


def test_tenant_isolation(make) -> None:
    t = make()
    assert t.put(ref(7, "a"), block(7))
    o = out()
    assert not t.get_into(ref(7, "b"), o)
    assert t.contains_many([ref(7, "a"), ref(7, "b")]) == [True, False]
    assert t.redis_key(ref(7, "a")) != t.redis_key(ref(7, "b"))
    assert not o.any()


def test_model_fingerprint_namespaces(make) -> None:
    t = make()
    other = ModelSpec(model="m", revision="r2", num_layers=2, num_kv_heads=2, head_dim=8,
                      dtype="float16", block_tokens=4)
    assert t.put(ref(3), block(3))
    assert t.contains_many([ref(3), ref(3, spec=other)]) == [True, False]
    assert t.delete_model(SPEC.fingerprint) == 1
    assert t.contains_many([ref(3)]) == [False]


def test_ttl_maps_to_redis_expiry(make, raw: redis.Redis) -> None:
    t = make(ttl_cap_s=3600.0)
    clock = make.clock
    assert t.put(ref(1), block(1), ttl_deadline=clock() + 0.3)
    assert 0 < raw.pttl(t.redis_key(ref(1))) <= 300
    assert t.put(ref(2), block(2))  # no TTL: the cap applies
    assert 3_590_000 < raw.pttl(t.redis_key(ref(2))) <= 3_600_000
    assert not t.put(ref(3), block(3), ttl_deadline=clock() - 1)  # already expired
    time.sleep(0.5)
    o = out()
    assert not t.get_into(ref(1), o)
    assert t.get_into(ref(2), o) and np.array_equal(o, block(2))
    assert t.update_ttl(ref(2), clock() + 10)
    assert 0 < raw.pttl(t.redis_key(ref(2))) <= 10_000
    clock.t += 11  # local accounting follows the same deadlines
    assert t.usage().blocks == 0


def test_evicted_key_is_a_miss(make, raw: redis.Redis) -> None:
    t = make()
    assert t.put(ref(1), block(1)) and t.put(ref(2), block(2))
    raw.unlink(t.redis_key(ref(1)))  # what maxmemory eviction does
    o = out()
    assert not t.get_into(ref(1), o) and not o.any()
    assert t.metrics()["misses_absent"] == 1 and t.metrics()["misses"] == 1
    assert t.usage().blocks == 1  # accounting forgot the evicted block
    assert t.get_into(ref(2), o) and np.array_equal(o, block(2))


def test_wrong_key_is_an_integrity_miss(make, url: str) -> None:
    t = make()
    assert t.put(ref(1), block(1))
    cfg = t.config
    # A node whose codec holds another data key for tenant "a" (a different keyring).
    other = Keyring(bytes(32), {})
    other.data_key("a")
    stranger = RemoteTier(cfg, connect(cfg), Codec(CodecConfig(compression_level=0), other))
    try:
        o = out()
        assert not stranger.get_into(ref(1), o)
        assert stranger.metrics()["integrity_failures"] == 1
        assert not o.any()
    finally:
        stranger.close()
    # the value failed its check: it was deleted
    assert t.contains_many([ref(1)]) == [False]


def test_tampered_or_replayed_value_is_a_miss(make, raw: redis.Redis) -> None:
    t = make()
    assert t.put(ref(1), block(1)) and t.put(ref(2), block(2))
    k1, k2 = t.redis_key(ref(1)), t.redis_key(ref(2))
    raw.set(k2, raw.get(k1))  # replay block 1's value under block 2's key
    v = bytearray(raw.get(k1))
    v[-5] ^= 1
    raw.set(k1, bytes(v))  # flip one ciphertext bit
    o = out()
    assert not t.get_into(ref(1), o) and not t.get_into(ref(2), o)
    assert t.metrics()["integrity_failures"] == 2
    assert raw.exists(k1, k2) == 0


def test_pipelined_prefix_lookup_and_gets(make) -> None:
    t = make()
    refs = [ref(i) for i in range(6)]
    for i, r in enumerate(refs):
        if i != 3:
            assert t.put(r, block(i))
    assert t.contains_many(refs) == [True, True, True, False, True, True]
    assert t.prefix_len(refs) == 3
    outs = [out() for _ in refs]
    assert t.get_prefix_into(refs, outs) == 3
    assert all(np.array_equal(outs[i], block(i)) for i in range(3))
    assert not outs[4].any()  # not decoded past the first miss
    got = t.get_many_into(refs, [out() for _ in refs])
    assert got == [True, True, True, False, True, True]


def test_pipelined_gets_batch_by_inflight_bytes(make) -> None:
    big = ModelSpec(model="m", revision="r1", num_layers=4, num_kv_heads=4, head_dim=64,
                    dtype="float16", block_tokens=256)  # 1 MiB blocks: one per batch
    t = make(max_inflight_bytes=1 << 20)
    refs = [ref(i, spec=big) for i in range(3)]
    for i, r in enumerate(refs):
        assert t.put(r, block(i, big))
    outs = [np.zeros(big.block_nbytes, np.uint8) for _ in refs]
    assert t.get_prefix_into(refs, outs) == 3
    assert all(np.array_equal(outs[i], block(i, big)) for i in range(3))


def test_async_demotion(make) -> None:
    t = make()
    for i in range(8):
        assert t.submit(ref(i), block(i).copy())
    assert t.flush(timeout=10)
    outs = [out() for _ in range(8)]
    assert t.get_prefix_into([ref(i) for i in range(8)], outs) == 8
    assert all(np.array_equal(outs[i], block(i)) for i in range(8))
    assert t.metrics()["queue_written"] == 8


def test_delete_tenant(make, raw: redis.Redis) -> None:
    t = make()
    for i in range(5):
        assert t.put(ref(i, "gone"), block(i)) and t.put(ref(i, "kept"), block(i))
    straggler = raw.get(t.redis_key(ref(0, "gone")))
    assert t.delete_tenant("gone") == 5
    assert t.contains_many([ref(i, "gone") for i in range(5)]) == [False] * 5
    assert t.contains_many([ref(i, "kept") for i in range(5)]) == [True] * 5
    assert t.tenant_bytes("gone") == 0 and t.usage().blocks == 5
    raw.set(t.redis_key(ref(0, "gone")), straggler)  # a copy that survived somewhere
    o = out()
    assert not t.get_into(ref(0, "gone"), o) and not o.any()
    assert t.metrics()["key_unavailable"] == 1


def test_shared_keyring_lets_another_node_read(make) -> None:
    a, b = make(), make()
    assert a.put(ref(9), block(9))
    o = out()
    assert b.get_into(ref(9), o) and np.array_equal(o, block(9))


def test_wrong_master_key_fails_at_open(make, url: str) -> None:
    make()  # creates the namespace's keyring with MASTER
    with pytest.raises(FailedPrecondition):
        RemoteTier.open(RemoteConfig(urls=[url], namespace=make.ns), bytes(32))


def test_bad_password_fails_at_open_and_gets_miss(url: str) -> None:
    cfg = RemoteConfig(urls=[url], namespace=f"test-{uuid.uuid4().hex[:8]}",
                       username="ghost", password="not-the-password", retries=0)
    with pytest.raises(FailedPrecondition):
        RemoteTier.open(cfg, MASTER)
    t = RemoteTier(cfg, connect(cfg), Codec(CodecConfig(encrypt=False), None))
    try:
        assert not t.get_into(ref(1), out())
        assert not t.put(ref(1), block(1))
        assert t.metrics()["faults"] >= 2
    finally:
        t.close()


def test_down_server_trips_breaker_without_exceptions() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connection refused
    now = Clock(0.0)
    cfg = RemoteConfig(urls=[f"redis://127.0.0.1:{port}"], retries=0, breaker_failures=2,
                       breaker_base_s=1.0, breaker_cap_s=4.0)
    t = RemoteTier(cfg, connect(cfg), Codec(CodecConfig(encrypt=False), None), monotonic=now)
    try:
        assert not t.get_into(ref(1), out()) and not t.get_into(ref(1), out())
        m = t.metrics()
        assert m["faults"] == 2 and m["breaker_trips"] == 1 and m["breakers_open"] == 1
        assert t.contains_many([ref(1), ref(2)]) == [False, False]
        assert not t.put(ref(1), block(1))
        assert t.metrics()["breaker_skips"] == 3 and t.metrics()["faults"] == 2
        now.t += 4.0  # the open period is over: the next call is a probe
        assert not t.get_into(ref(1), out())
        assert t.metrics()["faults"] == 3 and t.metrics()["breaker_trips"] == 2
    finally:
        t.close()


def test_timeout_is_a_miss_and_full_queue_refuses() -> None:
    with socket.socket() as srv:  # accepts connections, never answers
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        cfg = RemoteConfig(urls=[f"redis://127.0.0.1:{srv.getsockname()[1]}"], retries=0,
                           op_timeout_s=0.3, queue_depth=2)
        t = RemoteTier(cfg, connect(cfg), Codec(CodecConfig(encrypt=False), None))
        try:
            t0 = time.monotonic()
            assert not t.get_into(ref(1), out())
            assert t.metrics()["faults"] == 1
            accepted = [t.submit(ref(i), block(i)) for i in range(6)]
            assert time.monotonic() - t0 < 3.0  # submit never waits on the server
            assert accepted[:2] == [True, True] and not all(accepted)
            assert t.metrics()["queue_rejected"] >= 1
        finally:
            t.close(drain_timeout_s=0.1)


def test_breaker_backoff_and_recovery() -> None:
    from redis.backoff import EqualJitterBackoff

    now = Clock(0.0)
    b = CircuitBreaker(3, EqualJitterBackoff(cap=8.0, base=1.0), now)
    assert not b.record(False) and not b.record(False) and b.allow()
    assert b.record(False) and not b.allow()  # third consecutive fault opens it
    now.t += 2.0  # first period in [1, 2]
    assert b.allow()
    assert b.record(False) and not b.allow()  # a failed probe reopens at once
    now.t += 1.9
    assert not b.allow()  # the second period is at least 2
    now.t += 8.0
    assert b.allow() and not b.record(True)
    assert not b.record(False) and b.allow()  # closed again: needs 3 faults


def test_config_validation() -> None:
    with pytest.raises(InvalidArgument):
        RemoteConfig.build(urls=["http://x"])
    with pytest.raises(InvalidArgument):
        RemoteConfig.build(urls=["redis://x"], tls_cert_file="c.pem")
    with pytest.raises(InvalidArgument):
        RemoteConfig.build(urls=[])
    assert RemoteConfig(urls=["rediss://h:1"]).use_tls
    assert "hunter2" not in repr(RemoteConfig(urls=["redis://h"], password="hunter2"))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "get", "del", "evict"]),
                              st.integers(0, 5), st.sampled_from(["a", "b"])), max_size=25))
def test_get_is_exact_or_miss(make, raw: redis.Redis, ops) -> None:
    """Invariant 1: get returns the bytes put for that (tenant, key), or a miss."""
    for k in raw.scan_iter(match=f"{make.ns}:*", count=1000):  # keys of earlier examples
        if b":keyring:" not in k:
            raw.unlink(k)
    t = make()
    model: dict[tuple[str, int], int] = {}
    version = 0
    for op, i, tenant in ops:
        r = ref(i, tenant)
        if op == "put":
            version += 1
            assert t.put(r, block(version))
            model[(tenant, i)] = version
        elif op == "del":
            t.delete(r)
            model.pop((tenant, i), None)
        elif op == "evict":
            raw.unlink(t.redis_key(r))
            model.pop((tenant, i), None)
        else:
            o = out()
            hit = t.get_into(r, o)
            assert hit == ((tenant, i) in model)
            if hit:
                assert np.array_equal(o, block(model[(tenant, i)]))


def test_bench_quick_runs(url: str, tmp_path: Path) -> None:
    """bench/remote_bench.py --quick completes and writes its JSON (no timing judged)."""
    import json

    from bench.remote_bench import main

    dest = tmp_path / "remote_bench.json"
    assert main(["--quick", "--url", url, "--prefix-blocks", "2", "--out", str(dest)]) == 0
    res = json.loads(dest.read_text())
    assert [c["block_mib"] for c in res["cases"]] == [2]
    figs = res["cases"][0]["figures"]
    assert all(figs[k]["gbps"] > 0 for k in ("plain.set", "plain.get", "remote.put",
                                             "remote.get_into", "remote.get_prefix"))
    assert res["lookup_512"]["blocks"] == 512


def test_keyring_creation_race_resolves_to_the_first_key(make, raw: redis.Redis) -> None:
    from tiers.remote_redis import KeyringRace, RedisKeyBackend

    a, b = make(), make()
    backend = RedisKeyBackend(raw, make.ns)
    with pytest.raises(KeyringRace):  # a second node's different key for the same tenant
        backend["fresh"] = b"\x00" * 60
        backend["fresh"] = b"\x01" * 60
    del backend["fresh"]
    assert a.put(ref(1, "fresh"), block(1))  # a creates the key (SET NX)
    assert b.put(ref(2, "fresh"), block(2))  # b reads a's key instead of making its own
    o = out()
    assert a.get_into(ref(2, "fresh"), o) and np.array_equal(o, block(2))
    assert b.get_into(ref(1, "fresh"), o) and np.array_equal(o, block(1))


def test_deleted_tenant_key_expires_on_other_nodes(url: str, raw: redis.Redis) -> None:
    """Server B keeps a cached copy of a tenant's data key; after server A deletes the tenant,
    B stops decrypting with it once the copy is ``key_cache_ttl_s`` old."""
    ns = f"test-{uuid.uuid4().hex[:12]}"
    mono = Clock(0.0)
    cfg = RemoteConfig(urls=[url], namespace=ns, key_cache_ttl_s=30.0)
    a = RemoteTier.open(cfg, MASTER, monotonic=mono)
    b = RemoteTier.open(cfg, MASTER, monotonic=mono)
    try:
        assert a.put(ref(1, "gone"), block(1))
        o = out()
        assert b.get_into(ref(1, "gone"), o) and np.array_equal(o, block(1))  # B caches the key
        straggler = raw.get(a.redis_key(ref(1, "gone")))
        assert a.delete_tenant("gone") == 1
        raw.set(a.redis_key(ref(1, "gone")), straggler)  # a copy that survived somewhere
        mono.t = 10.0  # within the TTL B still trusts its copy: the documented window
        assert b.get_into(ref(1, "gone"), out())
        mono.t = 31.0
        o = out()
        assert not b.get_into(ref(1, "gone"), o) and not o.any()
        assert b.metrics()["key_unavailable"] == 1
    finally:
        a.close()
        b.close()
        for k in raw.scan_iter(match=f"{ns}:*", count=1000):
            raw.unlink(k)
