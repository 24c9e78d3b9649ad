"""Put-run features of the reuse estimate and the cost policy's deferred stamp (issue 3),
against hand-computed values."""

from __future__ import annotations

import pytest

from kvstore.block import BlockMeta, Tier
from kvstore.errors import InvalidArgument
from kvstore.replay import replay_spec
from policy.cost import CostPolicy, CostPolicyConfig
from policy.reuse import ReuseConfig, ReuseEstimator, run_buckets

SPEC = replay_spec(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=4, num_params=1000,
                   hidden_size=8)


def _meta(key: bytes, parent: bytes = b"", depth: int = 0) -> BlockMeta:
    return BlockMeta(key=key, tenant="t", fingerprint=SPEC.fingerprint, parent=parent,
                     depth=depth, nbytes=SPEC.block_nbytes, tokens=4, tier=Tier.HBM,
                     created=0.0, last_access=0.0, access_count=1)


def _run(est, keys: list[bytes], now: float = 0.0) -> list[BlockMeta]:
    """Insert one put run: a chain from a root."""
    out, parent = [], b""
    for i, k in enumerate(keys):
        m = _meta(k, parent, i)
        est.on_insert(m, now)
        out.append(m)
        parent = k
    return out


def _read(est, m: BlockMeta, now: float) -> None:
    m.access_count += 1  # what the Store does before telling the policy
    m.last_access = now
    est.on_access(m, now)


@pytest.mark.parametrize("length,from_end,buckets", [
    (1, 0, (0, 0)), (3, 2, (1, 2)), (4, 1, (2, 1)), (5, 3, (2, 2)), (8, 4, (3, 3)),
    (200, 150, (7, 3)),
])
def test_run_buckets(length, from_end, buckets):
    assert run_buckets(length, from_end) == buckets


def test_run_length_refines_p_with_the_coarse_class_as_prior():
    """Run [a, b, c] (length 3, bucket 1) then run [d] (length 1, bucket 0); a and b are read.
    Coarse first-read class: 4 trials, 2 hits -> p = 3/6 = 0.5. Fine, length bucket 1:
    3 trials, 2 hits -> (2 + 2 * 0.5) / (3 + 2) = 0.6; bucket 0: 1 trial, 0 hits ->
    (0 + 2 * 0.5) / (1 + 2) = 1/3."""
    est = ReuseEstimator(ReuseConfig(run_length_feature=True, run_position_feature=False))
    a, b, c = _run(est, [b"a", b"b", b"c"])
    (d,) = _run(est, [b"d"])
    _read(est, a, 1.0)
    _read(est, b, 1.0)
    assert est.class_probability(est.klass(c)) == pytest.approx(0.5)
    assert est.probability(c) == pytest.approx(0.6)
    assert est.probability(d) == pytest.approx(1.0 / 3.0)


def test_run_position_counts_blocks_under_their_final_position():
    """Run [a, b, c] closed by run [d]; only c (the run's last block) is read. At insert a was
    the last block so far; closing the run moves it to position 2 from the end. Coarse:
    4 trials, 1 hit -> 2/6 = 1/3. Position 0 (c and d): 2 trials, 1 hit ->
    (1 + 2/3) / 4 = 5/12; position 2 (a) and 1 (b): 1 trial, 0 hits -> (2/3) / 3 = 2/9."""
    est = ReuseEstimator(ReuseConfig(run_position_feature=True))
    a, b, c = _run(est, [b"a", b"b", b"c"])
    (d,) = _run(est, [b"d"])
    _read(est, c, 1.0)
    assert est.probability(d) == pytest.approx(5.0 / 12.0)
    assert est.probability(a) == pytest.approx(2.0 / 9.0)
    assert est.probability(b) == pytest.approx(2.0 / 9.0)


