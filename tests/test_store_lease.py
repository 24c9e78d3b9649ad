"""Read leases (Store.lease_prefix), which the in-band Get stream uses to build its frames straight
from the blocks' bytes in their tier: the same prefix and bytes as get_into, leased blocks never
evicted or demoted, their memory never reused until the lease ends (even when the block is
deleted or promoted meanwhile), and every lease released — also by a cancelled or abandoned Get."""

from __future__ import annotations

import gc
import shutil
import tempfile
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import MASTER, FakeClock, make_kv, tokens
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvstore.config import StoreConfig
from kvstore.errors import ResourceExhausted
from kvstore.frames import decoder
from kvstore.spec import ModelSpec
from kvstore.store import Store
from proto.kvstore.v1 import kvstore_pb2 as pb

T = "tenant-a"
#: HBM as host memory, as on a machine without a GPU: its blocks are leased in place (an HBM
#: arena on an accelerator is a device tensor, whose blocks a lease copies into staging instead)
CPU = "cpu"


def _rows(kv: torch.Tensor) -> np.ndarray:
    return kv.contiguous().view(torch.uint8).reshape(kv.shape[0], -1).numpy()


class Staging:
    """A ``stage`` callback that hands out fresh buffers and remembers them."""

    def __init__(self, spec: ModelSpec) -> None:
        self.nbytes, self.given = spec.block_nbytes, []

    def __call__(self, i: int) -> np.ndarray:
        self.given.append(np.zeros(self.nbytes, np.uint8))
        return self.given[-1]


def _tiers(store: Store, spec: ModelSpec, keys: list[bytes]) -> list[str]:
    return store.lookup(T, spec, keys).tiers


def _used(store: Store, tier: str) -> int:
    return store.stats()["tiers"][tier]["used_bytes"]


def _filler(store: Store, spec: ModelSpec, n: int, start: int) -> list[bytes]:
    """Put ``n`` blocks of an unrelated chain (from token ``start``); their keys."""
    keys = store.block_keys(T, spec, tokens(n, spec, start=start))
    store.put(T, spec, keys, make_kv(spec, n, seed=start))
    return keys


# -- the store API --------------------------------------------------------------------------------
def test_a_lease_serves_what_get_into_serves_in_place(open_store, spec):
    store = open_store(spec, hbm_blocks=2, dram_blocks=2, high_watermark=1.0, low_watermark=1.0, device=CPU)
    keys = store.block_keys(T, spec, tokens(6, spec))
    kv = make_kv(spec, 6, seed=1)
    store.put(T, spec, keys, kv)
    assert _tiers(store, spec, keys) == ["hbm", "hbm", "dram", "dram", "nvme", "nvme"]
    stage = Staging(spec)
    missing = store.block_keys(T, spec, tokens(7, spec))[6:]
    with store.lease_prefix(T, spec, [*keys, *missing], stage) as lease:
        assert len(lease.views) == 6  # the longest usable prefix: the 7th block misses
        for view, row in zip(lease.views, _rows(kv)):
            assert np.array_equal(view, row)
        # memory-tier blocks are read in place, read-only; the NVMe ones were decoded into staging
        assert [any(v is g for g in stage.given) for v in lease.views] == [False] * 4 + [True] * 2
        assert not any(v.flags.writeable for v in lease.views[:4])
    assert lease.released
    counters = store.stats()["counters"]
    assert counters["hits"] == 6 and counters["misses"] == 1


def test_a_leased_block_is_not_evicted_while_the_tier_fills_and_reads_bit_exact(open_store, spec):
    store = open_store(spec, hbm_blocks=2, dram_blocks=2, high_watermark=1.0, low_watermark=1.0, device=CPU)
    keys = store.block_keys(T, spec, tokens(2, spec))
    kv = make_kv(spec, 2, seed=2)
    store.put(T, spec, keys, kv)
    lease = store.lease_prefix(T, spec, keys, Staging(spec))
    try:
        _filler(store, spec, 4, start=10_000)  # HBM is full of leased blocks: these land below
        assert _tiers(store, spec, keys) == ["hbm", "hbm"]
        assert all(np.array_equal(v, r) for v, r in zip(lease.views, _rows(kv)))
    finally:
        lease.release()
    _filler(store, spec, 2, start=20_000)  # unpinned again: making room demotes them
    assert _tiers(store, spec, keys) != ["hbm", "hbm"]
    assert torch.equal(store.get(T, spec, keys).view(torch.int16), kv.view(torch.int16))


