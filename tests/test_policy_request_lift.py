"""Request features of the reuse estimate (policy/request_lift.py) and the cost policy's deferred
valuation (issue 3), against hand-computed values, plus invariants of the hazard table."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.block import BlockMeta, Tier
from kvstore.errors import InvalidArgument
from kvstore.replay import replay_spec
from policy.cost import CostPolicy, CostPolicyConfig
from policy.request_lift import HazardTable, RequestCell, RequestTracker
from policy.reuse import ReuseConfig, ReuseEstimator

SPEC = replay_spec(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=4, num_params=1000,
                   hidden_size=8)


def _meta(key: bytes, parent: bytes = b"", depth: int = 0) -> BlockMeta:
    return BlockMeta(key=key, tenant="t", fingerprint=SPEC.fingerprint, parent=parent,
                     depth=depth, nbytes=SPEC.block_nbytes, tokens=4, tier=Tier.HBM,
                     created=0.0, last_access=0.0, access_count=1)


def _chain(keys: list[bytes]) -> list[BlockMeta]:
    out, parent = [], b""
    for i, k in enumerate(keys):
        out.append(_meta(k, parent, i))
        parent = k
    return out


def _insert(est, metas: list[BlockMeta], now: float = 0.0) -> list[BlockMeta]:
    for m in metas:
        est.on_insert(m, now)
    return metas


def _read(est, m: BlockMeta, now: float) -> None:
    m.access_count += 1  # what the Store does before telling the policy
    m.last_access = now
    est.on_access(m, now)


# -- requests ---------------------------------------------------------------------------------

def test_a_request_is_a_chain_of_notifications_and_ends_at_the_next_root():
    tr = RequestTracker()
    a, b, c = _chain([b"a", b"b", b"c"])
    assert tr.track(a) == {} and tr.track(b) == {}
    assert tr.cell(b"a") == RequestCell(2, 1)  # as it stands: 2 blocks so far
    assert tr.track(c) == {}
    done = tr.track(_meta(b"z"))  # a root: a new request
    assert done == {b"a": RequestCell(3, 2), b"b": RequestCell(3, 1), b"c": RequestCell(3, 0)}
    assert tr.cell(b"a") is None and tr.cell(b"z") == RequestCell(1, 0)


def test_a_read_prefix_and_the_blocks_stored_after_it_are_one_request():
    """The engine reads a, b (cached) and stores x after b: one request of 3 blocks. A block
    whose parent is not the previous notification (y under a) starts another."""
    tr = RequestTracker()
    a, b = _chain([b"a", b"b"])
    for m in (a, b, _meta(b"x", b"b", 2)):
        tr.track(m)
    done = tr.track(_meta(b"y", b"a", 1))
    assert done[b"x"] == RequestCell(3, 0) and done[b"a"] == RequestCell(3, 2)
    assert tr.close() == {b"y": RequestCell(2, 0)}  # its length is its depth + 1


def test_a_stored_prefix_touched_after_its_new_blocks_takes_their_length():
    """Notifications x, y (under b, outside the request) then a, b: the prefix a, b ending at
    x's parent is the same prompt, 4 blocks long. Only the very next request is matched."""
    tr = RequestTracker()
    x, y = _meta(b"x", b"b", 2), _meta(b"y", b"x", 3)
    a, b = _chain([b"a", b"b"])
    for m in (x, y, a, b):
        tr.track(m)
    assert tr.cell(b"a") == RequestCell(4, 3)
    assert tr.track(_meta(b"z")) == {b"a": RequestCell(4, 3), b"b": RequestCell(4, 2)}
    tr.track(_meta(b"b2", b"z", 1))  # a request ending elsewhere, then the prefix again
    assert tr.track(_meta(b"q")) == {b"z": RequestCell(2, 1), b"b2": RequestCell(2, 0)}
    for m in (a, b):
        tr.track(m)
    assert tr.close() == {b"a": RequestCell(2, 1), b"b": RequestCell(2, 0)}


@pytest.mark.parametrize("cell,index", [
    (RequestCell(1, 0), 0), (RequestCell(3, 2), 7), (RequestCell(8, 10), 19),
    (RequestCell(2000, 0), 45), (RequestCell(4, 3), 2 * 5 + 3),
])
def test_request_cell_index(cell, index):
    """log2 bucket of the length (1, 2-3, 4-7, ..., 512+) x position from the end (0..3, 4+)."""
    assert cell.index() == index


# -- hazard table -----------------------------------------------------------------------------

