"""Property tests of the placement policies and the replay's cache model (hypothesis).

* ``rank`` returns a permutation of a subset of its candidates and changes nothing; a keyed
  policy's ``rank`` is exactly the order of its ``evict_key``.
* ``demote_to`` answers one of the tiers offered, or None.
* Replaying random prefix-tree traces through every policy never evicts a pinned block, never
  breaks the tier order along a path, and never exceeds a capacity.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block import BlockMeta, Tier
from kvstore.replay import ReplayConfig, make_replay_policy, replay_spec, run_replay
from kvstore.workloads import TraceRequest
from policy.base import make_policy
from policy.registry import KeyedPolicy, OraclePolicy

POLICIES = ["lru", "gdsf", "cost", "belady"]
SPEC = replay_spec(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=4, num_params=1000,
                   hidden_size=8)
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

metas = st.lists(
    st.builds(
        lambda i, depth, tokens, t, la, ac, ch, paused: BlockMeta(
            key=i.to_bytes(4, "big"), tenant="t", fingerprint=SPEC.fingerprint, parent=b"",
            depth=depth, nbytes=SPEC.block_nbytes, tokens=tokens, tier=Tier(t), created=0.0,
            last_access=la, access_count=ac, children=ch, paused=paused),
        st.integers(0, 10_000), st.integers(0, 50), st.integers(1, 4), st.integers(0, 2),
        st.floats(0, 1000), st.integers(1, 6), st.integers(0, 3), st.integers(0, 1)),
    max_size=25, unique_by=lambda m: m.key)


def _policy(name: str):
    pol = make_policy(name, lambda fp: SPEC if fp == SPEC.fingerprint else None)
    if isinstance(pol, OraclePolicy):
        pol.bind_oracle(lambda key: float(int.from_bytes(key, "big") % 7) or float("inf"))
    return pol


@SETTINGS
@given(name=st.sampled_from(POLICIES), cands=metas, tier=st.sampled_from(list(Tier)[:3]),
       now=st.floats(1000, 2000))
def test_rank_is_a_permutation_of_a_subset_and_changes_nothing(name, cands, tier, now):
    pol = _policy(name)
    for m in cands:
        pol.on_insert(m, m.last_access)
    before = [dataclasses.asdict(m) for m in cands]
    ranked = pol.rank(tier, list(cands), now)
    assert len({id(m) for m in ranked}) == len(ranked)
    assert {id(m) for m in ranked} <= {id(m) for m in cands}
    assert [dataclasses.asdict(m) for m in cands] == before
    if isinstance(pol, KeyedPolicy):
        keys = [pol.evict_key(m, tier, now) for m in ranked]
        assert keys == sorted(keys)
        assert len(ranked) == len(cands)


@SETTINGS
@given(name=st.sampled_from(POLICIES), cands=metas.filter(bool), src=st.integers(0, 2),
       now=st.floats(1000, 2000))
def test_demote_to_answers_an_offered_tier_or_none(name, cands, src, now):
    pol = _policy(name)
    available = [Tier(t) for t in range(src + 1, 3)]
    for m in cands:
        pol.on_insert(m, m.last_access)
        dest = pol.demote_to(m, Tier(src), available, now)
        assert dest is None or dest in available
        assert isinstance(pol.admit(m, Tier.NVME, now), bool)


class Watchdog:
    """Wraps a policy (without its fast path) and checks what the replay offers it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.ranked = 0

    def bind_oracle(self, next_use) -> None:
        if isinstance(self.inner, OraclePolicy):
            self.inner.bind_oracle(next_use)

    def on_insert(self, meta, now):
        self.inner.on_insert(meta, now)

    def on_access(self, meta, now):
        self.inner.on_access(meta, now)

    def on_remove(self, meta):
        assert meta.pins == 0, "a pinned block was removed"
        self.inner.on_remove(meta)

    def rank(self, tier, candidates, now):
        assert all(m.pins == 0 and m.tier == tier for m in candidates)
        self.ranked += 1
        return self.inner.rank(tier, candidates, now)

    def demote_to(self, meta, src, available, now):
        assert meta.pins == 0, "a pinned block was chosen as a victim"
        return self.inner.demote_to(meta, src, available, now)

    def admit(self, meta, tier, now):
        return self.inner.admit(meta, tier, now)


