"""Store.lookup answers by probing (O(log n)), not by walking: it must agree with the exact
walk that get() does on every key chain, whatever was put, split, deleted, evicted or expired;
the DeadlineHeap behind the expiry step must report exactly the blocks past their deadline."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import MASTER, FakeClock, make_kv, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block import BlockMeta, Tier
from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument, NotFound, ResourceExhausted
from kvstore.expiry import DeadlineHeap
from kvstore.index import PrefixIndex
from kvstore.keys import KEY_BYTES, ROOT_KEY, PackedKeys
from kvstore.spec import ModelSpec
from kvstore.store import Store

SPEC = ModelSpec(model="probe", revision="r", num_layers=1, num_kv_heads=1, head_dim=16,
                 dtype="float16", block_tokens=2)
N = SPEC.block_nbytes
CHAIN = 12


def exact(store: Store, tenant: str, keys: list[bytes], parent: bytes = ROOT_KEY) -> tuple[int, list[str]]:
    """The reference answer: the key-by-key walk get() uses."""
    with store._lock:
        chain = store._chain(tenant, SPEC, keys, store._clock(), parent)
    return len(chain), [m.tier.label for m in chain]


# ops: ("put", chain, start, end, ttl) puts keys[start:end] continuing from keys[start-1];
# ("delete", chain, i); ("advance", dt); ("get", chain) (promotes, so tiers move)
op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 2), st.integers(0, CHAIN - 1), st.integers(1, CHAIN),
              st.sampled_from([None, 2.0, 5.0, 9.0])),
    st.tuples(st.just("delete"), st.integers(0, 2), st.integers(0, CHAIN - 1)),
    st.tuples(st.just("advance"), st.sampled_from([1.0, 3.0, 6.0])),
    st.tuples(st.just("get"), st.integers(0, 2)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=25), policy=st.sampled_from(["lru", "cost"]))
def test_probing_lookup_agrees_with_the_exact_walk(ops, policy):
    tmp = Path(tempfile.mkdtemp(prefix="kvprobe-"))
    clock = FakeClock()
    store = Store.open(StoreConfig(path=tmp, hbm_bytes=6 * N, dram_bytes=6 * N, nvme_bytes=12 * N,
                                   master_key=MASTER, durable=False, policy=policy), clock=clock)
    try:
        chains = [store.block_keys("t", SPEC, tokens(CHAIN, SPEC, start=1000 * c)) for c in range(3)]
        kv = make_kv(SPEC, CHAIN)
        for o in ops:
            if o[0] == "put":
                _, c, start, end, ttl = o
                end = max(end, start + 1)
                parent = chains[c][start - 1] if start else None
                try:
                    store.put("t", SPEC, chains[c][start:end], kv[start:end], ttl_s=ttl, parent=parent)
                except (ResourceExhausted, NotFound):  # no room / the parent is gone
                    pass
            elif o[0] == "delete":
                store.delete("t", [chains[o[1]][o[2]]])
            elif o[0] == "advance":
                clock.advance(o[1])
            else:
                store.get("t", SPEC, chains[o[1]])
            for keys in chains:
                got = store.lookup("t", SPEC, keys)
                assert (got.num_blocks, got.tiers) == exact(store, "t", keys)
                packed = store.lookup("t", SPEC, PackedKeys(b"".join(keys)))
                assert (packed.num_blocks, packed.tiers) == (got.num_blocks, got.tiers)
                # a chain split across calls: the second half continues from the first's last key
                half = CHAIN // 2
                tail = store.lookup("t", SPEC, keys[half:], parent=keys[half - 1])
                if got.num_blocks >= half:
                    assert tail.num_blocks == got.num_blocks - half
                assert (tail.num_blocks, tail.tiers) == exact(store, "t", keys[half:], keys[half - 1])
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_block_outliving_its_expired_parent_is_not_found(open_store, clock, spec):
    """A chain put in two calls can give the child a later deadline than its parent; when the
    parent expires the child is unusable, and lookup (which no longer reads deadlines) must
    still not report it."""
    store = open_store(spec)
    keys = store.block_keys("t", spec, tokens(4, spec))
    kv = make_kv(spec, 4)
    store.put("t", spec, keys[:2], kv[:2], ttl_s=5.0)
    store.put("t", spec, keys[2:], kv[2:], parent=keys[1])  # no TTL: never expires by itself
    assert store.lookup("t", spec, keys).num_blocks == 4
    clock.advance(5.0)
    assert store.lookup("t", spec, keys).num_blocks == 0
    assert store.lookup("t", spec, keys[2:], parent=keys[1]).num_blocks == 0
    assert store.get("t", spec, keys).shape[0] == 0
    assert store._index.get("t", keys[3]) is None  # dropped with its parent's subtree


def test_expire_sweeps_through_the_heap(open_store, clock, spec):
    store = open_store(spec, hbm_blocks=8)
    keys = store.block_keys("t", spec, tokens(6, spec))
    kv = make_kv(spec, 6)
    store.put("t", spec, keys[:3], kv[:3], ttl_s=4.0)
    clock.advance(2.0)
    store.put("t", spec, keys[:6], kv, ttl_s=4.0)  # extends the first three to t+6
    clock.advance(3.0)  # past the first deadline, not the extended one
    assert store.expire() == 0
    assert store.lookup("t", spec, keys).num_blocks == 6
    clock.advance(1.0)
    assert store.expire() == 6
    assert store.lookup("t", spec, keys).num_blocks == 0


def test_spliced_keys_are_never_served(open_store, spec):
    """Keys that are not one chain (spliced from two prompts): get() checks every link, so it
    serves only the real prefix, whatever the probing lookup says."""
    store = open_store(spec, hbm_blocks=8)
    a = store.block_keys("t", spec, tokens(4, spec))
    b = store.block_keys("t", spec, tokens(4, spec, start=500))
    kv = make_kv(spec, 4)
    store.put("t", spec, a, kv)
    store.put("t", spec, b, kv)
    spliced = [a[0], b[1], a[2], a[3]]
    assert store.get("t", spec, spliced).shape[0] == 1
    assert store.lookup("t", spec, spliced).num_blocks >= 1


def test_lookup_still_rejects_malformed_keys(open_store, spec):
    store = open_store(spec)
    keys = store.block_keys("t", spec, tokens(3, spec))
    with pytest.raises(InvalidArgument):
        store.lookup("t", spec, [keys[0], b"short", keys[2]])
    with pytest.raises(InvalidArgument):
        PackedKeys(b"x" * (KEY_BYTES + 1))
    assert store.lookup("t", spec, [bytearray(k) for k in keys]).num_blocks == 0


def test_packed_keys_read_back_each_key():
    keys = [bytes([i]) * KEY_BYTES for i in range(5)]
    pk = PackedKeys(b"".join(keys))
    assert len(pk) == 5 and list(pk) == keys and pk[-1] == keys[-1] and pk[1:3] == keys[1:3]
    assert pk[:] == keys and pk[::2] == keys[::2]  # keys[0] ends in NUL bytes: the fast split keeps them
    with pytest.raises(IndexError):
        pk[5]


# -- DeadlineHeap --------------------------------------------------------------------------------
def _meta(i: int, deadline: float | None) -> BlockMeta:
    return BlockMeta(key=i.to_bytes(KEY_BYTES, "big"), tenant="t", fingerprint=b"f", parent=ROOT_KEY,
                     depth=0, nbytes=1, tokens=1, tier=Tier.HBM, created=0.0, last_access=0.0,
                     ttl_deadline=deadline)


heap_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 30), st.one_of(st.none(), st.floats(0, 50))),
    st.tuples(st.just("extend"), st.integers(0, 30), st.one_of(st.none(), st.floats(0, 50))),
    st.tuples(st.just("remove"), st.integers(0, 30)),
    st.tuples(st.just("due"), st.floats(0, 60)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(heap_op, max_size=80))
def test_deadline_heap_reports_exactly_the_expired(ops):
    """Against a scan: ``PrefixIndex.expired(now)`` returns exactly the indexed blocks with
    ``now >= deadline`` (each once, as the caller removes them), with deadlines that only move
    later, blocks removed and re-added under the same key, and time moving forward."""
    index = PrefixIndex()
    now = 0.0
    for o in ops:
        if o[0] == "add":
            if index.get("t", _meta(o[1], None).key) is None:
                index.add(_meta(o[1], o[2]))
        elif o[0] == "extend":
            m = index.get("t", _meta(o[1], None).key)
            if m is not None and m.ttl_deadline is not None:
                m.ttl_deadline = None if o[2] is None else max(m.ttl_deadline, o[2])
        elif o[0] == "remove":
            m = index.get("t", _meta(o[1], None).key)
            if m is not None:
                index.remove(m)
        else:
            now = max(now, o[1])
            want = {m.key for m in index if m.ttl_deadline is not None and now >= m.ttl_deadline}
            got = index.expired(now)
            assert sorted(m.key for m in got) == sorted(want)
            for m in got:
                index.remove(m)


def test_deadline_heap_stays_bounded_by_the_index():
    heap = DeadlineHeap()
    live = [_meta(i, 10.0) for i in range(10)]
    for m in live:
        heap.push(m, live=len(live))
    for _ in range(5000):  # blocks come and go: their entries go stale
        heap.push(_meta(99, 20.0), live=len(live))
    assert heap.needs_rebuild
    heap.rebuild(live)
    assert len(heap) == 10 and not heap.needs_rebuild
    assert sorted(m.key for m in heap.due(10.0, lambda m: True)) == sorted(m.key for m in live)
    assert len(heap) == 0