def test_a_leased_block_deleted_meanwhile_keeps_its_memory_until_the_release(open_store, spec):
    store = open_store(spec, hbm_blocks=2, dram_blocks=4, high_watermark=1.0, low_watermark=1.0, device=CPU)
    keys = store.block_keys(T, spec, tokens(2, spec))
    kv = make_kv(spec, 2, seed=3)
    store.put(T, spec, keys, kv)
    lease = store.lease_prefix(T, spec, keys, Staging(spec))
    assert store.delete(T, keys) == 2
    assert store.lookup(T, spec, keys).num_blocks == 0  # gone at once ...
    assert _used(store, "hbm") == 2 * spec.block_nbytes  # ... but its slots are not reused
    other = _filler(store, spec, 2, start=30_000)
    assert _tiers(store, spec, other) == ["dram", "dram"]
    assert all(np.array_equal(v, r) for v, r in zip(lease.views, _rows(kv)))
    lease.release()
    assert _used(store, "hbm") == 0
    lease.release()  # idempotent
    assert _used(store, "hbm") == 0


def test_a_leased_block_dropped_with_its_parent_keeps_its_memory_until_the_release(open_store, spec):
    store = open_store(spec, hbm_blocks=2, dram_blocks=2, high_watermark=1.0, low_watermark=1.0, device=CPU)
    keys = store.block_keys(T, spec, tokens(4, spec))
    kv = make_kv(spec, 4, seed=4)
    store.put(T, spec, keys, kv)
    assert _tiers(store, spec, keys) == ["hbm", "hbm", "dram", "dram"]
    lease = store.lease_prefix(T, spec, keys[2:], Staging(spec), parent=keys[1])
    assert store.delete(T, keys[:1]) == 4  # the DRAM blocks depend on it: dropped too
    assert _used(store, "dram") == 2 * spec.block_nbytes
    _filler(store, spec, 4, start=40_000)  # would reuse the freed DRAM slots
    assert all(np.array_equal(v, r) for v, r in zip(lease.views, _rows(kv)[2:]))
    lease.release()
    assert _used(store, "dram") <= 2 * spec.block_nbytes  # only the fillers' DRAM blocks left


def test_a_leased_block_promoted_meanwhile_frees_its_old_slot_only_at_release(open_store, spec):
    store = open_store(spec, hbm_blocks=2, dram_blocks=2, high_watermark=1.0, low_watermark=1.0, device=CPU)
    store.open_session(T, "s")
    pinned = store.block_keys(T, spec, tokens(2, spec, start=50_000))
    store.put(T, spec, pinned, make_kv(spec, 2), session="s")  # HBM is full of pinned blocks
    keys = store.block_keys(T, spec, tokens(2, spec))
    kv = make_kv(spec, 2, seed=5)
    store.put(T, spec, keys, kv)
    lease = store.lease_prefix(T, spec, keys, Staging(spec))
    assert _tiers(store, spec, keys) == ["dram", "dram"]  # no room to promote: leased in DRAM
    store.close_session(T, "s")
    assert store.prefetch(T, spec, keys, "hbm") == 2  # moves the leased blocks up ...
    assert _tiers(store, spec, keys) == ["hbm", "hbm"]
    assert _used(store, "dram") == 2 * spec.block_nbytes  # ... their DRAM slots stay held
    other = _filler(store, spec, 2, start=60_000)
    assert _tiers(store, spec, other) == ["nvme", "nvme"]
    assert all(np.array_equal(v, r) for v, r in zip(lease.views, _rows(kv)))
    lease.release()
    assert _used(store, "dram") == 0  # the old slots are free now
    assert torch.equal(store.get(T, spec, keys).view(torch.int16), kv.view(torch.int16))


