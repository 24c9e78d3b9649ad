"""Operators' figures that counted the wrong things.

* ``session list`` / ``session close`` counted a read lease (a Get streaming a session's blocks)
  as another session's pin: a session alone on its blocks said none of them were its alone, and
  a close said they "stay pinned by other sessions".
* The per-tier-pair migration counters missed moves: a demotion into NVMe of a block that had an
  NVMe copy already was in ``demotions`` only (the downward ``moved_*`` summed to less), and the
  NVMe copies written of a block's ancestors (and by a flush) were in no ``bytes_*_to_nvme``.
  ``moved_X_to_Y`` counts blocks whose tier changed from X to Y; ``bytes_X_to_Y`` the bytes
  written into Y copied from X, once per write (a move onto an NVMe copy writes none).
"""

from __future__ import annotations

import itertools
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from conftest import MASTER, FakeClock, make_kv, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block import Tier
from kvstore.config import StoreConfig
from kvstore.errors import ResourceExhausted
from kvstore.spec import ModelSpec
from kvstore.store import Store


def test_a_read_lease_is_not_counted_as_another_sessions_pin(open_store, spec):
    s = open_store(spec, hbm_blocks=8, dram_blocks=8, nvme_blocks=64)
    s.open_session("a", "s1")
    keys = s.block_keys("a", spec, tokens(3, spec))
    s.put("a", spec, keys, make_kv(spec, 3), session="s1")
    assert s.session_info("a", "s1").only_pinned_blocks == 3

    def stage(_i: int) -> np.ndarray:
        return np.empty(spec.block_nbytes, np.uint8)

    with s.lease_prefix("a", spec, keys, stage) as lease:  # a Get of the blocks in progress
        assert len(lease.views) == 3
        info = s.session_info("a", "s1")
        assert (info.pinned_blocks, info.only_pinned_blocks, info.only_pinned_bytes) == (3, 3, 3 * spec.block_nbytes)
        closed = s.end_session("a", "s1")
        assert (closed.pinned_blocks, closed.only_pinned_blocks) == (3, 3)


def test_only_the_sessions_that_pin_a_block_count_as_its_other_pinners(open_store, spec):
    """A paused session that holds a block does not pin it; an active one does."""
    s = open_store(spec, hbm_blocks=8, dram_blocks=8, nvme_blocks=64)
    keys = s.block_keys("a", spec, tokens(3, spec))
    for sid in ("s1", "s2", "s3"):
        s.open_session("a", sid)
    s.put("a", spec, keys, make_kv(spec, 3), session="s1")
    s.put("a", spec, keys[:2], make_kv(spec, 2), session="s2")
    s.put("a", spec, keys[:1], make_kv(spec, 1), session="s3")
    s.pause_session("a", "s2")
    assert s.session_info("a", "s1").only_pinned_blocks == 2  # the first block: s3 pins it too
    assert s.session_info("a", "s3").only_pinned_blocks == 0
    assert s.session_info("a", "s2").only_pinned_blocks == 0  # paused: it pins nothing


ORDER = [Tier.HBM, Tier.DRAM, Tier.NVME]
PAIRS = [(a, b) for a, b in itertools.permutations(ORDER, 2)]


def _observed(s: Store) -> tuple[Counter, Counter]:
    """Counters filled as the store runs: blocks whose tier changed (from, to), as the index
    sees them, and bytes written into a tier copied from another (a write of a block the index
    holds in another tier), as the tiers see them."""
    moves: Counter = Counter()
    written: Counter = Counter()
    set_tier = s._index.set_tier

    def traced_set_tier(meta, tier):
        moves[(meta.tier, tier)] += 1
        return set_tier(meta, tier)

    s._index.set_tier = traced_set_tier

    def copied(tier, ref):
        m = s._index.get(ref.tenant, ref.key)
        if m is not None and m.tier != tier:  # else a new block put (or its own tier's bytes)
            written[(m.tier, tier)] += ref.nbytes

    put_record = s._nvme.put_record

    def traced_put_record(ref, *a, **kw):
        ok = put_record(ref, *a, **kw)
        if ok:
            copied(Tier.NVME, ref)
        return ok

    s._nvme.put_record = traced_put_record
    for tier, mem in s._mem.items():
        def traced_reserve(ref, _reserve=mem.reserve, _tier=tier):
            ok = _reserve(ref)
            if ok:
                copied(_tier, ref)
            return ok

        mem.reserve = traced_reserve
    return moves, written


