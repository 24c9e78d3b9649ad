"""Cost model against hand-computed values (issue 3)."""

from __future__ import annotations

import pytest

from kvstore.block import BlockMeta, Tier
from kvstore.errors import InvalidArgument
from kvstore.spec import ModelSpec
from policy.cost import CostPolicy, CostPolicyConfig
from policy.cost_model import CostModel, CostModelConfig, CostModels

LLAMA = ModelSpec(model="llama-3-8b", revision="0", num_layers=32, num_kv_heads=8, head_dim=128,
                  dtype="float16", block_tokens=512, num_params=8_000_000_000, hidden_size=4096)


def test_block_bytes_of_the_replay_model():
    # 2 (K,V) x 32 layers x 8 heads x 512 tokens x 128 dims x 2 bytes
    assert LLAMA.block_nbytes == 67_108_864


def test_recompute_flops_at_depth_zero():
    # 2*8e9*512 + 4*32*4096*512*(0*512 + 256) = 8.192e12 + 6.8719476736e10
    assert CostModel(LLAMA).recompute_flops(512, 0) == pytest.approx(8.260719476736e12, rel=1e-12)


def test_recompute_flops_grow_with_depth():
    # attention part at block 3: 4*32*4096*512*(3*512 + 256) = 268435456 * 1792
    assert CostModel(LLAMA).recompute_flops(512, 3) == pytest.approx(
        8.192e12 + 268_435_456 * 1792, rel=1e-12)


def test_partial_block_flops():
    # n = 100 tokens at block 2: 2*8e9*100 + 4*32*4096*100*(1024 + 50)
    assert CostModel(LLAMA).recompute_flops(100, 2) == pytest.approx(
        1.6e12 + 4 * 32 * 4096 * 100 * 1074, rel=1e-12)


def test_recompute_seconds_at_400_tflops():
    assert CostModel(LLAMA).recompute_seconds(512, 0) == pytest.approx(8.260719476736e12 / 4e14)


@pytest.mark.parametrize("tier,seconds", [
    (Tier.HBM, 0.0), (Tier.DRAM, 67_108_864 / 25e9), (Tier.NVME, 67_108_864 / 5e9),
    (Tier.REMOTE, 67_108_864 / 1.25e9),
])
def test_restore_seconds_by_tier(tier, seconds):
    assert CostModel(LLAMA).restore_seconds(67_108_864, tier) == pytest.approx(seconds)


def test_saving_is_recompute_minus_restore_and_never_negative():
    model = CostModel(LLAMA)
    assert model.saving(512, 0, LLAMA.block_nbytes, Tier.NVME) == pytest.approx(
        8.260719476736e12 / 4e14 - 67_108_864 / 5e9)
    # one token is cheaper to recompute than 64 MiB is to read back from NVMe
    assert model.saving(1, 0, LLAMA.block_nbytes, Tier.NVME) == 0.0


def test_spec_sizes_win_over_config_fallbacks():
    spec = ModelSpec(model="m", revision="0", num_layers=2, num_kv_heads=1, head_dim=4,
                     block_tokens=8)  # num_params = hidden_size = 0: unknown
    cfg = CostModelConfig(num_params=1000, hidden_size=16, flops_per_s=1e3)
    model = CostModel(spec, cfg)
    # 2*1000*8 + 4*2*16*8*(1*8 + 4)
    assert model.recompute_flops(8, 1) == 16_000 + 4 * 2 * 16 * 8 * 12
    spec2 = ModelSpec(model="m", revision="0", num_layers=2, num_kv_heads=1, head_dim=4,
                      block_tokens=8, num_params=10, hidden_size=2)
    assert CostModel(spec2, cfg).recompute_flops(8, 0) == 2 * 10 * 8 + 4 * 2 * 2 * 8 * 4


@pytest.mark.parametrize("bad", [
    {"flops_per_s": 0}, {"flops_per_s": -1.0}, {"flops_per_s": 2e18}, {"dram_gbps": 0},
    {"nvme_gbps": -5}, {"remote_gbps": 1e5}, {"num_params": 0}, {"num_params": True},
    {"hidden_size": 1.5}, {"dram_gbps": "fast"},
])
def test_config_bounds_are_checked(bad):
    with pytest.raises(InvalidArgument):
        CostModelConfig(**bad)


