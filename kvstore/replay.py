"""Trace replay: a tiered prefix cache driven by the Store's policy classes (issue 3).

Cache model (exactly the issue's):

* The cache is a prefix tree of blocks, one per trace hash id. A request hits on the longest
  prefix of its ``hash_ids`` that is resident in any tier.
* Tier order: along every root→leaf path a block sits in the same or a faster tier than its
  descendants. (So a resident block's ancestors are all resident.)
* Hits in DRAM/NVMe are promoted to HBM; missed blocks are computed in HBM and inserted there.
  The blocks of the request being served are pinned until it is done.
* When a tier is full, the policy picks a victim among the candidates the Store would offer —
  unpinned, no resident child in the same tier (leaf-first) — through ``rank``; ``demote_to``
  says where it goes (only tiers that keep the tier order are offered), and the lower tier's
  ``admit`` may refuse it; a tier that refuses it or cannot make room sends it on to the next
  the policy names. A dropped block takes its (slower-tier) descendants with it, since
  they can no longer be reached.

The policy is called through :class:`policy.base.EvictionPolicy` exactly as the Store calls it.
Two optional capabilities (:class:`policy.registry.KeyedPolicy` and ``OraclePolicy``) let a policy
give a per-block sort key instead of a full ``rank`` each time, and let the offline reference see
the future. Candidates are kept incrementally: a lazy heap per tier for keyed policies, a set
per tier otherwise.

Accounting: time saved by a hit = recompute − restore from the tier it was found in (0 from HBM);
``net_saved_time_fraction`` = Σ savings / Σ recompute time of every block of every request.

What the model is, and is not (read the figures with these in mind):

* **Exclusive tiers.** A block lives in exactly one tier: promoted from NVMe (or DRAM) to HBM,
  it leaves NVMe, and a later demotion writes it to NVMe again. The Store is not exclusive: a
  block committed to NVMe keeps that copy when it is read back, and demoting it again writes
  nothing. So ``bytes_written_by_tier["nvme"]`` (the "NVMe TB written" of the README) is the
  replay model's count, above what the Store would write for the same reads.
* **``belady`` is a reference, not an optimum.** It is Belady's MIN (evict the block used
  furthest in the future) applied per tier, with the same leaf-first and demotion rules as the
  other policies. It is not an optimum of the multi-tier problem: it counts next uses, not
  what a restore from each tier costs or where a victim is best demoted, so another policy can
  save more prefill time than it (a 16-request trace in ``tests/test_replay_fixes16.py``, HBM
  2 / DRAM 1 / NVMe 1 blocks with NVMe at 1 GB/s: Belady hits more tokens, LRU saves more
  time). A "gap closed" figure, (policy − lru) / (belady − lru), can then exceed 100 % or be
  undefined.
* **One namespace.** Blocks are keyed by hash id only (:func:`block_key`); a request's
  ``tenant`` is recorded in the block's metadata, which policies may use, but not in its key.
  Two tenants whose requests carry the same ids share those blocks, as if every prefix were in
  one shared namespace; the Store keeps tenants apart unless a namespace is explicitly shared,
  so a trace whose tenants share ids replays more hits than the Store would give them.
* **TTL** (``ReplayConfig.ttl_s``, none by default; the Mooncake trace carries none): every
  block gets the deadline ``insert time + ttl_s``, as a Store put with that TTL does; a hit
  does not extend it (a get does not), a block dropped and computed again gets a new one.
  Before each request the blocks whose deadline has passed (``now >= deadline``) are removed
  with their subtrees (unreachable without them), counted in ``expired_blocks``, not as
  evictions. ``belady``'s future knows next uses, not expiry.
* **Token counts.** Only a request's last block may be partial, and an id covers the same
  tokens wherever it appears; :func:`kvstore.workloads.load_trace` refuses a file that breaks
  this (a trace built in memory is taken as given).
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.block import BlockMeta, Tier
from kvstore.errors import InvalidArgument
from kvstore.spec import ModelSpec
from kvstore.workloads import TraceRequest
from policy.base import EvictionPolicy, make_policy
from policy.cost_model import CostModel, CostModelConfig
from policy.registry import KeyedPolicy, OraclePolicy, TieredPolicy

TIERS = (Tier.HBM, Tier.DRAM, Tier.NVME)
_NO_TIER = -1


def replay_spec(
    num_layers: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: str = "float16",
    block_tokens: int = 512,
    num_params: int = 8_000_000_000,
    hidden_size: int = 4096,
) -> ModelSpec:
    """The replay's model: Llama-3-8B-like by default."""
    return ModelSpec(
        model="replay-model", revision="0", num_layers=num_layers, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, block_tokens=block_tokens, num_params=num_params,
        hidden_size=hidden_size,
    )


