"""Online reuse estimate: how likely a block is to be read again (DESIGN.md §4).

The estimate is learned from what the Store tells the policy, not from constants tuned to one
trace. Blocks are grouped in classes by what is known online:

* ``partial`` — fewer tokens than a full block (a tail: only an identical prompt reuses it),
* ``freq`` — accesses so far, bucketed 1, 2, 3, 4–7, 8–15, 16+ (a block read twice is read
  again far more often than a block read once: the insight behind 2Q, ARC and TinyLFU; and
  a session's blocks read many times stop being read when the session ends),
* ``shared`` — it has had two or more children (a shared prefix),
* ``extends`` — the run of inserts that brought it in started under a block that was already
  cached (the new tail after a prefix hit: user content after a shared prompt, a new turn),
  rather than at a root (a whole new prompt). Learned per workload like the other features:
  on the Mooncake trace and on shared prompts such blocks return far less often (12 % and
  0 % against 43 % and 78 %); on chats and agents the two differ little.

The request each block was last read or stored in refines ``p`` (``request_features``, on by
default): :mod:`policy.request_lift` groups the notifications into requests, and multiplies a
block's class ``p`` by the lift of its request cell (log2 of the request's length × position
from its end) over its class, both learned with a censoring correction. This replaces the put-run
features of earlier versions, which learned per-cell counts the way the coarse classes do: on
the Mooncake trace they cost up to 0.10 of the LRU→Belady gap (a burst of one long run's
episodes, counted as trials at once, made its cell look cold) and put the tenants workload at
HBM 100 below LRU; the censoring-corrected lift, with deferred valuation, gains 0.01–0.04 of
the gap on Mooncake at HBM 400/1000/1500 and up to 0.07 on the generated workloads
(policy/cost.py, issue-3 note).

The access count includes the reads a block had before it was last removed, when it comes
back while its key is still remembered (ghost history, as in TinyLFU and ARC): a block
evicted and requested again is not a first-time block.

Each access starts an *episode* for the block's class; the episode succeeds when the block is
read again, whether it was still resident (``on_access``) or had been removed and comes back
(``on_insert`` of a key still remembered in a bounded ghost list), and the gap (seconds of
the injected clock) is recorded. Per class this gives ``p`` = success rate (Beta(1, 1) prior)
and ``mean_gap`` = mean time to the next read when there is one; the gaps are also kept as
a histogram (log2 bins of 1 ms), from which ``within(meta, horizon)`` gives the share of a
class's gaps no longer than ``horizon`` (no assumed distribution). Counts halve every
``half_life_events`` episodes, so the estimates follow a changing workload. PAUSED sessions
raise ``p`` (they come back), and so does a tenant hint.

``after_idle(meta, age, horizon)`` gives, from the class's gap histogram (no assumed
distribution), the posterior that a block idle for ``age`` seconds is read again and the
probability that the read comes within ``horizon``; the cost policy uses it to value a demoted
block for the time it has already been idle.

A block's TTL deadline bounds its reuse: ``probability(meta, c, now)`` is the probability that
it is read again *before* the deadline, ``p × P(gap ≤ ttl_deadline − last_access)`` from the
same gap histogram (0 once expired); a block without a deadline keeps ``p`` exactly.

Time enters only through ``now`` arguments and the blocks' ``last_access`` and ``ttl_deadline``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from policy.base import life_left, parent_key
from policy.request_lift import RequestLift

#: access-count buckets: 1, 2, 3, 4-7, 8-15, 16+
_FREQ_BUCKETS = 6
#: number of classes: extends (2) x partial (2) x freq bucket x shared (2)
N_CLASSES = 2 * 2 * _FREQ_BUCKETS * 2


@dataclass(frozen=True, slots=True)
class ReuseConfig:
    """Knobs of the reuse estimator."""

    half_life_events: int = 50_000
    """Episodes after which old counts weigh half, > 0."""
    ghost_entries: int = 200_000
    """Removed keys remembered to notice that a block came back, >= 0."""
    extends_feature: bool = True
    """Split classes by whether the block's run of inserts extended an already cached prefix."""
    ghost_frequency: bool = True
    """A block that comes back after removal keeps counting its earlier reads (ghost history)."""
    paused_boost: float = 0.9
    """A PAUSED session's block gets p' = 1 − (1 − p)(1 − paused_boost), in [0, 1]."""
    request_features: bool = True
    """Refine ``p`` by the block's request (length, position from its end): see
    :mod:`policy.request_lift`. Costs about 7 µs more per read or store notification (2.5 →
    9.9 µs per insert in a scratch loop of 60,000 inserts on the development machine)."""
    request_prior: float = 8.0
    """Bin-widths of exposure at the class's rate with which a request cell starts, > 0."""
    lift_cap: float = 0.95
    """Upper bound of ``p`` after the request lift, in (0, 1)."""
    lift_episodes: int = 250_000
    """Reads and stores the request lift watches at once, > 0 (memory: about 150 bytes each;
    past it the oldest stop being watched, their outcome unknown)."""

    def __post_init__(self) -> None:
        if not isinstance(self.half_life_events, int) or self.half_life_events <= 0:
            raise InvalidArgument("ReuseConfig.half_life_events must be a positive int")
        if not isinstance(self.ghost_entries, int) or self.ghost_entries < 0:
            raise InvalidArgument("ReuseConfig.ghost_entries must be a non-negative int")
        if not 0.0 <= self.paused_boost <= 1.0:
            raise InvalidArgument("ReuseConfig.paused_boost must be in [0, 1]")
        if not 0.0 < self.request_prior <= 1e6:
            raise InvalidArgument("ReuseConfig.request_prior must be in (0, 1e6]")
        if not 0.0 < self.lift_cap < 1.0:
            raise InvalidArgument("ReuseConfig.lift_cap must be in (0, 1)")
        if not isinstance(self.lift_episodes, int) or self.lift_episodes <= 0:
            raise InvalidArgument("ReuseConfig.lift_episodes must be a positive int")