def test_negative_tokens_or_depth_are_rejected():
    with pytest.raises(InvalidArgument):
        CostModel(LLAMA).recompute_flops(-1, 0)


def test_unknown_fingerprint_uses_the_fallback_spec():
    models = CostModels(lambda fp: None)
    model = models.get(b"x" * 16, 512)
    assert model.recompute_flops(512, 0) == pytest.approx(8.260719476736e12)
    known = CostModels(lambda fp: LLAMA if fp == LLAMA.fingerprint else None)
    assert known.get(LLAMA.fingerprint, 7).spec is LLAMA


def _meta(key: bytes, depth: int, tokens: int = 512) -> BlockMeta:
    return BlockMeta(key=key, tenant="t", fingerprint=LLAMA.fingerprint, parent=b"", depth=depth,
                     nbytes=LLAMA.block_nbytes, tokens=tokens, tier=Tier.HBM, created=0.0,
                     last_access=0.0, access_count=1)


def test_cost_policy_gain_per_tier_by_hand():
    pol = CostPolicy(lambda fp: LLAMA if fp == LLAMA.fingerprint else None)
    m = _meta(b"a", 0)
    rec = 8.260719476736e12 / 4e14
    dram, nvme = 67_108_864 / 25e9, 67_108_864 / 5e9
    assert pol.gain(m, Tier.HBM) == pytest.approx(dram)  # rec - (rec - dram)
    assert pol.gain(m, Tier.DRAM) == pytest.approx(nvme - dram)
    assert pol.gain(m, Tier.NVME) == pytest.approx(rec - nvme)


def test_deep_blocks_are_worth_keeping_longer_in_nvme():
    pol = CostPolicy(lambda fp: LLAMA if fp == LLAMA.fingerprint else None)
    shallow, deep = _meta(b"s", 0), _meta(b"d", 60)
    shallow.tier = deep.tier = Tier.NVME  # inserted there: stamped with NVMe's gain
    pol.on_insert(shallow, 0.0)
    pol.on_insert(deep, 0.0)
    assert pol.value(deep, Tier.NVME) > pol.value(shallow, Tier.NVME)
    assert pol.rank(Tier.NVME, [deep, shallow], 1.0) == [shallow, deep]


def _lookup(fp: bytes) -> ModelSpec | None:
    return LLAMA if fp == LLAMA.fingerprint else None


def test_reads_valuation_by_hand():
    """``reads``: value = p/(1-p) × gain / bytes; a fresh estimator's prior is p = 1/2."""
    pol = CostPolicy(_lookup, CostPolicyConfig(valuation="reads"))
    m = _meta(b"a", 0)
    assert pol.reuse.probability(m) == pytest.approx(0.5)
    assert pol.value(m, Tier.DRAM) == pytest.approx(1.0 * pol.gain(m, Tier.DRAM) / LLAMA.block_nbytes)


def test_rate_valuation_by_hand():
    """``rate``: value = p × gain / (bytes × mean_gap); with one observed gap of 10 s and no
    other history the class's mean gap is (10 + prior 10) / (1 + 1) = 10 s."""
    pol = CostPolicy(_lookup, CostPolicyConfig(valuation="rate"))
    m = _meta(b"a", 0)
    pol.on_insert(m, 0.0)
    m.access_count = 2
    pol.on_access(m, 10.0)  # the insert's episode succeeds after 10 s
    gap = pol.reuse.mean_gap(m)
    assert gap == pytest.approx(10.0)
    p = pol.reuse.probability(m)
    assert pol.value(m, Tier.NVME) == pytest.approx(p * pol.gain(m, Tier.NVME) / LLAMA.block_nbytes / gap)


def _read_back_twenty(pol: CostPolicy, slow_gap: float, period: float) -> None:
    """Twenty rounds, ``period`` s apart: a full block read back once after 1 s, a partial
    (100-token) one after ``slow_gap`` s; two classes with the same reuse probability."""
    for i in range(20):
        for tokens, gap in ((512, 1.0), (100, slow_gap)):
            m = _meta(b"%d-%d" % (tokens, i), 0, tokens=tokens)
            pol.on_insert(m, period * i)
            m.access_count = 2
            pol.on_access(m, period * i + gap)