@dataclass(slots=True, frozen=True)
class ReplayConfig:
    """Capacities in blocks (0 = the tier does not exist) and the cost model."""

    hbm_blocks: int
    dram_blocks: int
    nvme_blocks: int
    spec: ModelSpec = field(default_factory=replay_spec)
    costs: CostModelConfig = field(default_factory=CostModelConfig)
    ttl_s: float | None = None
    """TTL of every block, seconds of trace time (None: blocks never expire)."""

    def __post_init__(self) -> None:
        if self.hbm_blocks <= 0:
            raise InvalidArgument(f"hbm_blocks must be positive, got {self.hbm_blocks}")
        if self.ttl_s is not None and not (isinstance(self.ttl_s, (int, float)) and 0 < self.ttl_s < math.inf):
            raise InvalidArgument(f"ttl_s must be a finite number of seconds > 0, got {self.ttl_s!r}")
        if self.dram_blocks < 0 or self.nvme_blocks < 0:
            raise InvalidArgument("dram_blocks and nvme_blocks must be >= 0")

    @classmethod
    def with_defaults(cls, hbm_blocks: int, dram_blocks: int | None = None,
                      nvme_blocks: int | None = None, **kw: object) -> ReplayConfig:
        """DRAM = 3×HBM and NVMe = 10×HBM unless given."""
        return cls(hbm_blocks=hbm_blocks,
                   dram_blocks=3 * hbm_blocks if dram_blocks is None else dram_blocks,
                   nvme_blocks=10 * hbm_blocks if nvme_blocks is None else nvme_blocks,
                   **kw)  # type: ignore[arg-type]


@dataclass(slots=True)
class ReplayResult:
    policy: str
    requests: int = 0
    total_tokens: int = 0
    hit_tokens: int = 0
    total_blocks: int = 0
    total_flops: float = 0.0
    saved_flops: float = 0.0
    total_recompute_s: float = 0.0
    net_saved_s: float = 0.0
    block_hits_by_tier: dict[str, int] = field(default_factory=lambda: {t.label: 0 for t in TIERS})
    bytes_written_by_tier: dict[str, int] = field(default_factory=lambda: {t.label: 0 for t in TIERS})
    evictions_by_tier: dict[str, int] = field(default_factory=lambda: {t.label: 0 for t in TIERS})
    drops_by_tier: dict[str, int] = field(default_factory=lambda: {t.label: 0 for t in TIERS})
    bytes_promoted: int = 0
    refused_inserts: int = 0
    expired_blocks: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def saved_flops_fraction(self) -> float:
        return self.saved_flops / self.total_flops if self.total_flops else 0.0

    @property
    def net_saved_time_fraction(self) -> float:
        return self.net_saved_s / self.total_recompute_s if self.total_recompute_s else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "total_blocks": self.total_blocks,
            "token_hit_rate": self.token_hit_rate,
            "block_hits_by_tier": dict(self.block_hits_by_tier),
            "saved_flops_fraction": self.saved_flops_fraction,
            "net_saved_time_fraction": self.net_saved_time_fraction,
            "net_saved_s": self.net_saved_s,
            "total_recompute_s": self.total_recompute_s,
            "bytes_written_by_tier": dict(self.bytes_written_by_tier),
            "bytes_promoted": self.bytes_promoted,
            "evictions_by_tier": dict(self.evictions_by_tier),
            "drops_by_tier": dict(self.drops_by_tier),
            "refused_inserts": self.refused_inserts,
            "expired_blocks": self.expired_blocks,
        }


class NextUseOracle:
    """Future knowledge for the offline reference: which request uses a block next.

    ``advance(i)`` moves the cursor to request ``i``; ``next_use(key)`` is then the index of the
    first request after ``i`` that contains the block (``inf`` when none).
    """

    __slots__ = ("_cursor", "_occ")

    def __init__(self, requests: Sequence[TraceRequest]) -> None:
        occ: dict[bytes, list[int]] = {}
        for i, req in enumerate(requests):
            for h in req.hash_ids:
                occ.setdefault(block_key(h), []).append(i)
        self._occ = occ
        self._cursor = -1

    def advance(self, index: int) -> None:
        self._cursor = index

    def next_use(self, key: bytes) -> float:
        occ = self._occ.get(key)
        if not occ:
            return float("inf")
        j = bisect_right(occ, self._cursor)
        return float(occ[j]) if j < len(occ) else float("inf")


