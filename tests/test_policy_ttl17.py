"""The cost policy counts only the reads that come before a block's TTL deadline; the trace
replay can give blocks a TTL (``ReplayConfig.ttl_s``, ``bench/replay_bench.py --ttl-s``).

It valued a block that expires in one second as one with a day left: of two blocks otherwise
alike, eviction kept whichever it happened to meet second, and a victim that would expire
long before its class is read again was still written to DRAM, NVMe or the remote tier.
Now the reuse estimate is the probability of a read *before* the deadline (the class's own
gap histogram), an expired block is worth 0 and is never written below, and a block without
a deadline is valued exactly as before (the golden keys below were taken from the code
before this change).
"""

from __future__ import annotations

import itertools
import math

import pytest
from conftest import make_kv, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block import BlockMeta, Tier
from kvstore.errors import InvalidArgument
from kvstore.replay import ReplayConfig, make_replay_policy, run_replay
from kvstore.spec import ModelSpec
from kvstore.workloads import TraceRequest
from policy.cost import CostPolicy, CostPolicyConfig

SPEC = ModelSpec(model="llama-3-8b", revision="0", num_layers=32, num_kv_heads=8, head_dim=128,
                 dtype="float16", block_tokens=16, num_params=8_000_000_000, hidden_size=4096)


def _lookup(fp: bytes) -> ModelSpec | None:
    return SPEC if fp == SPEC.fingerprint else None


def _meta(key: bytes, depth: int = 0, *, at: float = 0.0, deadline: float | None = None,
          tokens: int = 16) -> BlockMeta:
    return BlockMeta(key=key, tenant="t", fingerprint=SPEC.fingerprint, parent=b"", depth=depth,
                     nbytes=SPEC.block_nbytes, tokens=tokens, tier=Tier.HBM, created=at,
                     last_access=at, access_count=1, ttl_deadline=deadline)


def _history(pol: CostPolicy, gaps: tuple[float, ...] = (1.0, 30.0, 300.0), rounds: int = 20) -> float:
    """Blocks stored and read back once after each of ``gaps`` (one class); the clock after."""
    t = 0.0
    for gap in gaps:
        for i in range(rounds):
            m = _meta(b"h%d-%g" % (i, gap), at=t)
            pol.on_insert(m, t)
            m.access_count, m.last_access = 2, t + gap
            pol.on_access(m, t + gap)
            t += 1000.0
    return t


# -- ordering -------------------------------------------------------------------------------

def test_of_two_blocks_alike_the_one_expiring_sooner_is_evicted_first():
    """Before: equal keys, and the sort kept the candidates' order (the day-long block first)."""
    pol = CostPolicy(_lookup)
    now = _history(pol)
    day = _meta(b"day", at=now, deadline=now + 86_400.0)
    soon = _meta(b"soon", at=now, deadline=now + 1.0)
    for m in (day, soon):
        pol.on_insert(m, now)
    assert pol.rank(Tier.HBM, [day, soon], now + 0.5) == [soon, day]
    assert pol.evict_key(soon, Tier.HBM, now + 0.5) < pol.evict_key(day, Tier.HBM, now + 0.5)


def test_an_expired_block_is_worth_nothing_and_goes_before_any_live_one():
    pol = CostPolicy(_lookup)
    now = _history(pol)
    gone = _meta(b"gone", at=now - 10.0, deadline=now)  # now >= deadline: expired
    cold = _meta(b"cold", depth=0, at=now - 10.0, tokens=1)  # the cheapest live block there is
    assert pol.value(gone, Tier.HBM, now=now) == 0.0
    assert pol.reuse.probability(gone, now=now) == 0.0
    assert pol.value(cold, Tier.HBM, now=now) > 0.0
    pol.on_insert(gone, now)
    pol.on_insert(cold, now)
    assert pol.rank(Tier.HBM, [cold, gone], now)[0] is gone


def test_a_victim_that_expires_before_its_class_comes_back_is_not_written_below():
    """Every block of its class was read back after 300 s; one with 5 s left is dropped from
    HBM (and refused by NVMe, as the remote tier would refuse it) where one without a deadline
    is demoted. Before, both went to DRAM."""
    pol = CostPolicy(_lookup)
    now = _history(pol, gaps=(300.0,))
    short = _meta(b"short", at=now, deadline=now + 5.0)
    kept = _meta(b"kept", at=now)
    for m in (short, kept):
        pol.on_insert(m, now)
    later = now + 1.0
    assert pol.demote_to(kept, Tier.HBM, [Tier.DRAM, Tier.NVME], later) == Tier.DRAM
    assert pol.demote_to(short, Tier.HBM, [Tier.DRAM, Tier.NVME], later) is None
    assert not pol.admit(short, Tier.NVME, later)
    assert pol.admit(kept, Tier.NVME, later)