def test_leased_blocks_leave_no_room_and_a_put_says_so(open_store, spec):
    store = open_store(spec, hbm_blocks=2, dram_blocks=0, nvme_blocks=0, high_watermark=1.0,
                       low_watermark=1.0, device=CPU)
    keys = store.block_keys(T, spec, tokens(2, spec))
    store.put(T, spec, keys, make_kv(spec, 2))
    with store.lease_prefix(T, spec, keys, Staging(spec)), pytest.raises(ResourceExhausted):
        _filler(store, spec, 1, start=70_000)
    _filler(store, spec, 1, start=70_000)  # room again once released


def test_an_error_while_taking_a_lease_holds_nothing(open_store, spec):
    store = open_store(spec, hbm_blocks=2, dram_blocks=0, high_watermark=1.0, low_watermark=1.0, device=CPU)
    keys = store.block_keys(T, spec, tokens(4, spec))
    store.put(T, spec, keys, make_kv(spec, 4, seed=6))
    assert _tiers(store, spec, keys) == ["hbm", "hbm", "nvme", "nvme"]  # leased, then staged

    def broken(i: int) -> np.ndarray:
        raise RuntimeError("no staging memory")

    with pytest.raises(RuntimeError):
        store.lease_prefix(T, spec, keys, broken)
    assert store.delete(T, keys) == 4
    assert _used(store, "hbm") == 0  # nothing stayed leased


def test_a_lease_released_after_the_store_closed_is_harmless(open_store, spec):
    store = open_store(spec, device=CPU)
    keys = store.block_keys(T, spec, tokens(2, spec))
    kv = make_kv(spec, 2, seed=7)
    store.put(T, spec, keys, kv)
    lease = store.lease_prefix(T, spec, keys, Staging(spec))
    store.close()
    assert all(np.array_equal(v, r) for v, r in zip(lease.views, _rows(kv)))  # memory kept alive
    lease.release()


def test_another_tenant_leases_nothing(open_store, spec):
    store = open_store(spec, device=CPU)
    keys = store.block_keys(T, spec, tokens(2, spec))
    store.put(T, spec, keys, make_kv(spec, 2))
    with store.lease_prefix("tenant-b", spec, keys, Staging(spec)) as lease:
        assert lease.views == []


# -- invariants under random operations -------------------------------------------------------------
SM_SPEC = ModelSpec(model="lease", revision="r", num_layers=1, num_kv_heads=2, head_dim=16,
                    dtype="float16", block_tokens=4)
N = SM_SPEC.block_nbytes
assert N % 256 == 0
CHAINS = 4


def _chain_keys(store: Store, c: int) -> list[bytes]:
    return store.block_keys(T, SM_SPEC, list(range(1000 * c, 1000 * c + 3 * SM_SPEC.block_tokens)))


def _value(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, N, dtype=np.uint8)