def _check_counters(s: Store, moves: Counter, written: Counter) -> None:
    st_ = s.stats()
    c = st_["counters"]
    for a, b in PAIRS:
        assert c.get(f"moved_{a.label}_to_{b.label}", 0) == moves[(a, b)], (a, b)
        assert c.get(f"bytes_{a.label}_to_{b.label}", 0) == written[(a, b)], (a, b)
    assert st_["demotions"] == sum(c.get(f"moved_{a.label}_to_{b.label}", 0) for a, b in PAIRS if a < b)
    assert st_["promotions"] == sum(c.get(f"moved_{a.label}_to_{b.label}", 0) for a, b in PAIRS if a > b)


def test_demotions_onto_an_nvme_copy_and_ancestor_copies_are_counted_per_tier_pair(spec):
    """The prober's case: HBM and DRAM of 2 blocks, 4 puts of 3 blocks."""
    with tempfile.TemporaryDirectory() as d:
        s = _store(spec, Path(d))
        moves, written = _observed(s)
        for i in range(4):
            s.put("a", spec, s.block_keys("a", spec, tokens(3, spec, 1000 * i)), make_kv(spec, 3))
        c = s.stats()["counters"]
        assert c["moved_dram_to_nvme"] == moves[(Tier.DRAM, Tier.NVME)] == 9  # it was 3
        into_nvme = sum(v for k, v in c.items() if k.startswith("bytes_") and k.endswith("_to_nvme"))
        assert into_nvme == 9 * spec.block_nbytes  # it was 3 blocks' bytes
        _check_counters(s, moves, written)
        s.close()


def _store(spec, path: Path) -> Store:
    n = spec.block_nbytes
    return Store.open(StoreConfig(path=path / "st", hbm_bytes=2 * n, dram_bytes=2 * n, nvme_bytes=32 * n,
                                  master_key=MASTER), clock=FakeClock())


OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.integers(0, 3), st.integers(1, 4)),
    st.tuples(st.just("get"), st.integers(0, 3), st.integers(1, 4)),
    st.tuples(st.just("session_put"), st.integers(0, 3), st.integers(1, 2)),
    st.tuples(st.just("pause"), st.just(0), st.just(0)),
    st.tuples(st.just("resume"), st.just(0), st.just(0)),
    st.tuples(st.just("flush"), st.just(0), st.just(0)),
), min_size=1, max_size=25)


@settings(max_examples=40, deadline=None)
@given(ops=OPS)
def test_migration_counters_match_the_moves_and_writes_seen(ops):
    """Over random puts (chains sharing prefixes), gets (promotions), session puts, pauses
    (demotions to DRAM), resumes and flushes: moved_X_to_Y is the blocks whose tier changed
    from X to Y, bytes_X_to_Y the bytes written into Y copied from X; the downward moves sum to
    ``demotions``, the upward to ``promotions``."""
    spec = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype="float16", block_tokens=4)  # the spec fixture's (hypothesis: no fixture)
    with tempfile.TemporaryDirectory() as d:
        s = _store(spec, Path(d))
        moves, written = _observed(s)
        s.open_session("a", "s")
        for op, chain, n in ops:
            keys = s.block_keys("a", spec, tokens(n, spec, 1000 * chain))
            try:
                if op == "put":
                    s.put("a", spec, keys, make_kv(spec, n, seed=chain))
                elif op == "get":
                    s.get("a", spec, keys)
                elif op == "session_put":
                    s.open_session("a", "s")  # resumes it when paused
                    s.put("a", spec, keys, make_kv(spec, n, seed=chain), session="s")
                elif op == "pause":
                    s.pause_session("a", "s")
                elif op == "resume":
                    s.resume_session("a", "s")
                else:
                    s.flush()
            except ResourceExhausted:
                pass  # HBM full of the session's pinned blocks
            _check_counters(s, moves, written)
        s.close()


def test_the_migration_gauges_say_what_they_count():
    from prometheus_client import CollectorRegistry, generate_latest

    from kvstore.metrics import StoreCollector

    registry = CollectorRegistry()
    registry.register(StoreCollector(lambda: {"counters": {"moved_dram_to_nvme": 2, "bytes_hbm_to_nvme": 512,
                                                           "flushed": 1}}))
    text = generate_latest(registry).decode()
    assert "# HELP kvstore_store_counters_moved_dram_to_nvme Blocks whose tier changed from dram to nvme" in text
    assert "# HELP kvstore_store_counters_bytes_hbm_to_nvme Bytes written into nvme copied from a block in hbm" in text
    assert "# HELP kvstore_store_counters_flushed Store statistic kvstore_store_counters_flushed" in text