@st.composite
def traces(draw):
    """Requests along random paths of a random prefix tree (some with a partial tail)."""
    paths: list[tuple[int, ...]] = []
    out = []
    fresh = 0
    for i in range(draw(st.integers(1, 30))):
        base = paths[draw(st.integers(0, len(paths) - 1))] if paths else ()
        keep = draw(st.integers(0, len(base)))
        new = draw(st.integers(0 if keep else 1, 4))
        ids = base[:keep] + tuple(range(fresh, fresh + new))
        fresh += new
        paths.append(ids)
        tail = draw(st.integers(1, 4))
        out.append(TraceRequest(timestamp_ms=1000.0 * i, input_length=4 * (len(ids) - 1) + tail,
                                output_length=1, hash_ids=ids))
    return out


@SETTINGS
@given(name=st.sampled_from(POLICIES), trace=traces(), hbm=st.integers(1, 6),
       dram=st.integers(0, 6), nvme=st.integers(0, 10), watched=st.booleans())
def test_replay_keeps_pins_tier_order_and_capacities(name, trace, hbm, dram, nvme, watched):
    cfg = ReplayConfig(hbm_blocks=hbm, dram_blocks=dram, nvme_blocks=nvme, spec=SPEC)
    pol = make_replay_policy(name, cfg)
    if watched:
        pol = Watchdog(pol)
    # check_invariants asserts after every request: usage <= capacity in every tier, every
    # resident block's parent resident in the same or a faster tier, and no pin left over.
    result = run_replay(trace, cfg, pol, check_invariants=True)
    assert result.requests == len(trace)
    hits = sum(result.block_hits_by_tier.values())
    assert hits + result.refused_inserts <= result.total_blocks
    assert 0.0 <= result.net_saved_time_fraction <= 1.0


def test_a_request_longer_than_hbm_is_served_without_evicting_its_own_blocks():
    cfg = ReplayConfig(hbm_blocks=2, dram_blocks=0, nvme_blocks=0, spec=SPEC)
    trace = [TraceRequest(0.0, 16, 1, (1, 2, 3, 4))]
    pol = Watchdog(copy.deepcopy(make_replay_policy("lru", cfg)))
    result = run_replay(trace, cfg, pol, check_invariants=True)
    assert result.refused_inserts == 2  # blocks 3 and 4: HBM is full of pinned 1 and 2
    assert result.evictions_by_tier["hbm"] == 0


# -- reuse estimate --------------------------------------------------------------------------

def _block(key: bytes, count: int = 1, tokens: int = 4, paused: int = 0) -> BlockMeta:
    return BlockMeta(key=key, tenant="t", fingerprint=SPEC.fingerprint, parent=b"", depth=0,
                     nbytes=SPEC.block_nbytes, tokens=tokens, tier=Tier.HBM, created=0.0,
                     last_access=0.0, access_count=count, paused=paused)


def test_reuse_estimate_learns_that_blocks_read_twice_come_back():
    from policy.reuse import ReuseEstimator

    est = ReuseEstimator()
    now = 0.0
    for i in range(200):  # blocks read once are never read again ...
        est.on_insert(_block(b"once%d" % i), now)
    for i in range(200):  # ... blocks read twice are read a third time, 10 s later
        m = _block(b"hot%d" % i)
        est.on_insert(m, now)
        m.access_count = 2
        est.on_access(m, now + 1.0)
        m.access_count = 3
        est.on_access(m, now + 11.0)
    # class "read once": 400 episodes, 200 successes (the hot blocks' first reads)
    p_once = est.probability(_block(b"new"))
    p_twice = est.probability(_block(b"x", count=2))
    assert p_once == pytest.approx(0.5, abs=0.01)
    assert p_twice > 0.99
    assert est.mean_gap(_block(b"x", count=2)) == pytest.approx(10.0, rel=0.1)
    # the later it gets without a read, the less likely one comes
    soon = lambda age: math.prod(est.after_idle(_block(b"x", count=2), age, 20.0))
    assert soon(0.0) > soon(60.0)