def test_a_returning_block_credits_the_fine_class_it_left_with():
    """Run [a, b] (bucket 1) then [x] (bucket 0) closes it; a is removed and comes back in a
    run of one. The ghost's success goes to bucket 1: its 2 trials, 1 hit, coarse 3 (a, b, x)
    + 1 (a again) trials, 1 hit -> p = 2/6; bucket 1: (1 + 2/3) / 4 = 5/12."""
    est = ReuseEstimator(ReuseConfig(run_length_feature=True, run_position_feature=False,
                                     ghost_frequency=False))
    a, b = _run(est, [b"a", b"b"])
    _run(est, [b"x"])
    est.on_remove(a)
    back = _meta(b"a")
    est.on_insert(back, 2.0)
    assert est.class_probability(est.klass(b)) == pytest.approx(2.0 / 6.0)
    assert est.probability(b) == pytest.approx(5.0 / 12.0)


def test_run_features_off_leave_p_unchanged():
    est = ReuseEstimator(ReuseConfig(run_position_feature=False))
    a, b, _ = _run(est, [b"a", b"b", b"c"])
    _read(est, a, 1.0)
    # 3 trials, 1 hit -> 2/5 for the first-read class
    assert est.probability(b) == pytest.approx(2.0 / 5.0)
    assert est.fine_class(b, est.klass(b)) == -1


def test_run_features_and_deferral_are_opt_in():
    assert not ReuseConfig().run_position_feature and not ReuseConfig().run_length_feature
    assert not CostPolicyConfig().deferred_stamp


def test_position_buckets_of_a_run():
    est = ReuseEstimator(ReuseConfig(run_position_feature=True))
    a, b, c = _run(est, [b"a", b"b", b"c"])
    (d,) = _run(est, [b"d"])
    k = est.klass(a)
    assert [est.fine_class(m, k) for m in (a, b, c, d)] == [
        k * 32 + 2, k * 32 + 1, k * 32, k * 32]  # 8 length x 4 position buckets per class
    assert est.fine_class(_meta(b"unknown"), k) == -1


def test_run_prior_is_checked():
    with pytest.raises(InvalidArgument):
        ReuseConfig(run_prior=0.0)


def test_deferred_stamp_values_a_run_when_first_ranked_then_keeps_the_key():
    """With the deferred stamp, a's key is its level at insert (0) plus its value once the run
    is complete (position 2 from the end; at its insert it was the last block), and stays put
    while other blocks come and go."""
    cfg = CostPolicyConfig(reuse=ReuseConfig(run_position_feature=True), deferred_stamp=True)
    pol = CostPolicy(lambda fp: SPEC if fp == SPEC.fingerprint else None, cfg)
    a, b, _ = _run(pol, [b"a", b"b", b"c"])
    assert pol.reuse.fine_class(a, pol.reuse.klass(a)) % 4 == 2
    key = pol.evict_key(a, Tier.HBM, 0.0)
    assert key == (pytest.approx(pol.value(a, Tier.HBM)), 0)
    _run(pol, [b"x", b"y"])
    _read(pol, b, 1.0)
    assert pol.evict_key(a, Tier.HBM, 2.0) == key


def test_without_deferral_the_key_is_stamped_at_insert():
    """At a's insert its run had length 1: p = (0 + 2 * 1/4) / (2 + 2) = 1/8 (fine bucket 0:
    z and a; coarse 2 trials -> 1/4). Once b and c are in, a's run has length 3: bucket 1
    holds b and c, coarse 4 trials -> 1/6, p = (0 + 2/6) / 4 = 1/12. The key keeps 1/8."""
    cfg = CostPolicyConfig(reuse=ReuseConfig(run_length_feature=True, run_position_feature=False),
                           deferred_stamp=False)
    pol = CostPolicy(lambda fp: SPEC if fp == SPEC.fingerprint else None, cfg)
    _run(pol, [b"z"])
    a = _meta(b"a")
    pol.on_insert(a, 0.0)
    assert pol.reuse.probability(a) == pytest.approx(1.0 / 8.0)
    at_insert = pol.value(a, Tier.HBM)
    b = _meta(b"b", b"a", 1)
    pol.on_insert(b, 0.0)
    pol.on_insert(_meta(b"c", b"b", 2), 0.0)
    assert pol.reuse.probability(a) == pytest.approx(1.0 / 12.0)
    assert pol.evict_key(a, Tier.HBM, 0.0)[0] == pytest.approx(at_insert)
    assert pol.value(a, Tier.HBM) < at_insert