def test_rate_valuation_prefers_blocks_read_back_sooner():
    """Two classes with the same reuse probability: the one read back sooner is worth more
    (fast class: read again after 1 s; slow class — partial blocks — after 100 s)."""
    pol = CostPolicy(_lookup, CostPolicyConfig(valuation="rate"))
    _read_back_twenty(pol, slow_gap=100.0, period=1000.0)
    fast, slow = _meta(b"f", 0), _meta(b"s", 0, tokens=100)
    assert pol.reuse.probability(fast) == pytest.approx(pol.reuse.probability(slow))
    # value / (gain per byte) = p / mean_gap: gaps (20 + 50.5) / 21 and (2000 + 50.5) / 21
    ratio = [pol.value(m, Tier.DRAM) * m.nbytes / pol.gain(m, Tier.DRAM) for m in (fast, slow)]
    assert ratio[0] / ratio[1] == pytest.approx(2050.5 / 70.5)


def test_horizon_valuation_by_hand():
    """Default ``horizon``: before a tier's first victim its horizon is infinite and the value
    is the ``reads`` value; then the horizon is the mean idle age of the tier's victims and the
    value is scaled by the share of the class's gaps within it."""
    import math

    pol = CostPolicy(_lookup)
    reads = CostPolicy(_lookup, CostPolicyConfig(valuation="reads"))
    m = _meta(b"a", 0)
    for p in (pol, reads):
        p.on_insert(m, 0.0)
        m.access_count = 2
        p.on_access(m, 10.0)  # one observed gap of 10 s
        m.access_count = 1
    assert math.isinf(pol.horizon(Tier.DRAM))
    assert pol.value(m, Tier.DRAM) == pytest.approx(reads.value(m, Tier.DRAM))
    for i, age in enumerate((2.0, 4.0)):  # two DRAM victims, idle 2 s and 4 s
        v = _meta(b"v%d" % i, 0)
        v.tier = Tier.DRAM
        v.last_access = 100.0 - age
        pol.on_insert(v, 90.0)
        pol.demote_to(v, Tier.DRAM, [], 100.0)
    assert pol.horizon(Tier.DRAM) == pytest.approx(3.0)
    assert math.isinf(pol.horizon(Tier.NVME))
    share = pol.reuse.within(m, 3.0)
    assert 0.0 < share < 1.0
    per_byte = pol.gain(m, Tier.DRAM) / LLAMA.block_nbytes
    assert pol.value(m, Tier.DRAM) == pytest.approx(pol.expected_reads(m) * per_byte * share)


def test_horizon_valuation_prefers_blocks_read_back_within_the_horizon():
    """Same reuse probability; one class comes back after 1 s, the other after 1000 s. With a
    10 s horizon the fast class is worth more; with no horizon yet they are worth the same."""
    pol = CostPolicy(_lookup)
    _read_back_twenty(pol, slow_gap=1000.0, period=10_000.0)
    fast, slow = _meta(b"f", 0), _meta(b"s", 0, tokens=100)
    per = [pol.value(m, Tier.HBM) * m.nbytes / pol.gain(m, Tier.HBM) for m in (fast, slow)]
    assert per[0] == pytest.approx(per[1])
    v = _meta(b"victim", 0)
    v.last_access = 1e6 - 10.0
    pol.on_insert(v, 1e6 - 10.0)
    pol.demote_to(v, Tier.HBM, [], 1e6)
    per = [pol.value(m, Tier.HBM) * m.nbytes / pol.gain(m, Tier.HBM) for m in (fast, slow)]
    assert per[0] > 10 * per[1]


def test_unknown_valuation_is_rejected():
    with pytest.raises(InvalidArgument, match="valuation"):
        CostPolicyConfig(valuation="bogus")


def test_a_persisted_block_keeps_its_nvme_copy_when_evicted():
    """Demoting a block whose NVMe copy is committed writes nothing: the policy never drops it
    from DRAM when NVMe is offered, however unlikely it is to come back."""
    pol = CostPolicy(_lookup, CostPolicyConfig(write_cost_weight=10.0))  # writes very dear
    m = _meta(b"p", 0, tokens=64)  # a small partial block: little to save on a hit
    m.tier = Tier.DRAM
    pol.on_insert(m, 0.0)
    assert pol.demote_to(m, Tier.DRAM, [Tier.NVME], 1.0) is None  # not worth a write
    m.persisted = True
    assert pol.demote_to(m, Tier.DRAM, [Tier.NVME], 1.0) == Tier.NVME
    assert pol.admit(m, Tier.NVME, 1.0)


