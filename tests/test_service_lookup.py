"""Lookup as the service runs it: Store.lookup's one-pass prefix walk (a hit proves its key, the
keys after the prefix are validated), and the packed tier codes of the wire format."""

from __future__ import annotations

import pytest
from conftest import make_kv, tokens
from hypothesis import given
from hypothesis import strategies as st

from kvstore.block import Tier
from kvstore.errors import InvalidArgument
from kvstore.service_convert import tier_codes, tier_names

T = "tenant-a"
LABELS = [t.label for t in Tier]


@given(st.lists(st.sampled_from(LABELS), max_size=40))
def test_tier_codes_round_trip_in_any_order(names):
    codes = tier_codes(names)
    assert len(codes) == len(names) and tier_names(codes) == names


@given(st.lists(st.tuples(st.sampled_from(LABELS), st.integers(1, 300)), max_size=4))
def test_tier_codes_round_trip_in_runs(runs):
    names = [name for name, count in runs for _ in range(count)]
    assert tier_names(tier_codes(names)) == names
    assert tier_codes(tuple(names)) == tier_codes(names)


def test_unknown_tier_codes_decode_to_empty_names():
    assert tier_names(bytes([1, 9, 0, 2])) == ["hbm", "", "", "dram"]
    assert tier_names(bytes([9, 9])) == ["", ""]


def test_lookup_reports_each_tier_of_a_prefix_spread_over_tiers(open_store, spec):
    store = open_store(spec, hbm_blocks=2, dram_blocks=2, high_watermark=1.0, low_watermark=1.0)
    keys = store.block_keys(T, spec, tokens(6, spec))
    store.put(T, spec, keys, make_kv(spec, 6))
    assert store.lookup(T, spec, keys).tiers == ["hbm", "hbm", "dram", "dram", "nvme", "nvme"]
    assert store.lookup(T, spec, keys[:2]).tiers == ["hbm", "hbm"]


def test_lookup_validates_the_keys_past_the_prefix(open_store, spec):
    store = open_store(spec)
    keys = store.block_keys(T, spec, tokens(3, spec))
    store.put(T, spec, keys[:2], make_kv(spec, 2))
    for bad in (b"short", "x" * 32, 7, [1, 2]):
        with pytest.raises(InvalidArgument):
            store.lookup(T, spec, [*keys[:2], bad])
        with pytest.raises(InvalidArgument):
            store.lookup(T, spec, [keys[0], bad, keys[2]])
    with pytest.raises(InvalidArgument):
        store.lookup(T, spec, [*keys, bytearray(b"x" * 31)])


def test_lookup_accepts_any_sequence_of_bytes_like_keys(open_store, spec):
    store = open_store(spec)
    keys = store.block_keys(T, spec, tokens(3, spec))
    store.put(T, spec, keys, make_kv(spec, 3))
    assert store.lookup(T, spec, tuple(keys)).num_blocks == 3
    assert store.lookup(T, spec, iter(keys)).num_blocks == 3
    assert store.lookup(T, spec, [memoryview(k) for k in keys]).num_blocks == 3
    assert store.lookup(T, spec, [bytearray(k) for k in keys]).num_blocks == 3  # unhashable: checked first


def test_lookup_stops_at_an_expired_block_and_drops_it(open_store, spec, clock):
    store = open_store(spec)
    keys = store.block_keys(T, spec, tokens(3, spec))
    store.put(T, spec, keys[:1], make_kv(spec, 1))
    store.put(T, spec, keys[1:], make_kv(spec, 2), ttl_s=10, parent=keys[0])
    assert store.lookup(T, spec, keys).num_blocks == 3
    clock.advance(11)
    assert store.lookup(T, spec, keys).num_blocks == 1
    assert store.stats()["blocks"] == 1  # the expired block went, and its child with it


def test_lookup_never_crosses_a_broken_chain_or_another_model(open_store, spec):
    from kvstore.spec import ModelSpec

    store = open_store(spec)
    keys = store.block_keys(T, spec, tokens(3, spec))
    store.put(T, spec, keys, make_kv(spec, 3))
    assert store.lookup(T, spec, [keys[0], keys[2]]).num_blocks == 1  # keys[2]'s parent is keys[1]
    assert store.lookup(T, spec, keys[1:]).num_blocks == 0  # keys[1] does not start a prefix
    assert store.lookup(T, spec, keys[1:], parent=keys[0]).num_blocks == 2
    other = ModelSpec(model="m2", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                      dtype="float16", block_tokens=4)
    assert store.lookup(T, other, keys).num_blocks == 0
    assert store.lookup("someone-else", spec, keys).num_blocks == 0
