"""The cost-aware placement policy (``cost``, the default).

From :mod:`policy.reuse` (learned online) comes ``p``, the probability that a block like this
one is read again; from :mod:`policy.cost_model` the time a hit saves in each tier.

* **Value** of a block in tier ``t`` (``valuation="horizon"``, the default):
  ``E[future reads] × P(gap ≤ T_t) × gain(t) / bytes`` where
  ``E[future reads] = p / (1 − p)`` (each read is followed by another with probability ``p``),
  ``P(gap ≤ T_t)`` is the share of the observed gaps between reads of blocks of its class
  that are shorter than ``T_t`` (:meth:`policy.reuse.ReuseEstimator.within`, a learned
  histogram, no assumed distribution), ``T_t`` is the tier's characteristic time — the mean idle age of its recent victims, learned online (Che's
  approximation: a block not read again within ``T_t`` is evicted before it is) — and
  ``gain(t) = saving(t) − saving(t+1)`` is what leaving the tier costs on each such read,
  ``t+1`` being the next tier that exists (:meth:`CostPolicy.bind_tiers`; from the last local
  tier, whose victims are dropped, the whole ``saving(t)``: a recompute time). A small tier (short ``T_t``) thus ranks by
  saving per byte-second, like ``rate``; a large one by all expected reads, like ``reads``;
  no constant picks between them. Before a tier's first victim ``T_t`` is infinite.
  ``valuation="reads"`` (the previous default) drops the horizon factor; ``"rate"`` uses
  ``p × gain(t) / (bytes × mean_gap)`` (``mean_gap``: the learned mean time to the next
  read). On the issue-3 matrix ``rate`` closes more of the LRU→Belady gap on Mooncake than ``reads`` but loses to LRU on the generated agent and
  tenants workloads and to ``reads`` on chat at large capacities; ``horizon`` keeps most of
  the Mooncake gain without those losses (bench/RESULTS.md, issue 3 note); an exponential
  gap model in place of the histogram did slightly worse on tenants. Tried and not kept:
  multiplying by ``access_count`` (GDSF's frequency, ``frequency_weight=1``): +0.1 of the
  gap on shared_prompt, −0.3 on agent and tenants; refusing a victim in the next tier when
  its value there is below the mean value of that tier's recent victims (TinyLFU-style
  admission): −0.35 of the gap on tenants at HBM 400 and −0.04 on Mooncake at 1000;
  counting in that demotion test only the reads expected within the destination's horizon
  (``× P(gap ≤ T_dest)``): +0.01 of the gap on Mooncake at 400, −0.007 and −0.005 at
  1000 and 1500, no change on the generated workloads; valuing each later read with the
  ``p`` of the class the block will be in after the reads before it (instead of
  ``p / (1 − p)``): −0.005 to −0.03 of the gap on Mooncake.
* **Eviction order**: greedy-dual — each block carries ``H = L_t + value``, stamped when it is
  inserted, read or demoted into ``t``; the candidate with the lowest ``H`` goes first (ties:
  deepest first) and ``L_t`` rises to each victim's ``H``, so blocks not read for a long time
  lose to fresh ones unless they are valuable. Leaf-first and pinned-never are the Store's
  candidate rules. Whole prompts go together: on the Mooncake trace 92 / 90 / 95 % of the
  victims in HBM / DRAM / NVMe are the parent of the tier's previous victim (HBM 400; Belady,
  the offline optimum, 84 / 97 / 97 %): once a leaf goes, ``L_t`` reaches its ``H``, and its
  parent, stamped at about the same level and in NVMe worth less (shallower: less attention
  to recompute; in HBM and DRAM ``gain`` is a restore time, the same per byte at any depth),
  is most often next. Exact ties in ``H`` are rare (no victim in HBM or NVMe has its predecessor's ``H``;
  6–12 % in DRAM), so the tie rule hardly matters. Scratch trials on the order (2026-12-01),
  gap closed at HBM 400 / 1000 / 1500 against 0.202 / 0.164 / 0.162 now: ties shallowest
  first 0.202 / 0.164 / 0.166; as a diagnostic, each key's value times ``2^(s·u)``, ``u``
  uniform in [−1, 1) by a hash of the key (s = 0.3, 1, 2; three hashes at s = 1; HBM and DRAM
  or NVMe only): −0.004 to +0.006, −0.014 to +0.008, −0.020 to +0.003 of the gap, no sign
  that holds; the same factor on ``p`` (keys and the write test) −0.040 to +0.009 and more
  NVMe writes; gains valued at half the block's depth (the mean over the prefix it
  completes) −0.009 / −0.002 / −0.002; at twice its depth −0.010 / +0.019 / −0.017; at depth
  0 (no position in the value) −0.162 / −0.030 / +0.003; shallow blocks worth more than deep
  ones (gain at depth ``max(0, 60 − depth)``: prompts keep their first blocks, the
  behaviour a spread of values was thought to give) −0.242 / −0.126 / −0.079; the saving of the whole prefix the block
  completes, ``(depth + 1) ×`` the gain at half its depth, +0.008 / +0.012 / +0.003 on
  Mooncake but −0.10 / −0.12 of the gap on the generated agent workload and −0.09 / −0.10 on
  tenants at HBM 400 / 1000 (seed 1). None is kept. The gain a *random* feature gave the
  cross-fitted reference of ``bench/replay_ceiling.py`` is not an order effect: there, with
  split seed 0, a random value per block use lifts it from 0.084 / 0.095 to 0.112 / 0.164
  (HBM 400 / 1000) while one per request lowers it to −0.043 / 0.083; without a random
  feature, the cell rates smoothed toward the base rate with weight 14 instead of 2 give
  0.148 / 0.155 / 0.185 (mean of the three seeds; 0.060 / 0.107 / 0.149 with 2; with 50,
  0.183 / 0.172 / 0.211, and 0.213 / 0.200 / 0.228 without the time since the last use,
  i.e. with the features ``cost`` has (uses, request length, position from its end); one
  constant ``p`` for all, 0.183 / 0.088 / 0.108): the reference's ``p`` is noisy. ``cost``'s own is not: ``ReuseConfig.request_prior`` 2 or 32
  in place of 8 moves its gap by at most 0.006.
* **Demotion / admission**: a victim goes to the next tier offered only when its expected
  saving there, ``p × saving(dest)``, pays for writing it there,
  ``write_cost_weight × bytes / bandwidth(dest)``; otherwise it is dropped. A block with
  resident children is always demoted when possible (dropping it would strand them), and so
  is a block whose committed NVMe copy exists (demoting it there writes nothing). When the
  tier it names cannot take the victim, the Store (and the replay) ask again with the tiers
  after it (:class:`policy.base.EvictionPolicy`); the eviction is learnt from once.
* **Expiry** (``expiry_aware``, on by default): a read after a block's TTL deadline is a miss,
  so the deadline bounds the window in which its reads count. With ``F`` the class's gap
  distribution (:meth:`policy.reuse.ReuseEstimator.within`, gaps from the block's
  ``last_access``) and ``w = ttl_deadline − last_access``, the next read comes before the
  deadline with probability ``p·F(w)`` (:meth:`policy.reuse.ReuseEstimator.probability` with
  ``now``). ``horizon`` counts the first read within ``min(T_t, w)`` instead of ``T_t``: a
  deadline past the tier's horizon changes nothing (the block leaves the tier before it
  expires), a nearer one scales the value by ``F(w) / F(T_t)``; ``reads`` and ``rate`` scale
  by ``F(w)``; a demoted block's idle value caps its horizon at ``ttl_deadline − now``. Each
  is non-decreasing in the deadline and 0 once the block has expired (``now >=
  ttl_deadline``), so of two blocks otherwise alike the one expiring sooner goes first; a
  block without a deadline is valued exactly as before. Demotion and admission weigh the
  write against ``p·F(w) × saving(dest)``, and never write an expired block or one whose
  deadline comes before its copy could be written (``restore_seconds`` to ``dest``, as the
  write cost takes it). The key is stamped as before (the deadline enters the value, not the
  time left), so keys stay stable between notifications; a block that expires is deleted by
  the Store's expiry, not re-ranked. Tried and not kept (Mooncake replay with every block
  given one TTL, ``bench/replay_bench.py --ttl-s``, 2026-12-01): counting every later read
  before the deadline too (``q·F(min(T_t, w)) / (1 − q·F(w))`` expected reads, which lowers
  blocks of high ``p`` most) saved less prefill time than this form in 4 of 6 cells (up to
  −0.0027; +0.0009 at best; TTL 60/120/300/600 s, HBM 400 and 1000). Against ``expiry_aware=False`` in the same replay (HBM
  400/1000/1500, DRAM 3×, NVMe 10×): net saved prefill time −0.0029/−0.0020/−0.0006 at TTL
  60 s, +0.0009/−0.0025/−0.0013 at 120 s, +0.0010/+0.0015/−0.0013 at 300 s, +0.0007/−0.0008/
  −0.0001 at 600 s, with NVMe written −22/−36/−47 % at 60 s and −4/−5/−6 % at 120 s (about
  equal at 300 and 600 s). The write rule, not the order, makes the difference (the order
  alone, with writes decided as before: +0.0003/0.0000 at 60 s HBM 400/1000, −0.0008 at 120 s
  HBM 1000); the replay counts no write time, and at ``write_cost_weight`` 0.1 the NVMe time
  saved at 60 s (248 s and 206 s of writes at 5 GB/s, weighted 25 s and 21 s) is about the
  prefill time lost (11 s and 8 s of 3,946 s), at 120 s HBM 1000 it is not (4 s against 10 s).
* **Idle time at demotion** (``demotion_aging`` = β, 0.5 by default): a demoted block is
  keyed in the tier it goes to with ``L_t + v · (v_idle / v)^β``, where ``v`` is its value
  as if just read and ``v_idle`` its value given that it has not been read for its age
  (:meth:`policy.reuse.ReuseEstimator.after_idle`: Bayes on the class's gap histogram).
  Why: a greedy-dual key only ages through the tier's level, and a demotion re-stamped it at
  the new tier's level as if the block had just been read; in NVMe, the last tier, such a key
  then stayed until the level caught up, so blocks valued highly while they were read kept
  their keys long after their reads stopped and, evicted leaf-first, each such leaf kept its
  whole chain. Replaying the Mooncake trace and then a copy with new hash ids
  (``bench/replay_repeat.py``) at HBM 1500, 57 first-pass leaves still held 4,191 of the
  15,000 NVMe blocks at the end, and ``cost`` closed −5 % of the gap in the second pass (17 %
  in the first). Scratch trials (2026-11-30), gap closed first / second pass, mean over
  Mooncake at HBM 300, 400, 500, 700, 1000, 1200, 1500, 2000: β = 0 0.162 / 0.052; β = 0.5 in
  NVMe only 0.155 / 0.140; β = 0.5 at every demotion (the default) 0.160 / 0.157. On the
  generated workloads at HBM 100/400/1000, two seeds, the default is within −0.032 of β = 0
  in the first pass (shared prompts at 400) and gains up to 0.19 in the second (shared
  prompts at 1000); tenants at 1000 stays below LRU in the second pass with seed 1 (−0.055 →
  −0.024 of the gap) and is above it with seed 2 (−0.007 → +0.019). Tried and not kept: β = 0.25 in NVMe only (0.161 / 0.119); the
  full update (β = 1) at every demotion (first pass −0.047 at HBM 1000); a key that decays
  with time instead of greedy-dual (``log v`` plus idle time over the tier's horizon): first
  pass −0.04 at 1000, second pass −0.18 of the gap on the agent workload at 1000.

Keys are stable between notifications, as :class:`policy.registry.KeyedPolicy` requires. A
block read or stored keeps the level ``L_t`` of that notification but is valued when it is
first ranked (``deferred_stamp``, on by default), once the request it belongs to is complete,
so the request features of :mod:`policy.reuse` (:mod:`policy.request_lift`) see the whole
request; from then on the key is stable. (A block ranked before its request ends — the Store
making room mid-put — is valued as it stands then.) With the request lift this closed
19 / 19 / 17 % of the Mooncake LRU→Belady gap at HBM 400 / 1000 / 1500 (18 / 15 / 13 % with
neither) and wrote less to NVMe; on the generated workloads, two seeds, it stayed within 0.014
of the gap of the previous default (shared prompts at HBM 100) and gained up to 0.07 (tenants
at HBM 100). With the idle discount at demotion (above) as well: see bench/RESULTS.md and
the README ("Long runs") for one pass and a second pass over new blocks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.block import BlockMeta, Tier
from kvstore.errors import InvalidArgument
from policy.base import SpecLookup, life_left, register
from policy.cost_model import CostModel, CostModelConfig, CostModels
from policy.reuse import ReuseConfig, ReuseEstimator

# the tier each tier's victims go to when every local tier exists (NVMe's: none, they are
# dropped; the remote tier, a best-effort asynchronous copy, is not counted on)
_BELOW: tuple[Tier | None, ...] = (Tier.DRAM, Tier.NVME, None, None)
_P_MAX = 0.999  # caps E[future reads] at 999
_MIN_GAP_S = 1e-3  # floor of the mean gap (a class read back within the same instant)
_HORIZON_WINDOW = 1000  # victims averaged (running mean, then EWMA) into a tier's horizon


@dataclass(frozen=True, slots=True)
class CostPolicyConfig:
    """Knobs of the cost policy."""

    costs: CostModelConfig = field(default_factory=CostModelConfig)
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    write_cost_weight: float = 0.1
    """Weight of a background write's device time against foreground time saved, in [0, 10]."""
    frequency_weight: float = 0.0
    """Exponent of the access count multiplying the expected reads (GDSF uses 1), in [0, 4].
    0 by default: the learned ``p`` already depends on the access count, and a larger
    exponent helped shared-prompt traces but hurt agent and chat traces (see the note)."""

    valuation: str = "horizon"
    """``horizon`` (the default: expected reads that fall within the tier's learned
    characteristic time), ``reads`` (all expected future reads) or ``rate`` (saving per
    byte-second); see the module docstring for where each wins."""

    demotion_aging: float = 0.5
    """Exponent ``β`` in [0, 1] of the discount for idle time of a demoted block
    (``valuation="horizon"`` only): it is valued in its new tier at ``v · (v_idle / v)^β``, where
    ``v`` is its value as if just read and ``v_idle`` the value given that it has been idle
    for its age (:meth:`policy.reuse.ReuseEstimator.after_idle`). 0: no discount (the
    previous behaviour); 1: the full Bayesian update; 0.5, the default, their geometric mean
    (see the module docstring for why)."""

    deferred_stamp: bool = True
    """Value a block read or inserted when it is first ranked (its request then complete, so
    the request features of :class:`policy.reuse.ReuseConfig` see the whole request) rather
    than at the notification; the level ``L_t`` is still the one at the notification. The
    first ``rank``/``evict_key`` of such a block stores its key (a cache: the order it returns
    is the same on every later call)."""

    expiry_aware: bool = True
    """Count only the reads expected before a block's TTL deadline (module docstring,
    "Expiry"); False values every block as if it had none (the behaviour before)."""

    def __post_init__(self) -> None:
        if self.valuation not in ("rate", "reads", "horizon"):
            raise InvalidArgument("CostPolicyConfig.valuation must be 'rate', 'reads' or 'horizon'")
        if not 0.0 <= self.write_cost_weight <= 10.0:
            raise InvalidArgument("CostPolicyConfig.write_cost_weight must be in [0, 10]")
        if not 0.0 <= self.frequency_weight <= 4.0:
            raise InvalidArgument("CostPolicyConfig.frequency_weight must be in [0, 4]")
        if not 0.0 <= self.demotion_aging <= 1.0:
            raise InvalidArgument("CostPolicyConfig.demotion_aging must be in [0, 1]")