def _read_back_after(pol: CostPolicy, *gaps: float, rounds: int = 30) -> None:
    """``rounds`` full blocks per gap in ``gaps``, each read back once that many seconds after
    it was stored (one class: stored, not yet read)."""
    for gap in gaps:
        for i in range(rounds):
            m = _meta(b"r%d-%g" % (i, gap), 0)
            pol.on_insert(m, 1000.0 * i)
            m.access_count = 2
            pol.on_access(m, 1000.0 * i + gap)


def test_after_idle_by_hand():
    """Bayes on the class's gap histogram. Gaps of 1 s and 300 s: a block idle for 100 s can
    only be one of the slow half, so its chance of a read drops from p to p·S / (p·S + 1 − p)
    with S = P(gap > 100 | read again) ≈ 1/2; idle for no time, nothing changes."""
    import math

    pol = CostPolicy(_lookup, CostPolicyConfig(demotion_aging=0.0))
    _read_back_after(pol, 1.0, 300.0)
    m = _meta(b"x", 0)  # stored, not yet read: the class that was read back
    est = pol.reuse
    p = est.probability(m)
    alive, soon = est.after_idle(m, 0.0, math.inf)
    assert (alive, soon) == (pytest.approx(p), 1.0)
    s = 1.0 - est.within(m, 100.0)
    assert s == pytest.approx(0.5, abs=0.02)
    alive, soon = est.after_idle(m, 100.0, 1000.0)
    assert alive == pytest.approx(p * s / (p * s + 1.0 - p))
    assert alive < p
    assert soon == pytest.approx((est.within(m, 1100.0) - est.within(m, 100.0)) / s)
    assert soon > 0.9  # the slow reads come at 300 s, inside (100, 1100]


def test_a_block_demoted_after_a_long_idle_time_is_worth_less():
    """``demotion_aging``: v · (v_idle / v)^β in the tier it is demoted to. β = 0 keeps the old key; β = 1
    is the full discount; the default 0.5 lies between (their geometric mean)."""
    keys = {}
    for beta in (0.0, 0.5, 1.0):
        pol = CostPolicy(_lookup, CostPolicyConfig(demotion_aging=beta))
        _read_back_after(pol, 1.0)
        keys[beta] = []
        for name, idle in ((b"fresh", 0.0), (b"stale", 100.0)):
            m = _meta(name, 0)
            m.tier = Tier.DRAM
            pol.on_insert(m, 50_000.0)
            m.last_access = 50_000.0 - idle
            assert pol.demote_to(m, Tier.DRAM, [Tier.NVME], 50_000.0) == Tier.NVME
            m.tier = Tier.NVME
            keys[beta].append(pol.evict_key(m, Tier.NVME, 50_000.0)[0])
            if beta == 0.0:
                assert keys[beta][-1] == pytest.approx(pol.value(m, Tier.NVME))  # level 0 so far
    for beta in (0.5, 1.0):
        assert keys[beta][0] == pytest.approx(keys[0.0][0])  # idle for no time: no discount
    assert keys[1.0][1] < keys[0.5][1] < keys[0.0][1]
    assert keys[0.5][1] == pytest.approx((keys[0.0][1] * keys[1.0][1]) ** 0.5)


def test_the_idle_discount_applies_to_every_demotion():
    """Into DRAM as into NVMe: a block idle for 100 s (every read of its class came after 1 s)
    is keyed below the value of a block just read, and at exactly ``idle_value``."""
    pol = CostPolicy(_lookup)
    _read_back_after(pol, 1.0)
    m = _meta(b"stale", 0)
    m.tier = Tier.HBM
    pol.on_insert(m, 50_000.0)
    m.last_access = 50_000.0 - 100.0
    assert pol.demote_to(m, Tier.HBM, [Tier.DRAM], 50_000.0) == Tier.DRAM
    m.tier = Tier.DRAM
    key = pol.evict_key(m, Tier.DRAM, 50_000.0)[0]
    assert key == pytest.approx(pol.idle_value(m, Tier.DRAM, 100.0))
    assert key < 0.5 * pol.value(m, Tier.DRAM)


@pytest.mark.parametrize("beta", [-0.1, 1.5])
def test_demotion_aging_bounds_are_checked(beta):
    with pytest.raises(InvalidArgument, match="demotion_aging"):
        CostPolicyConfig(demotion_aging=beta)