def make_replay_policy(name: str, cfg: ReplayConfig) -> EvictionPolicy:
    """A registered policy whose spec lookup knows the replay's model (InvalidArgument if the
    name is unknown). Policies that take a cost config get ``cfg.costs``."""
    spec = cfg.spec

    def lookup(fp: bytes) -> ModelSpec | None:
        return spec if fp == spec.fingerprint else None

    policy = make_policy(name, lookup)
    if cfg.costs != CostModelConfig():
        # NOTE: registry factories take only a spec lookup; rebuild the cost-aware policies
        # with the replay's rates so the flags reach them.
        from policy.cost import CostPolicy, CostPolicyConfig
        from policy.gdsf import GDSFPolicy

        if isinstance(policy, CostPolicy):
            policy = CostPolicy(lookup, CostPolicyConfig(costs=cfg.costs))
        elif isinstance(policy, GDSFPolicy):
            policy = GDSFPolicy(lookup, cfg.costs)
    return policy


def block_key(hash_id: int) -> bytes:
    """The replay's block key for a trace hash id (8-byte big-endian, signed); InvalidArgument
    for an id outside the signed 64-bit range (:func:`kvstore.workloads.load_trace` refuses
    those in a trace file; this catches them in a trace built in memory)."""
    try:
        return hash_id.to_bytes(8, "big", signed=True)
    except OverflowError:
        raise InvalidArgument(f"hash id {hash_id} is outside the signed 64-bit range") from None