def test_an_expired_block_is_never_written_below_even_with_children_or_an_nvme_copy():
    pol = CostPolicy(_lookup)
    now = _history(pol)
    m = _meta(b"gone", at=now - 1.0, deadline=now)
    m.children, m.persisted = 2, True
    pol.on_insert(m, now - 1.0)
    assert pol.demote_to(m, Tier.HBM, [Tier.DRAM, Tier.NVME], now) is None
    live = _meta(b"live", at=now - 1.0, deadline=now + 0.5)  # expires before reads come, but
    live.children = 2  # dropping it would strand its children: demoted as before
    pol.on_insert(live, now - 1.0)
    assert pol.demote_to(live, Tier.HBM, [Tier.DRAM], now) == Tier.DRAM


def test_expiry_aware_off_values_the_deadline_as_absent():
    pol = CostPolicy(_lookup, CostPolicyConfig(expiry_aware=False))
    now = _history(pol)
    soon = _meta(b"soon", at=now, deadline=now + 1.0)
    none = _meta(b"none", at=now)
    assert pol.value(soon, Tier.DRAM, now=now) == pol.value(none, Tier.DRAM, now=now)


# -- a block without a deadline: exactly the keys of the code before ------------------------

def _no_ttl_keys(valuation: str) -> list[str]:
    """Keys (float.hex) a scripted run gives blocks without a deadline, through the protocol
    only (the same calls ran on the code before this change)."""
    pol = CostPolicy(_lookup, CostPolicyConfig(valuation=valuation))
    now = _history(pol)
    probes = [_meta(b"p%d" % i, depth=i, at=now + i, tokens=16 if i % 3 else 5) for i in range(6)]
    for m in probes:
        pol.on_insert(m, m.last_access)
    for m in probes[::2]:
        m.access_count, m.last_access = 2, now + 20.0
        pol.on_access(m, now + 20.0)
    out = [pol.evict_key(m, Tier.HBM, now + 30.0)[0].hex() for m in probes]
    for m in pol.rank(Tier.HBM, probes, now + 40.0)[:4]:  # demote four, after idling
        dest = pol.demote_to(m, Tier.HBM, [Tier.DRAM, Tier.NVME], now + 400.0)
        out.append(str(dest))
        if dest is not None:
            m.tier = dest
            out.append(pol.evict_key(m, dest, now + 400.0)[0].hex())
        out.append(str(pol.admit(m, Tier.REMOTE, now + 400.0)))
    return out


GOLDEN = {
    "horizon": [
        '0x1.5fd7fe1796494p-36', '0x1.a1d07dbc0276ep-31', '0x1.656db4eb4356dp-41',
        '0x1.4e73ce3271f64p-35', '0x1.656db4eb4356dp-41', '0x1.a1d07dbc0276ep-31', '1',
        '0x1.dbbacf0540ab7p-42', 'False', '1', '0x1.dbbacf0540ab7p-42', 'False', '1',
        '0x1.44267eee0693ep-38', 'False', '1', '0x1.c118257106067p-40', 'False',
    ],
    "reads": [
        '0x1.5fd7fe1796494p-36', '0x1.a1d07dbc0276ep-31', '0x1.656db4eb4356dp-41',
        '0x1.4e73ce3271f64p-35', '0x1.656db4eb4356dp-41', '0x1.a1d07dbc0276ep-31', '1',
        '0x1.656db4eb4356ap-39', 'False', '1', '0x1.656db4eb4356ap-39', 'False', '1',
        '0x1.e715f6e5734a2p-36', 'False', '1', '0x1.d04383d92578ep-35', 'False',
    ],
    "rate": [
        '0x1.1b6a3ec0393b0p-43', '0x1.8ebb71aa72762p-42', '0x1.a91f5e2055d8bp-48',
        '0x1.5c8bef254b1e6p-42', '0x1.a91f5e2055d8bp-48', '0x1.8ebb71aa72762p-42', '1',
        '0x1.a91f5e2055d87p-46', 'False', '1', '0x1.a91f5e2055d87p-46', 'False', '1',
        '0x1.885ab9d63520fp-43', 'False', '1', '0x1.e3d4121a4d366p-42', 'False',
    ],
}


def test_blocks_without_a_deadline_keep_their_exact_keys():
    for valuation, keys in GOLDEN.items():
        assert _no_ttl_keys(valuation) == keys, valuation


# -- properties ----------------------------------------------------------------------------

_gaps = st.lists(st.floats(min_value=0.0, max_value=5_000.0, allow_nan=False), min_size=0, max_size=6)


@settings(max_examples=60, deadline=None)
@given(gaps=_gaps, lefts=st.lists(st.floats(min_value=-100.0, max_value=1e6, allow_nan=False),
                                  min_size=2, max_size=6),
       age=st.floats(min_value=0.0, max_value=2_000.0), accessed=st.integers(1, 20),
       valuation=st.sampled_from(["horizon", "reads", "rate"]), tokens=st.sampled_from([1, 16]))