#: gap histogram: log2 bins of 1 ms, the last one open-ended (2^39 ms ~ 17 years)
_GAP_UNIT_S = 1e-3
_GAP_BINS = 40


def _gap_bin(gap: float) -> int:
    return min(int(gap / _GAP_UNIT_S).bit_length(), _GAP_BINS - 1)


def reuse_class(meta: BlockMeta, full_tokens: int, shared: bool, extends: bool = False,
                extra_reads: int = 0) -> int:
    partial = 1 if meta.tokens < full_tokens else 0
    count = max(meta.access_count, 1) + extra_reads
    freq = count - 1 if count <= 3 else min(count.bit_length(), _FREQ_BUCKETS - 1)
    return ((2 * (1 if extends else 0) + partial) * _FREQ_BUCKETS + freq) * 2 + (1 if shared else 0)


class ReuseEstimator:
    """Per-class online reuse probabilities. Feed it every insert, access and removal."""

    __slots__ = (
        "_branch",
        "_events",
        "_extends",
        "_full",
        "_gaps",
        "_ghost",
        "_hints",
        "_hist",
        "_hits",
        "_last_insert",
        "_lift",
        "_open",
        "_past",
        "_trials",
        "config",
    )

    def __init__(self, config: ReuseConfig | None = None) -> None:
        self.config = config or ReuseConfig()
        self._trials = [0.0] * N_CLASSES
        self._hits = [0.0] * N_CLASSES
        self._gaps = [0.0] * N_CLASSES  # sum of observed gaps (seconds)
        # per class: observed gaps in log2 bins of _GAP_UNIT_S (bin 0: shorter than 2 units)
        self._hist = [[0.0] * _GAP_BINS for _ in range(N_CLASSES)]
        # key -> (class of its open episode, time the episode started)
        self._open: dict[bytes, tuple[int, float]] = {}
        # removed key -> (class, start of its open episode, reads so far)
        self._ghost: OrderedDict[bytes, tuple[int, float, int]] = OrderedDict()
        self._branch: dict[bytes, int] = {}  # key -> children seen (capped at 2)
        self._events = 0
        self._full = 0  # largest token count seen in a block: what "full" means
        self._hints: dict[str, float] = {}
        self._extends: dict[bytes, bool] = {}  # resident key -> its put run extended a cached prefix
        self._last_insert = b""
        self._past: dict[bytes, int] = {}  # resident key -> reads before its last removal
        self._lift = RequestLift(N_CLASSES, self.config.request_prior, self.config.half_life_events,
                                 self.config.lift_episodes) if self.config.request_features else None

    # -- hints ------------------------------------------------------------------------------
    def set_tenant_hint(self, tenant: str, probability: float | None) -> None:
        """A floor on the reuse probability of a tenant's blocks (None clears it)."""
        if probability is None:
            self._hints.pop(tenant, None)
            return
        if not 0.0 <= probability <= 1.0:
            raise InvalidArgument("tenant hint must be a probability in [0, 1]")
        self._hints[tenant] = probability

    # -- observation ------------------------------------------------------------------------
    def _start(self, meta: BlockMeta, now: float) -> None:
        c = self.klass(meta)
        self._open[meta.key] = (c, now)
        self._trials[c] += 1.0
        if self._lift is not None:
            self._lift.observe(meta, c, now)
        self._events += 1
        if self._events % self.config.half_life_events == 0:
            self._trials = [x * 0.5 for x in self._trials]
            self._hits = [x * 0.5 for x in self._hits]
            self._gaps = [x * 0.5 for x in self._gaps]
            for h in self._hist:
                h[:] = [x * 0.5 for x in h]

    def _success(self, episode: tuple[int, float] | tuple[int, float, int] | None,
                 now: float) -> None:
        if episode is not None:
            c, start = episode[0], episode[1]
            self._hits[c] += 1.0
            gap = max(0.0, now - start)
            self._gaps[c] += gap
            self._hist[c][_gap_bin(gap)] += 1.0

    def on_insert(self, meta: BlockMeta, now: float) -> int | None:
        """Start tracking a block; returns the class it had when it was removed if it is a
        block that had been removed and came back (a *ghost hit*), else None."""
        self._full = max(self._full, meta.tokens)
        ghost = self._ghost.pop(meta.key, None)
        self._success(ghost, now)
        parent = parent_key(meta)  # b"" for a root, in the Store's convention too
        if self.config.extends_feature:
            # A run of inserts continues while each block's parent is the previous insert;
            # a run whose first block has a parent extends a prefix that was already cached.
            if parent == self._last_insert and parent:
                self._extends[meta.key] = self._extends.get(parent, False)
            else:
                self._extends[meta.key] = bool(parent)
            self._last_insert = meta.key
        if self.config.ghost_frequency and ghost is not None:
            self._past[meta.key] = ghost[2]
        if parent:
            b = self._branch.get(parent, 0)
            if b < 2:
                self._branch[parent] = b + 1
        self._start(meta, now)
        return ghost[0] if ghost is not None else None

    def on_access(self, meta: BlockMeta, now: float) -> None:
        self._success(self._open.get(meta.key), now)
        self._start(meta, now)

    def on_remove(self, meta: BlockMeta) -> int | None:
        """Forget a resident block (remember it as a ghost); returns its open class."""
        c = self._open.pop(meta.key, None)  # (class, start) of the open episode
        self._extends.pop(meta.key, None)
        if self._lift is not None:
            self._lift.forget(meta.key)
        past = self._past.pop(meta.key, 0)
        if c is None or self.config.ghost_entries == 0:
            return None if c is None else c[0]
        self._ghost[meta.key] = (c[0], c[1], past + max(meta.access_count, 1))
        if len(self._ghost) > self.config.ghost_entries:
            self._ghost.popitem(last=False)
            # NOTE: the branch memory is bounded the same way, by forgetting the oldest keys.
        if len(self._branch) > 2 * self.config.ghost_entries:
            for k in list(self._branch)[: self.config.ghost_entries]:
                del self._branch[k]
        return c[0]

    # -- estimate ---------------------------------------------------------------------------
    def klass(self, meta: BlockMeta) -> int:
        shared = self._branch.get(meta.key, 0) >= 2
        return reuse_class(meta, max(self._full, meta.tokens), shared,
                           self._extends.get(meta.key, False), self._past.get(meta.key, 0))

    def class_probability(self, c: int) -> float:
        # NOTE: decay can halve an episode's trial before its success is counted: clamp.
        return (min(self._hits[c], self._trials[c]) + 1.0) / (self._trials[c] + 2.0)

    def _class_gap(self, c: int) -> float:
        all_hits = sum(self._hits)
        prior = sum(self._gaps) / all_hits if all_hits > 0 else 1.0
        return (self._gaps[c] + prior) / (self._hits[c] + 1.0)

    def mean_gap(self, meta: BlockMeta) -> float:
        """Mean seconds to the next read of a block of this class, when it is read again.

        A class with no observed gap borrows the mean over all classes (1 s if none yet)."""
        return self._class_gap(self.klass(meta))

    def within(self, meta: BlockMeta, horizon: float, c: int | None = None) -> float:
        """P(gap ≤ horizon | the block is read again): the class's empirical gap distribution,
        with the exponential of the mean gap as a one-observation prior. ``c``: the block's
        :meth:`klass`, when the caller has it already."""
        if math.isinf(horizon):
            return 1.0
        if c is None:
            c = self.klass(meta)
        prior = -math.expm1(-max(horizon, 0.0) / max(self._class_gap(c), 1e-9))
        hist = self._hist[c]
        b = _gap_bin(max(horizon, 0.0))
        below = sum(hist[:b]) + 0.5 * hist[b]
        return (below + prior) / (self._hits[c] + 1.0)  # NOTE: _hits[c] is sum(hist), kept alike

    def after_idle(self, meta: BlockMeta, age: float, horizon: float,
                   c: int | None = None) -> tuple[float, float]:
        """For a block idle for ``age`` seconds: (P(read again), P(that read comes within the
        next ``horizon`` seconds)), from the class's gap histogram (:meth:`within`), not an
        assumed distribution. Bayes: only the ``p`` of episodes whose gap exceeds ``age`` are
        still possible, so ``P = p·S / (p·S + 1 − p)`` with ``S = P(gap > age | read again)``,
        and the read falls in ``(age, age + horizon]`` with ``(F(age + horizon) − F(age)) / S``."""
        if c is None:
            c = self.klass(meta)
        p = self.probability(meta, c)
        f_age = self.within(meta, age, c)
        s = max(1.0 - f_age, 1e-9)
        alive = p * s / (p * s + 1.0 - p)
        if math.isinf(horizon):
            return alive, 1.0
        soon = (self.within(meta, age + max(horizon, 0.0), c) - f_age) / s
        return alive, min(1.0, max(0.0, soon))

    def before_deadline(self, meta: BlockMeta, now: float, c: int | None = None) -> float:
        """P(the next read comes before the block's TTL deadline | it is read again): 1 for a
        block without a deadline, 0 for an expired one (``now >= ttl_deadline``), else the
        share of the class's gaps no longer than ``ttl_deadline − last_access`` (:meth:`within`;
        gaps are counted from the read or store that opened the episode, the block's
        ``last_access``). Non-decreasing in the deadline."""
        left = life_left(meta, now)
        if left is None:
            return 1.0
        if left <= 0.0:
            return 0.0
        return self.within(meta, meta.ttl_deadline - meta.last_access, c)  # type: ignore[operator]

    def probability(self, meta: BlockMeta, c: int | None = None, now: float | None = None) -> float:
        """P(the block is read again), in (0, 1); with ``now``, P(it is read again before its
        TTL deadline) (× :meth:`before_deadline`: 0 once expired, unchanged without a
        deadline). ``c``: the block's :meth:`klass`, when the caller has it already."""
        if c is None:
            c = self.klass(meta)
        if now is not None and meta.ttl_deadline is not None:
            return self.probability(meta, c) * self.before_deadline(meta, now, c)
        p = self.class_probability(c)
        if self._lift is not None:
            lift = self._lift.lift(meta.key, c)
            if lift is not None:
                p = min(self.config.lift_cap, p * lift)
        if meta.paused > 0:
            p = 1.0 - (1.0 - p) * (1.0 - self.config.paused_boost)
        hint = self._hints.get(meta.tenant)
        if hint is not None:
            p = max(p, hint)
        return p