class _Sim:
    """The cache state of one replay. Node = index into the per-node lists."""

    def __init__(self, cfg: ReplayConfig, policy: EvictionPolicy, fingerprint: bytes) -> None:
        self.cfg = cfg
        self.policy = policy
        self.fp = fingerprint
        self.keyed = policy if isinstance(policy, KeyedPolicy) else None
        self.cap = [cfg.hbm_blocks, cfg.dram_blocks, cfg.nvme_blocks]
        self.used = [0, 0, 0]
        self.index: dict[int, int] = {}
        self.parent: list[int] = []
        self.kids: list[list[int]] = []
        self.tier: list[int] = []
        self.kid_tiers: list[list[int]] = []  # resident children per tier
        self.meta: list[BlockMeta | None] = []
        self.ver: list[int] = []
        self.heaps: list[list[tuple]] = [[], [], []]
        self.cands: list[dict[int, None]] = [{}, {}, {}]
        self.seq = itertools.count()
        self.now = 0.0
        self.deadlines: list[tuple[float, int, int, BlockMeta]] = []  # (deadline, seq, node, meta)
        self.nbytes = cfg.spec.block_nbytes
        self.result = ReplayResult(policy=policy.name)
        if isinstance(policy, TieredPolicy):  # as the Store's placement does
            policy.bind_tiers([t for t in TIERS if self.cap[t] > 0])

    # -- tree bookkeeping -----------------------------------------------------------------
    def node(self, hash_id: int, parent: int) -> int:
        n = self.index.get(hash_id)
        if n is not None:
            if self.parent[n] != parent:
                raise InvalidArgument(f"hash id {hash_id} appears under two different parents")
            return n
        n = len(self.parent)
        self.index[hash_id] = n
        self.parent.append(parent)
        self.kids.append([])
        self.tier.append(_NO_TIER)
        self.kid_tiers.append([0, 0, 0])
        self.meta.append(None)
        self.ver.append(0)
        if parent >= 0:
            self.kids[parent].append(n)
        return n

    def is_candidate(self, n: int) -> bool:
        t = self.tier[n]
        m = self.meta[n]
        return t != _NO_TIER and m is not None and m.pins == 0 and self.kid_tiers[n][t] == 0

    def touch(self, n: int) -> None:
        """Re-file ``n`` after any change that may alter its candidacy or its key."""
        self.ver[n] += 1
        if self.keyed is None:
            for t in range(3):
                self.cands[t].pop(n, None)
            if self.is_candidate(n):
                self.cands[self.tier[n]][n] = None
            return
        if self.is_candidate(n):
            t = self.tier[n]
            key = self.keyed.evict_key(self.meta[n], Tier(t), self.now)
            heap = self.heaps[t]
            heapq.heappush(heap, (key, next(self.seq), n, self.ver[n]))
            if len(heap) > 8 * self.cap[t] + 4096:
                self.heaps[t] = [e for e in heap if e[3] == self.ver[e[2]] and self.is_candidate(e[2])]
                heapq.heapify(self.heaps[t])

    def pick(self, t: int) -> int | None:
        if self.keyed is None:
            cands = [self.meta[n] for n in self.cands[t]]
            ranked = self.policy.rank(Tier(t), cands, self.now)  # type: ignore[arg-type]
            if not ranked:
                return None
            return self.index[int.from_bytes(ranked[0].key, "big", signed=True)]
        heap = self.heaps[t]
        while heap:
            _, _, n, v = heap[0]
            if v == self.ver[n] and self.tier[n] == t and self.is_candidate(n):
                return n
            heapq.heappop(heap)
        return None

    def set_tier(self, n: int, new: int) -> None:
        old = self.tier[n]
        if old != _NO_TIER:
            self.used[old] -= 1
        if new != _NO_TIER:
            self.used[new] += 1
        self.tier[n] = new
        m = self.meta[n]
        if m is not None and new != _NO_TIER:
            m.tier = Tier(new)
        p = self.parent[n]
        if p >= 0:
            pm = self.meta[p]
            if old != _NO_TIER:
                self.kid_tiers[p][old] -= 1
            if new != _NO_TIER:
                self.kid_tiers[p][new] += 1
            if pm is not None:
                pm.children += (new != _NO_TIER) - (old != _NO_TIER)
            if self.tier[p] != _NO_TIER:
                self.touch(p)
        self.touch(n)

    # -- eviction -------------------------------------------------------------------------
    def make_room(self, t: int) -> bool:
        """Free one slot in tier ``t`` (evicting as the policy says); False if impossible."""
        if self.cap[t] <= 0:
            return False
        while self.used[t] >= self.cap[t]:
            v = self.pick(t)
            if v is None:
                return False
            self.evict(v, t)
        return True

    def offered(self, n: int, src: int) -> list[Tier]:
        """The tiers ``n`` may be demoted to from ``src``: slower ones that exist, none below
        the fastest tier holding a child of its (tier order)."""
        kt = self.kid_tiers[n]
        lowest = next((t for t in range(3) if kt[t]), 3)  # fastest tier holding a child
        return [Tier(t) for t in range(src + 1, min(lowest, 2) + 1) if self.cap[t] > 0]

    def evict(self, n: int, src: int) -> None:
        res = self.result
        res.evictions_by_tier[TIERS[src].label] += 1
        avail = self.offered(n, src)
        meta = self.meta[n]
        assert meta is not None and meta.pins == 0
        # NOTE: as the Store's Placement.evict: when the tier the policy names cannot make room
        # (or does not admit the victim), the policy is asked again with the tiers after it;
        # only the first was tried, and a victim was dropped while NVMe had room
        dest = self.policy.demote_to(meta, Tier(src), avail, self.now)  # also with none: it learns
        while dest is not None:
            if dest not in avail:
                raise InvalidArgument(f"policy {res.policy} demoted to {dest!r}, not in {avail}")
            if self.policy.admit(meta, dest, self.now):
                # Protect the victim while the lower tier makes room (it may cascade).
                meta.pins += 1
                ok = self.make_room(int(dest))
                meta.pins -= 1
                if ok:
                    res.bytes_written_by_tier[dest.label] += meta.nbytes
                    self.set_tier(n, int(dest))
                    return
            avail = [t for t in self.offered(n, src) if t > dest]  # making room may move a child
            dest = self.policy.demote_to(meta, Tier(src), avail, self.now) if avail else None
        res.drops_by_tier[TIERS[src].label] += 1
        self.drop(n)

    def expire(self) -> None:
        """Remove the blocks whose TTL deadline has passed, with their subtrees."""
        heap = self.deadlines
        while heap and heap[0][0] <= self.now:
            _, _, n, m = heapq.heappop(heap)
            if self.meta[n] is m:  # else dropped (and maybe computed again) since
                self.result.expired_blocks += 1
                self.drop(n, expiry=True)

    def drop(self, n: int, expiry: bool = False) -> None:
        for c in self.kids[n]:
            if self.tier[c] != _NO_TIER:
                if expiry:
                    self.result.expired_blocks += 1
                else:
                    self.result.evictions_by_tier[TIERS[self.tier[c]].label] += 1
                    self.result.drops_by_tier[TIERS[self.tier[c]].label] += 1
                self.drop(c, expiry)
        meta = self.meta[n]
        assert meta is not None
        self.set_tier(n, _NO_TIER)
        self.policy.on_remove(meta)
        self.meta[n] = None
        self.touch(n)

    # -- one request ----------------------------------------------------------------------
    def serve(self, req: TraceRequest, model: CostModel, before: Callable[[], None] | None) -> None:
        res = self.result
        self.now = req.timestamp_ms / 1000.0
        ttl = self.cfg.ttl_s
        if ttl is not None:
            self.expire()
        bt = self.cfg.spec.block_tokens
        ids = req.hash_ids
        nodes: list[int] = []
        parent = -1
        for h in ids:
            parent = self.node(h, parent)
            nodes.append(parent)
        if before is not None:
            before()
        res.requests += 1
        tokens = [bt] * len(ids)
        if ids:
            tokens[-1] = max(1, min(bt, req.input_length - bt * (len(ids) - 1)))
        k = 0
        while k < len(nodes) and self.tier[nodes[k]] != _NO_TIER:
            k += 1
        for i, n in enumerate(nodes):
            rec = model.recompute_flops(tokens[i], i)
            res.total_flops += rec
            res.total_recompute_s += rec / model.config.flops_per_s
            res.total_tokens += tokens[i]
            res.total_blocks += 1
            if i < k:
                m = self.meta[n]
                assert m is not None
                t = Tier(self.tier[n])
                res.block_hits_by_tier[t.label] += 1
                res.hit_tokens += tokens[i]
                res.saved_flops += rec
                res.net_saved_s += model.saving(tokens[i], i, m.nbytes, t)
                m.pins += 1
                m.last_access = self.now
                m.access_count += 1
                self.policy.on_access(m, self.now)
                self.touch(n)
        promoted = True
        for n in nodes[:k]:  # promote the hit prefix, root first
            if self.tier[n] == Tier.HBM:
                continue
            m = self.meta[n]
            assert m is not None
            if not promoted or not self.make_room(Tier.HBM):
                promoted = False
                continue
            res.bytes_promoted += m.nbytes
            res.bytes_written_by_tier["hbm"] += m.nbytes
            self.set_tier(n, Tier.HBM)
        pinned = list(nodes[:k])
        ok = promoted
        for i in range(k, len(nodes)):
            n = nodes[i]
            if not ok or not self.make_room(Tier.HBM):
                ok = False
                res.refused_inserts += 1
                continue
            p = self.parent[n]
            m = BlockMeta(
                key=block_key(ids[i]), tenant=req.tenant, fingerprint=self.fp,
                parent=block_key(ids[i - 1]) if i else b"", depth=i, nbytes=self.nbytes,
                tokens=tokens[i], tier=Tier.HBM, created=self.now, last_access=self.now,
                access_count=1, pins=1,
                children=sum(1 for c in self.kids[n] if self.tier[c] != _NO_TIER),
                ttl_deadline=None if ttl is None else self.now + ttl,
            )
            if ttl is not None:
                heapq.heappush(self.deadlines, (self.now + ttl, next(self.seq), n, m))
            assert p < 0 or self.tier[p] == Tier.HBM
            self.meta[n] = m
            self.policy.on_insert(m, self.now)
            res.bytes_written_by_tier["hbm"] += m.nbytes
            self.set_tier(n, Tier.HBM)
            pinned.append(n)
        for n in pinned:
            m = self.meta[n]
            assert m is not None
            m.pins -= 1
            self.touch(n)