def test_value_is_monotone_in_the_time_left_never_negative_and_0_once_expired(
        gaps, lefts, age, accessed, valuation, tokens):
    pol = CostPolicy(_lookup, CostPolicyConfig(valuation=valuation))
    now = _history(pol, gaps=tuple(gaps), rounds=3) + 10_000.0
    victim = _meta(b"v", at=now - 1.0)  # gives the tiers a horizon
    pol.on_insert(victim, now - 1.0)
    pol.demote_to(victim, Tier.HBM, [Tier.DRAM], now)
    m = _meta(b"m", depth=3, at=now - age, tokens=tokens)
    m.access_count = accessed
    checks = []
    for left in sorted(lefts):
        m.ttl_deadline = now + left
        row = [pol.value(m, t, now=now) for t in (Tier.HBM, Tier.DRAM, Tier.NVME)]
        row += [pol.idle_value(m, t, age, now) for t in (Tier.DRAM, Tier.NVME)]
        row.append(pol.reuse.probability(m, now=now))
        for v in row:
            assert v >= 0.0 and math.isfinite(v)
        if left <= 0.0:
            assert all(v == 0.0 for v in row)
            assert not pol.admit(m, Tier.DRAM, now) and not pol.admit(m, Tier.REMOTE, now)
        checks.append(row)
    for shorter, longer in itertools.pairwise(checks):
        assert all(a <= b for a, b in zip(shorter, longer, strict=True)), (shorter, longer)
    m.ttl_deadline = None  # no deadline: the value with the clock is the value without
    assert pol.value(m, Tier.DRAM, now=now) == pol.value(m, Tier.DRAM)


# -- the trace replay's TTL (ReplayConfig.ttl_s) --------------------------------------------

def _replay(trace, policy: str, ttl_s: float | None, hbm: int = 4, dram: int = 0):
    cfg = ReplayConfig(hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=0, ttl_s=ttl_s)
    return run_replay(trace, cfg, make_replay_policy(policy, cfg), check_invariants=True)


def _req(t: float, *ids: int) -> TraceRequest:
    return TraceRequest(timestamp_ms=1000.0 * t, input_length=512 * len(ids), output_length=1,
                        hash_ids=ids)


def test_the_replay_expires_blocks_at_their_deadline_with_their_subtree():
    """Blocks stored at 0 s with a 3 s TTL are gone at 5 s (a miss, counted as expired, not
    evicted); a block stored again gets a new deadline; no TTL: as before."""
    trace = [_req(0, 1, 2), _req(5, 1, 2, 3), _req(6, 1, 2, 3)]
    for policy in ("lru", "cost"):
        none = _replay(trace, policy, None)
        assert none.expired_blocks == 0 and none.block_hits_by_tier["hbm"] == 2 + 3
        short = _replay(trace, policy, 3.0)
        assert short.expired_blocks == 2  # block 1 and, under it, block 2
        assert short.block_hits_by_tier["hbm"] == 3  # the third request: stored again at 5 s
        assert sum(short.evictions_by_tier.values()) == 0
        assert _replay(trace, policy, 10.0).block_hits_by_tier["hbm"] == 2 + 3


def test_the_replay_refuses_a_ttl_that_is_not_a_finite_positive_number():
    for bad in (0, -1.0, math.inf, math.nan):
        with pytest.raises(InvalidArgument, match="ttl_s"):
            ReplayConfig(hbm_blocks=1, dram_blocks=0, nvme_blocks=0, ttl_s=bad)


# -- the Store: its clock reaches the policy ------------------------------------------------

def test_a_full_store_drops_the_block_that_expires_sooner(open_store, spec, clock):
    """HBM of two blocks and nothing below: of two prompts alike, stored at the same time, the
    one with 0.5 s left is dropped for a third, not the one with 999 s (before: the older)."""
    s = open_store(spec, hbm_blocks=2, dram_blocks=0, nvme_blocks=0, high_watermark=1.0,
                   low_watermark=1.0)
    long = s.block_keys("a", spec, tokens(1, spec))
    short = s.block_keys("a", spec, tokens(1, spec, start=100))
    third = s.block_keys("a", spec, tokens(1, spec, start=200))
    s.put("a", spec, long, make_kv(spec, 1), ttl_s=1000.0)
    s.put("a", spec, short, make_kv(spec, 1), ttl_s=1.5)
    clock.advance(1.0)
    s.put("a", spec, third, make_kv(spec, 1), ttl_s=1000.0)
    assert s.lookup("a", spec, long).num_blocks == 1
    assert s.lookup("a", spec, short).num_blocks == 0