def test_reuse_estimate_notices_removed_blocks_that_come_back():
    from policy.reuse import ReuseConfig, ReuseEstimator

    no_history = ReuseConfig(ghost_frequency=False)
    est, gone = ReuseEstimator(no_history), ReuseEstimator(no_history)
    for i in range(100):
        for e in (est, gone):
            m = _block(b"k%d" % i)
            e.on_insert(m, 0.0)
            e.on_remove(m)
        est.on_insert(_block(b"k%d" % i), 5.0)  # came back: its first episode succeeded
        gone.on_insert(_block(b"other%d" % i), 5.0)
    # 200 episodes each (100 still open); 100 successes vs none
    assert est.probability(_block(b"fresh")) == pytest.approx(101 / 202)
    assert gone.probability(_block(b"fresh")) == pytest.approx(1 / 202)


def test_a_block_that_comes_back_keeps_its_earlier_reads():
    """Ghost history (the default): a returning block is classed as read twice, so the
    first-read class holds only first reads (100 episodes, all succeeded)."""
    from policy.reuse import ReuseEstimator

    est = ReuseEstimator()
    for i in range(100):
        m = _block(b"k%d" % i)
        est.on_insert(m, 0.0)
        est.on_remove(m)
        est.on_insert(_block(b"k%d" % i), 5.0)
    assert est.probability(_block(b"fresh")) == pytest.approx(101 / 102)
    back = _block(b"k0")
    assert est.klass(back) == est.klass(_block(b"other", count=2))
    assert est.probability(back) == pytest.approx(1 / 102)  # 100 open episodes, none done
    est.on_remove(back)  # removed again: its ghost remembers both reads
    est.on_insert(back, 9.0)
    assert est.klass(back) == est.klass(_block(b"other", count=3))
    est.on_remove(_block(b"k1"))  # a resident block removed forgets nothing else
    assert est.klass(_block(b"k2")) == est.klass(_block(b"other", count=2))


def _chain_block(key: bytes, parent: bytes) -> BlockMeta:
    m = _block(key)
    m.parent = parent
    return m


def test_reuse_estimate_tells_new_prompts_from_tails_after_a_cached_prefix():
    """Runs of inserts from a root (new prompts) come back; runs that extend an already
    cached block (unique tails after a shared prefix) never do: the estimator learns both."""
    from policy.reuse import ReuseConfig, ReuseEstimator

    def feed(est: ReuseEstimator) -> None:
        est.on_insert(_chain_block(b"shared", b""), 0.0)
        for i in range(100):
            t = float(i)
            prompt = [_chain_block(b"p%d-0" % i, b""), _chain_block(b"p%d-1" % i, b"p%d-0" % i)]
            for m in prompt:
                est.on_insert(m, t)
            tail = [_chain_block(b"u%d-0" % i, b"shared"), _chain_block(b"u%d-1" % i, b"u%d-0" % i)]
            for m in tail:
                est.on_insert(m, t)
            for m in prompt:  # the prompt is read again; the tail never is
                m.access_count = 2
                est.on_access(m, t + 0.5)

    # the coarse classes alone (the request lift, capped at 0.95, is tested on its own)
    est = ReuseEstimator(ReuseConfig(request_features=False))
    flat = ReuseEstimator(ReuseConfig(extends_feature=False, request_features=False))
    feed(est)
    feed(flat)
    new_prompt = _chain_block(b"q-0", b"")
    est.on_insert(new_prompt, 200.0)
    tail = _chain_block(b"v-0", b"shared")
    est.on_insert(tail, 200.0)
    tail2 = _chain_block(b"v-1", b"v-0")  # continues the run: inherits "extends"
    est.on_insert(tail2, 200.0)
    assert est.probability(new_prompt) > 0.95
    assert est.probability(tail) < 0.05
    assert est.probability(tail2) == est.probability(tail)
    f = _chain_block(b"q", b"")
    flat.on_insert(f, 200.0)
    assert flat.probability(f) == pytest.approx(0.5, abs=0.01)  # one class for both