def test_hazard_counts_open_episodes_for_the_time_watched():
    """Edges 2 s, 8 s (widths 2, 6), one coarse class. Episodes A and B start at 0; A is read
    at 1 s; at 3 s B has spent 2 s in bin 0 and 1 s in bin 1, still open (not a failure).
    Level "all": bin 0: 1 read / (1 + 2) s, prior 1 width at 0.05/2 per s:
      (1 + 2 * 0.025) / (3 + 2) = 0.21; bin 1: (0 + 6 * 0.05/6) / (1 + 6) = 0.05 / 7.
    Coarse class, prior 4 widths at those rates: bin 0: (1 + 8 * 0.21) / (3 + 8);
      bin 1: (0 + 24 * 0.05/7) / (1 + 24).  P = 1 - exp(-(2 r0 + 6 r1))."""
    t = HazardTable(1, 1, edges=(2.0, 8.0))
    t.start(b"A", 0)
    t.start(b"B", 0)
    t.advance(1.0)
    t.read(b"A")
    t.advance(3.0)
    r0, r1 = (1 + 8 * 0.21) / 11, (24 * 0.05 / 7) / 25
    rates = t.coarse_rates(0)
    assert rates == [pytest.approx(r0), pytest.approx(r1)]
    assert t.probability(rates) == pytest.approx(1 - math.exp(-(2 * r0 + 6 * r1)))


def test_an_episode_older_than_the_last_edge_is_over_and_a_late_read_is_not_counted():
    t = HazardTable(1, 1, edges=(2.0, 8.0))
    t.start(b"A", 0)
    t.advance(9.0)
    t.read(b"A")
    # A failed: 2 s in bin 0 and 6 s in bin 1, no read; bin 0 of "all": (0 + 2 * 0.025) / (2 + 2)
    top = 0.05 / 4
    assert t.coarse_rates(0)[0] == pytest.approx((0 + 8 * top) / (2 + 8))
    assert t._reads[1] == [0.0, 0.0]
    assert t.advance(8.0) == 9.0  # a late notification counts at the latest time seen


def test_a_request_cell_joins_the_fine_level_from_the_bin_it_is_in():
    """Cell rates start at the coarse rates (prior) and move towards what the cell saw."""
    t = HazardTable(1, 2, edges=(2.0, 8.0))
    for k in (b"r1", b"r2", b"n1", b"n2"):
        t.start(k, 0)
    t.set_cell(b"r1", 0)
    t.set_cell(b"r2", 0)
    t.set_cell(b"n1", 1)
    t.set_cell(b"n2", 1)
    t.set_cell(b"n2", 0)  # an episode's cell is set once
    t.advance(1.0)
    t.read(b"r1")
    t.read(b"r2")
    t.advance(7.0)
    p_read = t.probability(t.fine_rates(0, 0, 8.0))
    p_not = t.probability(t.fine_rates(0, 1, 8.0))
    p_coarse = t.probability(t.coarse_rates(0))
    assert p_not < p_coarse < p_read


def test_the_table_watches_at_most_max_watched_episodes_oldest_dropped_first():
    """Cap 3, five episodes started 1 s apart: the two oldest stop being watched when the 4th
    and 5th start. Their time so far counts (censored), their later reads do not."""
    t = HazardTable(1, 1, edges=(100.0,), max_watched=3)
    for i, k in enumerate((b"a", b"b", b"c", b"d", b"e")):
        t.advance(float(i))
        t.start(k, 0)
    assert t._queued == 3 and set(t._episodes) == {b"c", b"d", b"e"}
    t.read(b"a")  # no longer watched: not a read
    t.read(b"c")
    assert t._reads[1] == [1.0]
    # exposure: a stopped at 3 s (3 s), b at 4 s (3 s); c read at 4 s (2 s) -> 8 s completed
    assert t._exposure[1] == [pytest.approx(8.0)]
    with pytest.raises(InvalidArgument):
        HazardTable(1, 1, max_watched=0)
    with pytest.raises(InvalidArgument):
        ReuseConfig(lift_episodes=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "read", "cell", "advance"]),
                          st.integers(0, 5), st.floats(-5.0, 50.0)), max_size=60))