class CostPolicy:
    name = "cost"

    def __init__(self, spec_lookup: SpecLookup | None = None,
                 config: CostPolicyConfig | None = None) -> None:
        self.config = config or CostPolicyConfig()
        self._costs = CostModels(spec_lookup, self.config.costs)
        self.reuse = ReuseEstimator(self.config.reuse)
        self._level = [0.0] * len(Tier)
        self._h: dict[bytes, float] = {}
        # per tier: mean idle age of its victims (its characteristic time), EWMA; inf = none yet
        self._horizon = [math.inf] * len(Tier)
        self._victims = [0] * len(Tier)
        self._pending: dict[bytes, float] = {}  # key -> level at insert, value not yet stamped
        self._below: tuple[Tier | None, ...] = _BELOW  # see bind_tiers
        # per tier: (key, now) of the victim demote_to last learnt from (see there)
        self._leaving: list[tuple[bytes, float] | None] = [None] * len(Tier)

    def bind_tiers(self, tiers: Sequence[Tier]) -> None:
        """The local tiers that exist (:class:`policy.registry.TieredPolicy`): a tier's victims
        go to the next of them, and the last one's are dropped.

        NOTE: ``gain`` took the next tier as the one below in HBM, DRAM, NVMe whether it existed
        or not: in a store of HBM alone an HBM block was worth a DRAM restore time, the same for
        every block of a size, so recompute cost played no part and the tie rule (deepest
        first) chose; it dropped a pair 0.18 s to recompute over one of 0.02 s."""
        local = sorted(t for t in set(tiers) if t != Tier.REMOTE)
        below: list[Tier | None] = [None] * len(Tier)
        for here, nxt in itertools.pairwise(local):
            below[here] = nxt
        self._below = tuple(below)

    # -- valuation --------------------------------------------------------------------------
    def _model(self, meta: BlockMeta) -> CostModel:
        return self._costs.get(meta.fingerprint, meta.tokens)

    def gain(self, meta: BlockMeta, tier: Tier) -> float:
        """Seconds lost on the next read if the block leaves ``tier`` for the next one that
        exists (the whole saving when there is none: it is dropped and recomputed)."""
        model = self._model(meta)
        here = model.saving(meta.tokens, meta.depth, meta.nbytes, tier)
        below = self._below[tier]
        if below is None:
            return here
        return here - model.saving(meta.tokens, meta.depth, meta.nbytes, below)

    def expected_reads(self, meta: BlockMeta, c: int | None = None, p: float | None = None) -> float:
        """p / (1 − p), times ``access_count ** frequency_weight`` (``c``: the block's reuse
        class, when known; ``p``: the probability to use instead of the estimator's)."""
        if p is None:
            p = self.reuse.probability(meta, c)
        p = min(p, _P_MAX)
        reads = p / (1.0 - p)
        if self.config.frequency_weight:
            reads *= max(meta.access_count, 1) ** self.config.frequency_weight
        return reads

    def _left(self, meta: BlockMeta, now: float | None) -> float | None:
        """Seconds to ``meta``'s deadline when the valuation counts it, else None."""
        if now is None or not self.config.expiry_aware:
            return None
        return life_left(meta, now)

    def _p_before(self, meta: BlockMeta, c: int | None, now: float | None,
                  left: float | None) -> float | None:
        """P(read again before the deadline) when ``left`` (from :meth:`_left`) is not None,
        else None (the caller's plain ``p``, its call unchanged).

        NOTE: ``probability(meta, c) × before_deadline``, not ``probability(meta, c, now)``:
        the bounds of bench/replay_bounds.py replace ``probability`` with one that takes no
        ``now``, and get the deadline applied too."""
        if left is None or now is None:
            return None
        if c is None:
            c = self.reuse.klass(meta)
        return self.reuse.probability(meta, c) * self.reuse.before_deadline(meta, now, c)

    def value(self, meta: BlockMeta, tier: Tier, c: int | None = None,
              now: float | None = None) -> float:
        """What keeping the block in ``tier`` is worth, per byte (see the module docstring).
        ``c``: the block's reuse class, when the caller has it already; ``now``: count only
        the reads before its TTL deadline (0 once expired; None: ignore the deadline)."""
        left = self._left(meta, now)
        if left is not None and left <= 0.0:
            return 0.0  # expired: no read can come
        per_byte = self.gain(meta, tier) / max(meta.nbytes, 1)
        if self.config.valuation == "reads":
            reads = self.expected_reads(meta, c) * per_byte
            return reads if left is None else reads * self.reuse.before_deadline(meta, now, c)  # type: ignore[arg-type]
        if self.config.valuation == "horizon":
            horizon = self._horizon[tier]
            if c is None:
                c = self.reuse.klass(meta)  # NOTE: once, for both estimates
            if left is not None:  # the deadline caps the horizon (gaps from last_access)
                horizon = min(horizon, meta.ttl_deadline - meta.last_access)  # type: ignore[operator]
            return self.expected_reads(meta, c) * per_byte * self.reuse.within(meta, horizon, c)
        p = self._p_before(meta, None, now, left)
        p = min(self.reuse.probability(meta) if p is None else p, _P_MAX)
        return p * per_byte / max(self.reuse.mean_gap(meta), _MIN_GAP_S)

    def idle_value(self, meta: BlockMeta, tier: Tier, age: float, now: float | None = None) -> float:
        """:meth:`value` for a block idle for ``age`` seconds, discounted by
        ``demotion_aging`` (the value itself where that is 0 or the valuation is not
        ``horizon``). ``now``: as in :meth:`value` (the read must come within
        ``ttl_deadline − now`` as well as within the tier's horizon)."""
        beta = self.config.demotion_aging
        if not beta or self.config.valuation != "horizon":
            return self.value(meta, tier, now=now)
        c = self.reuse.klass(meta)
        fresh = self.value(meta, tier, c, now)
        if fresh <= 0.0:
            return fresh
        horizon = self._horizon[tier]
        left = self._left(meta, now)
        if left is not None:  # the deadline caps the horizon (here counted from now)
            horizon = min(horizon, left)
        alive, soon = self.reuse.after_idle(meta, age, horizon, c)
        idle = self.expected_reads(meta, c, alive) * soon * self.gain(meta, tier) / max(meta.nbytes, 1)
        return fresh * (idle / fresh) ** beta if idle > 0.0 else 0.0

    def horizon(self, tier: Tier) -> float:
        """The tier's characteristic time: mean idle age of its victims (inf before any)."""
        return self._horizon[tier]

    def _learn_horizon(self, tier: Tier, age: float) -> None:
        n = self._victims[tier] = min(self._victims[tier] + 1, _HORIZON_WINDOW)
        prev = self._horizon[tier]
        self._horizon[tier] = age if math.isinf(prev) else prev + (age - prev) / n

    def _stamp(self, meta: BlockMeta, tier: Tier, now: float) -> None:
        self._h[meta.key] = self._level[tier] + self.value(meta, tier, now=now)

    # -- protocol ---------------------------------------------------------------------------
    def on_insert(self, meta: BlockMeta, now: float) -> None:
        self.reuse.on_insert(meta, now)
        self._back(meta)
        if self.config.deferred_stamp:
            self._pending[meta.key] = self._level[meta.tier]
        else:
            self._stamp(meta, meta.tier, now)

    def on_access(self, meta: BlockMeta, now: float) -> None:
        self.reuse.on_access(meta, now)
        self._back(meta)
        if self.config.deferred_stamp:  # a read brings the block to HBM
            self._pending[meta.key] = self._level[Tier.HBM]
        else:
            self._stamp(meta, Tier.HBM, now)

    def _back(self, meta: BlockMeta) -> None:
        """``meta`` is stored or read: an eviction of it from now on is a new one (demote_to)."""
        for i, e in enumerate(self._leaving):
            if e is not None and e[0] == meta.key:
                self._leaving[i] = None

    def on_remove(self, meta: BlockMeta) -> None:
        self.reuse.on_remove(meta)
        self._h.pop(meta.key, None)
        self._pending.pop(meta.key, None)

    def _stamped(self, meta: BlockMeta, tier: Tier, now: float) -> float | None:
        """The block's key, valued now (once) if its notification deferred it."""
        level = self._pending.pop(meta.key, None) if self._pending else None
        if level is not None:
            h = self._h[meta.key] = level + self.value(meta, tier, now=now)
            return h
        return self._h.get(meta.key)

    def evict_key(self, meta: BlockMeta, tier: Tier, now: float) -> tuple[float, int]:
        h = self._stamped(meta, tier, now)
        if h is None:
            h = self._level[tier] + self.value(meta, tier, now=now)
        return (h, -meta.depth)

    def rank(self, tier: Tier, candidates: Sequence[BlockMeta], now: float) -> list[BlockMeta]:
        return sorted(candidates, key=lambda m: self.evict_key(m, tier, now))

    def worth_writing(self, meta: BlockMeta, dest: Tier, now: float | None = None) -> bool:
        """Expected saving in ``dest`` pays for the write there (always, with children, and
        into NVMe when a committed copy is already there: keeping it costs no write). With
        ``now``, only reads before the block's TTL deadline count: never for an expired block,
        nor for one that expires before its copy could be written (the write taken to last
        ``restore_seconds``, as the write cost does)."""
        left = self._left(meta, now)
        if left is not None and left <= 0.0:
            return False
        if meta.children > 0 or (dest == Tier.NVME and meta.persisted):
            return True
        model = self._model(meta)
        write_s = model.restore_seconds(meta.nbytes, dest)
        if left is not None and left <= write_s:
            return False
        p = self._p_before(meta, None, now, left)
        expected = (self.reuse.probability(meta) if p is None else p) * model.saving(
            meta.tokens, meta.depth, meta.nbytes, dest)
        return expected >= self.config.write_cost_weight * write_s

    def demote_to(
        self, meta: BlockMeta, src: Tier, available: Sequence[Tier], now: float
    ) -> Tier | None:
        age = max(0.0, now - meta.last_access)
        if self._leaving[src] != (meta.key, now):
            # NOTE: the Store asks again, with the tiers after the one named, when that one
            # could not take the victim (policy.base); the eviction from ``src`` is learnt once
            # (the key stamped by the first answer is the destination's, not ``src``'s level)
            self._leaving[src] = (meta.key, now)
            h = self._stamped(meta, src, now)
            if h is not None and h > self._level[src]:
                self._level[src] = h
            self._learn_horizon(src, age)
        for dest in available:
            if self.worth_writing(meta, dest, now):
                self._h[meta.key] = self._level[dest] + self.idle_value(meta, dest, age, now)
                return dest
        return None

    def admit(self, meta: BlockMeta, tier: Tier, now: float) -> bool:
        return self.worth_writing(meta, tier, now)


register("cost", CostPolicy)