def test_within_is_the_share_of_observed_gaps_below_the_horizon():
    """Gaps of 1 s (x30) and 100 s (x10): P(gap <= 10 s) = (30 + prior) / (40 + 1) where the
    prior is the exponential of the class's mean gap."""
    import math

    from policy.reuse import ReuseEstimator

    est = ReuseEstimator()
    for i, gap in enumerate([1.0] * 30 + [100.0] * 10):
        m = _block(b"k%d" % i)
        est.on_insert(m, 1000.0 * i)
        m.access_count = 2
        est.on_access(m, 1000.0 * i + gap)
    probe = _block(b"p")
    mean = est.mean_gap(probe)
    assert mean == pytest.approx((30 + 1000 + (30 + 1000) / 40) / 41)
    prior = -math.expm1(-10.0 / mean)
    assert est.within(probe, 10.0) == pytest.approx((30 + prior) / 41)
    assert est.within(probe, math.inf) == 1.0
    assert est.within(probe, 0.0) == pytest.approx(0.0)
    assert est.within(probe, 0.5) < est.within(probe, 10.0) < est.within(probe, 1e4)


def test_paused_sessions_and_tenant_hints_raise_the_estimate():
    from policy.reuse import ReuseEstimator

    est = ReuseEstimator()
    for i in range(100):
        est.on_insert(_block(b"k%d" % i), 0.0)
    base = est.probability(_block(b"a"))
    assert est.probability(_block(b"a", paused=1)) > base
    est.set_tenant_hint("t", 0.95)
    assert est.probability(_block(b"a")) == pytest.approx(0.95)
    est.set_tenant_hint("t", None)
    assert est.probability(_block(b"a")) == pytest.approx(base)


@SETTINGS
@given(st.lists(st.floats(0.0, 1e4), min_size=0, max_size=40), st.lists(st.floats(0.0, 1e5), min_size=2, max_size=6),
       st.floats(0.0, 1e4))
def test_after_idle_is_a_probability_that_never_rises_with_idle_time(gaps, ages, horizon):
    """Whatever gaps a class has seen: P(read again | idle) lies in [0, p] and does not rise
    as the block stays idle longer; P(within the horizon | read again) lies in [0, 1]."""
    from policy.reuse import ReuseEstimator

    est = ReuseEstimator()
    for i, gap in enumerate(gaps):
        m = BlockMeta(key=i.to_bytes(4, "big"), tenant="t", fingerprint=SPEC.fingerprint, parent=b"",
                      depth=0, nbytes=SPEC.block_nbytes, tokens=4, tier=Tier.HBM, created=0.0,
                      last_access=0.0, access_count=1)
        est.on_insert(m, 1e6 * i)
        m.access_count = 2
        est.on_access(m, 1e6 * i + gap)
    probe = BlockMeta(key=b"probe", tenant="t", fingerprint=SPEC.fingerprint, parent=b"", depth=0,
                      nbytes=SPEC.block_nbytes, tokens=4, tier=Tier.HBM, created=0.0,
                      last_access=0.0, access_count=1)
    p = est.probability(probe)
    last = p
    for age in sorted(ages):
        alive, soon = est.after_idle(probe, age, horizon)
        assert 0.0 <= alive <= p * (1 + 1e-9)
        assert alive <= last * (1 + 1e-9)
        assert 0.0 <= soon <= 1.0
        last = alive