def test_hazard_table_invariants(ops):
    """Whatever the order of notifications, the clock included (it may step back): nothing
    negative, rates positive, P in (0, 1)."""
    t = HazardTable(2, 3, edges=(2.0, 8.0, 32.0), max_watched=4)
    now = 0.0
    for op, k, dt in ops:
        key = bytes([k])
        if op == "advance":
            now += dt
            t.advance(now)
        elif op == "start":
            t.read(key)
            t.start(key, k % 2)
        elif op == "read":
            t.read(key)
        else:
            t.set_cell(key, k % 3)
    t.advance(now)
    assert t._queued == sum(len(q) for q in t._queues) <= 4
    assert sum(t._inside[0]) == len(t._episodes)
    for table in (t._inside, t._exposure, t._reads):
        assert all(x >= -1e-9 for row in table for x in row)
    for c in range(2):
        for cell in range(3):
            rates = t.fine_rates(c, cell, 8.0)
            assert all(r > 0 for r in rates)
            assert 0.0 < t.probability(rates) < 1.0


# -- the estimate -----------------------------------------------------------------------------

def test_probability_is_the_class_p_times_the_request_lift_capped():
    est = ReuseEstimator()
    a, b, c = _insert(est, _chain([b"a", b"b", b"c"]))
    (d,) = _insert(est, _chain([b"d"]))
    _read(est, a, 1.0)
    _read(est, b, 1.0)
    lift = est._lift
    assert lift is not None
    for m in (c, d):
        k = est.klass(m)
        want = min(0.95, est.class_probability(k) * lift.lift(m.key, k))
        assert est.probability(m) == pytest.approx(want)
    assert lift.cell(b"c") == RequestCell(3, 0).index()
    assert lift.lift(b"unknown", 0) is None


def test_a_block_that_comes_back_after_removal_counts_as_read():
    est = ReuseEstimator()
    (a,) = _insert(est, _chain([b"a"]))
    est.on_remove(a)
    est.on_insert(_meta(b"a"), 1.0)
    table = est._lift.table
    assert sum(table._reads[0]) == 1.0  # the ghost's episode succeeded at 1 s


def test_request_features_off_leave_the_class_p():
    est = ReuseEstimator(ReuseConfig(request_features=False))
    a, b, _ = _insert(est, _chain([b"a", b"b", b"c"]))
    _read(est, a, 1.0)
    # 3 trials, 1 hit -> 2/5 for the first-read class
    assert est.probability(b) == pytest.approx(2.0 / 5.0)


def test_request_features_and_deferral_are_the_defaults_and_checked():
    assert ReuseConfig().request_features and CostPolicyConfig().deferred_stamp
    with pytest.raises(InvalidArgument):
        ReuseConfig(request_prior=0.0)
    with pytest.raises(InvalidArgument):
        ReuseConfig(lift_cap=1.0)


def test_lift_learns_which_position_comes_back():
    """Ten requests of 3 blocks whose first two blocks are read again 5 s later and whose last
    block never is: after them, a new request's last block is valued below its first."""
    est = ReuseEstimator()
    now = 0.0
    for i in range(10):
        ms = _insert(est, _chain([b"%d-%d" % (i, j) for j in range(3)]), now)
        for m in ms[:2]:
            _read(est, m, now + 5.0)
        now += 10.0
    a, _, c = _insert(est, _chain([b"n0", b"n1", b"n2"]), now)
    _insert(est, _chain([b"next"]), now)  # completes the request
    assert est.probability(c) < est.probability(a)


# -- deferred valuation -----------------------------------------------------------------------

def _policy(deferred: bool) -> CostPolicy:
    return CostPolicy(lambda fp: SPEC if fp == SPEC.fingerprint else None,
                      CostPolicyConfig(deferred_stamp=deferred))


def test_a_read_block_is_valued_when_first_ranked_then_keeps_its_key():
    pol = _policy(True)
    a, b, _ = _insert(pol, _chain([b"a", b"b", b"c"]))
    _read(pol, a, 1.0)
    assert b"a" in pol._pending
    key = pol.evict_key(a, Tier.HBM, 1.0)
    assert key == (pytest.approx(pol._level[Tier.HBM] + pol.value(a, Tier.HBM)), 0)
    _insert(pol, _chain([b"x", b"y"]), 2.0)
    _read(pol, b, 3.0)
    assert pol.evict_key(a, Tier.HBM, 4.0) == key


def test_without_deferral_a_read_is_stamped_at_once():
    pol = _policy(False)
    (a,) = _insert(pol, _chain([b"a"]))
    _read(pol, a, 1.0)
    assert b"a" not in pol._pending
    stamped = pol.evict_key(a, Tier.HBM, 1.0)[0]
    _insert(pol, _chain([b"x", b"y", b"z"]), 2.0)  # changes what the estimate knows
    assert pol.evict_key(a, Tier.HBM, 2.0)[0] == pytest.approx(stamped)
