"""VictimQueue: one ranking per make-room loop picks, at every step, a block the policy ranks
first among the tier's candidates at that moment (what re-ranking the whole tier before each
victim, the Store's behaviour before the queue, would pick, up to ties)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block import BlockMeta, Tier
from kvstore.index import PrefixIndex
from kvstore.victims import VictimQueue
from policy.base import make_policy


def _forest(parents: list[int], ages: list[float], tiers: list[int], pinned: set[int]) -> PrefixIndex:
    """Block i's parent is block ``parents[i]`` (< i) or the root (−1)."""
    index = PrefixIndex()
    for i, (p, age, t) in enumerate(zip(parents, ages, tiers)):
        parent_tier = Tier.HBM if p < 0 else index.get("t", b"%d" % p).tier
        tier = Tier(max(t, parent_tier))  # tier order along every path
        index.add(BlockMeta(key=b"%d" % i, tenant="t", fingerprint=b"f", parent=b"" if p < 0 else b"%d" % p,
                            depth=0 if p < 0 else index.get("t", b"%d" % p).depth + 1, nbytes=64, tokens=4,
                            tier=tier, created=0.0, last_access=age, access_count=1,
                            pins=1 if i in pinned else 0))
    return index


def _indexed(forest: tuple, name: str) -> tuple[PrefixIndex, object]:
    """The forest's index, and policy ``name`` told of its blocks oldest first."""
    raw_parents, ages, tiers, pinned = forest
    parents = [p if p < i else -1 for i, p in enumerate(raw_parents)]
    index = _forest(parents, ages, tiers, pinned)
    policy = make_policy(name)
    for m in sorted(index, key=lambda m: m.last_access):
        policy.on_insert(m, m.last_access)
    return index, policy


forests = st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.lists(st.integers(-1, n), min_size=n, max_size=n),
    st.lists(st.floats(0, 100), min_size=n, max_size=n),
    st.lists(st.integers(0, 2), min_size=n, max_size=n),
    st.sets(st.integers(0, n - 1), max_size=3)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests, st.sampled_from(["lru", "cost"]), st.sampled_from([Tier.HBM, Tier.DRAM, Tier.NVME]))
def test_each_victim_is_the_policys_first_choice_among_the_candidates_then(forest, name, tier):
    """Evicting from one queue until it is empty: every victim has the smallest key of the
    tier's candidates at that moment (what re-ranking the tier would pick, up to ties), and
    every block that became evictable on the way (a parent left without children) went too."""
    index, policy = _indexed(forest, name)
    queue = VictimQueue(policy, tier, lambda: index.candidates(tier, set()),
                        lambda m: index.is_candidate(m, tier, set()), 100.0)
    evicted = 0
    while (victim := queue.pop()) is not None:
        best = min(policy.evict_key(m, tier, 100.0) for m in index.candidates(tier, set()))
        assert policy.evict_key(victim, tier, 100.0) == best
        index.remove(victim)
        policy.on_remove(victim)
        queue.evicted(index.get("t", victim.parent) if victim.parent else None)
        evicted += 1
    assert not index.candidates(tier, set())  # nothing evictable is left behind
    assert evicted > 0 or not any(m.tier == tier and not m.pins for m in index if not m.children)


def test_a_non_keyed_policy_is_ranked_again_after_each_victim():
    class Reverse:  # no evict_key: ranks by key, largest first
        name = "reverse"
        calls = 0

        def rank(self, tier, candidates, now):
            Reverse.calls += 1
            return sorted(candidates, key=lambda m: m.key, reverse=True)

    index = _forest([-1, -1, -1], [1.0, 2.0, 3.0], [0, 0, 0], set())
    queue = VictimQueue(Reverse(), Tier.HBM, lambda: index.candidates(Tier.HBM, set()),
                        lambda m: index.is_candidate(m, Tier.HBM, set()), 0.0)
    first = queue.pop()
    assert first.key == b"2"
    assert queue.pop().key == b"1"  # the same ranking while the first one stays
    index.remove(first)
    queue.evicted(None)
    assert queue.pop().key == b"1" and Reverse.calls == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(forests, st.sampled_from(["lru", "cost", "gdsf"]), st.lists(st.integers(-2, 2), min_size=40, max_size=40))
def test_with_tenant_priorities_each_victim_has_the_lowest_priority_then(forest, name, prio_of):
    """A tenant priority (here, one per block) comes before the policy's order: every victim
    has the lowest priority among the candidates at that moment, and among those the policy's
    first choice."""
    index, policy = _indexed(forest, name)
    prio = lambda m: prio_of[int(m.key)]
    tier = Tier.HBM
    queue = VictimQueue(policy, tier, lambda: index.candidates(tier, set()),
                        lambda m: index.is_candidate(m, tier, set()), 100.0, prio)
    while (victim := queue.pop()) is not None:
        cands = index.candidates(tier, set())
        low = min(prio(m) for m in cands)
        assert prio(victim) == low
        if hasattr(policy, "evict_key"):
            assert policy.evict_key(victim, tier, 100.0) == min(
                policy.evict_key(m, tier, 100.0) for m in cands if prio(m) == low)
        index.remove(victim)
        policy.on_remove(victim)
        queue.evicted(index.get("t", victim.parent) if victim.parent else None)
    assert not index.candidates(tier, set())