class LeaseMachine(RuleBasedStateMachine):
    """Leases held across puts, deletes, prefetches and gets: a leased view never changes; tier
    usage never passes capacity; once every lease is released no slot stays held."""

    leases = Bundle("leases")

    @initialize()
    def setup(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvlease-"))
        self.store = Store.open(StoreConfig(path=self.dir, hbm_bytes=3 * N, dram_bytes=3 * N,
                                            nvme_bytes=12 * N, master_key=MASTER, durable=False, device=CPU,
                                            high_watermark=1.0, low_watermark=1.0),
                                clock=FakeClock())
        self.held: list[tuple[object, list[bytes]]] = []

    def teardown(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(c=st.integers(0, CHAINS - 1), n=st.integers(1, 3))
    def put(self, c: int, n: int) -> None:
        keys = _chain_keys(self.store, c)[:n]
        try:
            self.store.put_bytes(T, SM_SPEC, keys, [_value(k) for k in keys])
        except ResourceExhausted:
            pass  # every tier full of leased blocks

    @rule(c=st.integers(0, CHAINS - 1), n=st.integers(1, 3))
    def delete(self, c: int, n: int) -> None:
        self.store.delete(T, _chain_keys(self.store, c)[n - 1 : n])

    @rule(c=st.integers(0, CHAINS - 1), tier=st.sampled_from(["hbm", "dram"]))
    def prefetch(self, c: int, tier: str) -> None:
        self.store.prefetch(T, SM_SPEC, _chain_keys(self.store, c), tier)

    @rule(target=leases, c=st.integers(0, CHAINS - 1))
    def lease(self, c: int):
        keys = _chain_keys(self.store, c)
        lease = self.store.lease_prefix(T, SM_SPEC, keys, Staging(SM_SPEC))
        assert len(lease.views) == self.store.lookup(T, SM_SPEC, keys).num_blocks
        self.held.append((lease, keys[: len(lease.views)]))
        return lease

    @rule(lease=consumes(leases))
    def release(self, lease) -> None:
        lease.release()
        self.held = [(le, k) for le, k in self.held if le is not lease]

    @invariant()
    def leased_bytes_never_change(self) -> None:
        for lease, keys in self.held:
            for view, key in zip(lease.views, keys):
                assert np.array_equal(view, _value(key))

    @invariant()
    def usage_within_capacity(self) -> None:
        for tier in ("hbm", "dram"):
            t = self.store.stats()["tiers"][tier]
            assert t["used_bytes"] <= t["capacity_bytes"]

    @invariant()
    def without_leases_no_slot_is_held(self) -> None:
        if not self.held:
            for tier in ("hbm", "dram"):
                t = self.store.stats()["tiers"][tier]
                assert t["used_bytes"] == t["blocks"] * N


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# -- through the in-band Get stream ---------------------------------------------------------------
#: 4 MiB blocks: a stream of two is far more than grpc buffers, so a server whose client stops
#: reading waits in the middle of it, holding the lease
BIG = ModelSpec(model="lease-big", revision="r", num_layers=32, num_kv_heads=8, head_dim=64,
                dtype="float16", block_tokens=64)


def _raw_get(sc, token: str, keys: list[bytes], chunk_bytes: int = 64 * 1024):
    """A Get stream read frame by frame (the client's own get reads it to the end).

    The channel keeps HTTP/2's initial 64 KiB receive window (no BDP probing): otherwise, on a
    fast machine, the window grows until the server has handed the whole rest of the stream to
    the transport and finished (releasing its lease) before the test reads on."""
    from kvstore.service_convert import spec_to_pb

    ch = grpc.insecure_channel(sc.target, options=[("grpc.http2.bdp_probe", 0)])
    get = ch.unary_stream("/kvstore.v1.KVStore/Get", request_serializer=pb.GetRequest.SerializeToString,
                          response_deserializer=decoder(pb.GetFrame))
    req = pb.GetRequest(target=pb.Target(spec=spec_to_pb(BIG), keys=b"".join(keys)), chunk_bytes=chunk_bytes)
    return ch, get(req, metadata=(("authorization", f"Bearer {token}"),), timeout=30)


def _hbm(sc) -> int:
    return sc.server.store.stats()["tiers"]["hbm"]["used_bytes"]


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    tick = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return True
        tick.wait(0.01)
    return predicate()


@pytest.fixture
def small_sidecar(tmp_path):
    """HBM and DRAM of two BIG blocks each."""
    from service_harness import start

    n = BIG.block_nbytes
    sc = start(tmp_path, store={"hbm_bytes": 2 * n, "dram_bytes": 2 * n, "high_watermark": 1.0,
                                "low_watermark": 1.0, "device": CPU})
    yield sc
    sc.stop()


def _big_chain(sc, name: str, seed: int):
    from service_harness import fresh_tokens, random_kv

    token = sc.admin().create_tenant(name)
    c = sc.client(token, local=False)
    keys = c.block_keys(BIG, fresh_tokens(2, BIG))
    kv = random_kv(2, BIG, seed=seed)
    c.put(BIG, keys, kv)
    assert c.lookup(BIG, keys).tiers == ["hbm", "hbm"]
    return token, c, keys, kv


def test_a_half_read_get_stream_keeps_its_blocks_while_the_tier_fills(small_sidecar):
    from service_harness import fresh_tokens, random_kv

    sc = small_sidecar
    token, c, keys, kv = _big_chain(sc, "slow", seed=11)
    ch, stream = _raw_get(sc, token, keys)
    with ch:
        frames = [next(stream), next(stream)]  # the header and the first chunk: the rest waits
        other = c.block_keys(BIG, fresh_tokens(2, BIG))
        c.put(BIG, other, random_kv(2, BIG, seed=12))  # HBM holds the leased blocks: lands below
        assert c.lookup(BIG, other).tiers == ["dram", "dram"]
        assert c.lookup(BIG, keys).tiers == ["hbm", "hbm"]
        c.delete(keys)  # gone for everyone else; the stream still reads the old bytes
        assert _hbm(sc) == 2 * BIG.block_nbytes
        frames += list(stream)
    got = np.zeros((2, BIG.block_nbytes), np.uint8)
    assert frames[0].meta.header.num_blocks == 2
    for f in frames[1:]:
        got[f.meta.block, f.meta.offset : f.meta.offset + len(f.data)] = np.frombuffer(f.data, np.uint8)
    assert np.array_equal(got, _rows(kv))
    assert _wait_for(lambda: _hbm(sc) == 0)  # the finished stream released the deleted slots


@pytest.mark.parametrize("read", [1, 3], ids=["after-header", "mid-stream"])
def test_a_cancelled_get_stream_releases_its_lease(small_sidecar, read):
    sc = small_sidecar
    token, c, keys, _ = _big_chain(sc, f"cancel-{read}", seed=13)
    ch, stream = _raw_get(sc, token, keys)
    with ch:
        for _ in range(read):
            next(stream)
        c.delete(keys)
        assert _hbm(sc) == 2 * BIG.block_nbytes  # held by the stream's lease
        stream.cancel()
        assert _wait_for(lambda: _hbm(sc) == 0)


@pytest.mark.parametrize("read", [0, 2], ids=["unstarted", "started"])
def test_an_abandoned_get_stream_releases_its_lease(small_sidecar, read):
    from kvstore.service_convert import spec_to_pb
    from kvstore.service_streams import get_stream

    sc = small_sidecar
    token, c, keys, _ = _big_chain(sc, f"abandon-{read}", seed=14)
    req = pb.GetRequest(target=pb.Target(spec=spec_to_pb(BIG), keys=b"".join(keys)), chunk_bytes=1 << 20)
    frames = get_stream(sc.server.data, sc.server.registry.authenticate(token), req)
    if read:
        next(frames)  # the header
    for _ in range(read):
        next(frames)
    c.delete(keys)
    assert _hbm(sc) == 2 * BIG.block_nbytes
    del frames  # neither finished nor closed: dropped
    gc.collect()
    assert _hbm(sc) == 0


def test_blocks_found_in_the_remote_tier_are_staged_bit_exact(tmp_path, redis_ns):
    from tiers.remote_config import RemoteConfig

    url, ns = redis_ns
    spec = SM_SPEC

    def server(name: str) -> Store:
        return Store.open(StoreConfig(path=tmp_path / name, hbm_bytes=8 * N, dram_bytes=8 * N,
                                      nvme_bytes=16 * N, master_key=MASTER, remote_write="through", device=CPU,
                                      remote=RemoteConfig(urls=[url], namespace=ns)))

    a, b = server("a"), server("b")
    try:
        keys = _chain_keys(a, 0)
        a.put_bytes(T, spec, keys, [_value(k) for k in keys])
        a.flush()
        b.put_bytes(T, spec, keys[:1], [_value(keys[0])])  # the first block is local on b
        stage = Staging(spec)
        with b.lease_prefix(T, spec, keys, stage) as lease:
            assert len(lease.views) == 3
            assert [any(v is g for g in stage.given) for v in lease.views] == [False, True, True]
            assert all(np.array_equal(v, _value(k)) for v, k in zip(lease.views, keys))
        assert b.lookup(T, spec, keys).tiers == ["hbm"] * 3  # promoted on hit, as get does
    finally:
        a.close()
        b.close()
