"""Reference policies that bound what an online reuse estimate can buy (issue 3's analysis).

The ``cost`` policy (:mod:`policy.cost`) turns a reuse probability ``p`` per block into
eviction, demotion and admission decisions. These references keep one part and replace the
other, so a replay tells which part limits it:

* :class:`OracleReuseLRU` — LRU order, with *perfect* knowledge of whether each block is read
  again: never-read blocks are evicted first and dropped, the others demoted.
* :class:`OracleProbabilityCost` — the ``cost`` policy's decisions, unchanged, fed the truth as
  ``p`` (``hi`` if the block is read again, ``lo`` if not). What the decision logic gives when
  the estimate is perfect.
* :class:`FittedFeaturesCost` — the ``cost`` policy fed, as ``p``, the rate at which blocks
  with the same *online-knowable* features are read again, counted over the whole trace being
  replayed (in-sample). Features, all known when a block is stored or read: how many times the
  block was used before (0, 1, 2, 3+), the log2 bucket of its request's length in blocks, its
  position from the request's end (0..3, 4+) and the log2 bucket of the seconds since its last
  use. An online estimator learning a probability per such class cannot know the rates better
  than this table does; it shows how far these features can take ``p``.

Bench-only: none of them can run in the Store (they need the trace's future or its totals).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

from kvstore.block import BlockMeta, Tier
from kvstore.replay import ReplayConfig, block_key
from kvstore.workloads import TraceRequest
from policy.base import SpecLookup
from policy.belady import INF, BeladyPolicy
from policy.cost import CostPolicy
from policy.reuse import ReuseEstimator


def spec_lookup(cfg: ReplayConfig) -> SpecLookup:
    """The replay's spec lookup (the one :func:`kvstore.replay.make_replay_policy` builds)."""
    spec = cfg.spec
    return lambda fp: spec if fp == spec.fingerprint else None


class OracleReuseLRU(BeladyPolicy):
    """Leaf-first LRU that knows (only) whether a block is ever read again."""

    name = "oracle-reuse"

    def evict_key(self, meta: BlockMeta, tier: Tier, now: float) -> tuple[int, float, int]:
        return (0 if self.next_use(meta) == INF else 1, meta.last_access, -meta.depth)

    def rank(self, tier: Tier, candidates: Sequence[BlockMeta], now: float) -> list[BlockMeta]:
        return sorted(candidates, key=lambda m: self.evict_key(m, tier, now))


class _GivenProbability(ReuseEstimator):
    """A reuse estimator whose ``probability`` comes from its owner; the rest (classes, gap
    histograms) is learned online as usual."""

    __slots__ = ("owner",)

    def __init__(self, owner: _ProbabilityFrom, config: object) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        self.owner = owner

    def probability(self, meta: BlockMeta, c: int | None = None) -> float:
        return self.owner.given_probability(meta)


class _ProbabilityFrom(CostPolicy):
    def __init__(self, lookup: SpecLookup | None = None) -> None:
        super().__init__(lookup)
        self.reuse = _GivenProbability(self, self.config.reuse)

    def given_probability(self, meta: BlockMeta) -> float:
        raise NotImplementedError


class OracleProbabilityCost(_ProbabilityFrom):
    """The ``cost`` policy with ``p`` = ``hi`` for blocks read again, ``lo`` for the others."""

    name = "oracle-p"

    def __init__(self, lookup: SpecLookup | None = None, hi: float = 0.95, lo: float = 0.02) -> None:
        super().__init__(lookup)
        self.hi, self.lo = hi, lo
        self._oracle = BeladyPolicy()

    def bind_oracle(self, next_use: Callable[[bytes], float]) -> None:
        self._oracle.bind_oracle(next_use)

    def given_probability(self, meta: BlockMeta) -> float:
        return self.lo if self._oracle.next_use(meta) == INF else self.hi


def _gap_bucket(seconds: float | None) -> int:
    if seconds is None:
        return -1
    return min(max(int(math.log2(max(seconds, 0.25))) + 2, 0), 11)


def use_features(requests: Sequence[TraceRequest]) -> list[list[tuple[int, int, int, int]]]:
    """Per request, per block: (uses before, log2 bucket of the request's length in blocks,
    position from the request's end capped at 4, bucket of the seconds since the last use)."""
    uses: Counter[int] = Counter()
    last: dict[int, float] = {}
    out = []
    for req in requests:
        ids, t = req.hash_ids, req.timestamp_ms / 1000.0
        n = len(ids)
        row = []
        for d, h in enumerate(ids):
            gap = t - last[h] if h in last else None
            row.append((min(uses[h], 3), n.bit_length(), min(n - 1 - d, 4), _gap_bucket(gap)))
            uses[h] += 1
            last[h] = t
        out.append(row)
    return out


def fitted_rates(requests: Sequence[TraceRequest]) -> dict[tuple[bytes, int], float]:
    """(block key, its use number) -> the in-sample rate at which uses with the same features
    are followed by another use of the block (Laplace-smoothed)."""
    feats = use_features(requests)
    total: Counter[tuple] = Counter()
    again: Counter[tuple] = Counter()
    seen: set[int] = set()
    for req, row in zip(reversed(requests), reversed(feats)):
        for h, f in zip(reversed(req.hash_ids), reversed(row)):
            total[f] += 1
            if h in seen:
                again[f] += 1
            seen.add(h)
    rate = {f: (again[f] + 1) / (total[f] + 2) for f in total}
    uses: Counter[int] = Counter()
    out: dict[tuple[bytes, int], float] = {}
    for req, row in zip(requests, feats):
        for h, f in zip(req.hash_ids, row):
            out[(block_key(h), uses[h])] = rate[f]
            uses[h] += 1
    return out


class FittedFeaturesCost(_ProbabilityFrom):
    """The ``cost`` policy with ``p`` from :func:`fitted_rates` of the trace it replays."""

    name = "fitted-features"

    def __init__(self, requests: Sequence[TraceRequest], lookup: SpecLookup | None = None) -> None:
        super().__init__(lookup)
        self._rates = fitted_rates(requests)
        self._uses: Counter[bytes] = Counter()  # notifications so far = the block's use number

    def given_probability(self, meta: BlockMeta) -> float:
        return self._rates[(meta.key, self._uses[meta.key] - 1)]

    def on_insert(self, meta: BlockMeta, now: float) -> None:
        self._uses[meta.key] += 1
        super().on_insert(meta, now)

    def on_access(self, meta: BlockMeta, now: float) -> None:
        self._uses[meta.key] += 1
        super().on_access(meta, now)