def run_replay(
    requests: Sequence[TraceRequest],
    cfg: ReplayConfig,
    policy: EvictionPolicy,
    progress: Callable[[int], None] | None = None,
    check_invariants: bool = False,
) -> ReplayResult:
    """Replay ``requests`` in order through ``policy``; returns the accounting.

    ``progress(n)`` is called every 100 requests with the count done. ``check_invariants``
    verifies capacities, pins and tier order after every request (slow; for tests).
    """
    model = CostModel(cfg.spec, cfg.costs)
    sim = _Sim(cfg, policy, cfg.spec.fingerprint)
    oracle: NextUseOracle | None = None
    if isinstance(policy, OraclePolicy):
        oracle = NextUseOracle(requests)
        policy.bind_oracle(oracle.next_use)
    for i, req in enumerate(requests):
        before = (lambda i=i: oracle.advance(i)) if oracle is not None else None
        sim.serve(req, model, before)
        if check_invariants:
            check_state(sim)
        if progress is not None and (i + 1) % 100 == 0:
            progress(i + 1)
    if progress is not None:
        progress(len(requests))
    return sim.result


def check_state(sim: _Sim) -> None:
    """Assert the replay's invariants (capacity, no pins left, tier order, counts)."""
    used = [0, 0, 0]
    for n, t in enumerate(sim.tier):
        if t == _NO_TIER:
            continue
        used[t] += 1
        m = sim.meta[n]
        assert m is not None and m.pins == 0 and int(m.tier) == t
        p = sim.parent[n]
        assert p < 0 or (sim.tier[p] != _NO_TIER and sim.tier[p] <= t), "tier order broken"
    for t in range(3):
        assert used[t] == sim.used[t] <= sim.cap[t], (t, used, sim.used, sim.cap)
