"""Request features of the reuse estimate: how a block's request refines its class's ``p``.

A *request* is what an engine does for one prompt: it reads the cached prefix and stores the new
blocks after it. The policy hears it as a chain of notifications (``on_access`` for the prefix,
then ``on_insert`` for the new blocks), each block the child of the one before. A block whose
parent is not the previous notification's block starts the next request, and the previous one
is then complete: its length (last depth + 1) is known, and so is each block's position from
its end. Both tell a lot about reuse and neither is known to the block alone: the last blocks
of a prompt are the ones the next prompt is least likely to share (the question after a shared
document, the tail a new turn rewrites), and long prompts come back more often than short ones
on some workloads and less on others (learned, not assumed).

Each read or insert starts an *episode* of the block, put in a *fine class*: the block's reuse
class (:func:`policy.reuse.reuse_class`) × log2 bucket of its request's length × position from
the end (0, 1, 2, 3, 4+), assigned when the request completes. The episode succeeds when the
block is read again (or stored again after it was evicted).

**Censoring.** Counting an episode as a trial at once and as a hit only when the read comes
(as :class:`policy.reuse.ReuseEstimator`'s coarse classes do) underrates every class while its
episodes are young, and most underrates the classes whose reads come late or whose episodes
arrive in bursts (one long request adds hundreds of episodes to one fine class at once). Here
time is split into bins (``HAZARD_EDGES_S``); per level (all episodes, a coarse class, a fine
class) and bin the table keeps the reads that ended an episode in the bin and the *time*
episodes spent in it, including episodes still open. The read rate of bin ``s`` is
``λ_s = reads_s / exposure_s`` (with a Gamma prior of ``prior`` bin-widths at the parent
level's rate: fine → coarse → all), and ``P(read again within the last edge) =
1 − exp(−Σ λ_s · width_s)``. Every episode counts for exactly the time it has been watched.

**Lift.** The estimate the cost policy is tuned on stays the coarse class's ``p``; the request
features multiply it by ``P(fine) / P(coarse)``, both from the censoring-corrected table (so
the bias of the coarse ``p`` is kept, and only the ranking within a class changes), capped at
``cap``. In the issue-3 replays the corrected ``P(coarse)`` alone, in place of the coarse
``p``, did worse (0.05 / 0.10 / 0.05 of the Mooncake LRU→Belady gap against 0.18 / 0.15 / 0.13):
the policy's thresholds expect the conservative level.

Time enters only through ``now`` arguments (the Store's injected clock).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvstore.block import BlockMeta
from kvstore.errors import InvalidArgument
from policy.base import parent_key

#: bin edges of the episode age, seconds: [0, 2), [2, 8), ..., [512, 2048); an episode not read
#: again within 2048 s is over
HAZARD_EDGES_S = (2.0, 8.0, 32.0, 128.0, 512.0, 2048.0)
#: request-length buckets (log2 of blocks: 1, 2-3, ..., 512+) and positions from the end (0..3, 4+)
LENGTH_BUCKETS = 10
POSITION_BUCKETS = 5
#: prior rate of the "all episodes" level: 5 % read again per bin, worth one bin-width
_GLOBAL_RATE = 0.05
_GLOBAL_PRIOR = 1.0
#: a coarse class's prior: four bin-widths at the all-episodes rate
_COARSE_PRIOR = 4.0


@dataclass(frozen=True, slots=True)
class RequestCell:
    """Where a block sat in its request."""

    length: int
    from_end: int

    def index(self) -> int:
        lb = min(max(self.length, 1).bit_length() - 1, LENGTH_BUCKETS - 1)
        return lb * POSITION_BUCKETS + min(max(self.from_end, 0), POSITION_BUCKETS - 1)


class RequestTracker:
    """Groups notifications into requests (see the module docstring).

    One more order is recognised: a Store put of a whole chain whose first blocks were already
    stored notifies the new blocks first and then touches the stored prefix. The new blocks form
    a request that starts under a parent outside it; when the very next request ends at that
    parent, it is the same prompt's prefix and takes that request's length."""

    __slots__ = ("_first_parent", "_open", "_prev", "_tail")

    def __init__(self) -> None:
        self._open: dict[bytes, int] = {}  # key -> depth, of the request being notified
        self._prev = b""
        self._first_parent = b""  # parent of the current request's first block
        # (parent of its first block, length) of the last request, when that parent was outside it
        self._tail: tuple[bytes, int] | None = None

    def track(self, meta: BlockMeta) -> dict[bytes, RequestCell]:
        """Record ``meta``'s notification; returns the cells of the request it completed
        (empty when it continues the current one)."""
        done: dict[bytes, RequestCell] = {}
        parent = parent_key(meta)  # b"" for a root (the Store's ROOT_KEY too)
        if not (parent and parent == self._prev):
            done = self.close()
            self._first_parent = parent
        self._open[meta.key] = meta.depth
        self._prev = meta.key
        return done

    def _length(self) -> int:
        tail = self._tail
        if tail is not None and tail[0] == self._prev:
            return tail[1]
        return self._open[self._prev] + 1

    def close(self) -> dict[bytes, RequestCell]:
        """Complete the current request; returns its blocks' cells."""
        if not self._open:
            return {}
        length = self._length()
        cells = {k: RequestCell(length, length - 1 - d) for k, d in self._open.items()}
        self._tail = (self._first_parent, length) if self._first_parent else None
        self._open = {}
        return cells

    def cell(self, key: bytes) -> RequestCell | None:
        """The cell of a block of the request still being notified, as it stands."""
        d = self._open.get(key)
        if d is None:
            return None
        length = self._length()
        return RequestCell(length, length - 1 - d)


class _Episode:
    __slots__ = ("bin", "coarse", "fine", "key", "start")

    def __init__(self, key: bytes, start: float, coarse: int) -> None:
        self.key, self.start, self.coarse = key, start, coarse
        self.fine = -1  # its fine class (coarse x cells + cell), once its request completes
        self.bin = 0  # -1 once over (read again, or older than the last edge)


class HazardTable:
    """Censoring-corrected read rates per level and age bin (see the module docstring).

    Levels: 0 = all episodes, ``1 + c`` = coarse class ``c``, ``1 + n_coarse + c·cells + k``
    = request cell ``k`` of coarse class ``c`` (a fine class). Time is what :meth:`advance`
    was last given, never earlier: a notification stamped before the latest one seen (a Store
    restoring its NVMe index, threads taking the clock in one order and the policy's lock in
    another) counts as happening at the latest time."""

    def __init__(self, n_coarse: int, cells: int, edges: tuple[float, ...] = HAZARD_EDGES_S,
                 half_life_episodes: int = 50_000, max_watched: int = 250_000) -> None:
        if not edges or any(b <= a for a, b in zip((0.0, *edges), edges)):
            raise InvalidArgument("hazard edges must be positive and increasing")
        if max_watched <= 0:
            raise InvalidArgument("max_watched must be positive")
        self.edges = edges
        self.lows = (0.0, *edges[:-1])
        self.widths = tuple(e - lo for e, lo in zip(edges, self.lows))
        self.n_coarse, self.cells = n_coarse, cells
        levels = 1 + n_coarse + n_coarse * cells
        nb = len(edges)
        self._reads = [[0.0] * nb for _ in range(levels)]
        self._exposure = [[0.0] * nb for _ in range(levels)]  # of episodes that left the bin
        self._inside = [[0] * nb for _ in range(levels)]  # episodes in the bin now
        self._entered = [[0.0] * nb for _ in range(levels)]  # sum of their entry times
        self._queues: list[deque[_Episode]] = [deque() for _ in range(nb)]
        self._episodes: dict[bytes, _Episode] = {}
        self._half_life = half_life_episodes
        self._max_watched = max_watched
        self._queued = 0  # entries in the queues: open episodes and finished ones not yet dropped
        self._started = 0
        self._now = 0.0
        self._coarse_cache: dict[int, list[float]] = {}

    def _levels(self, ep: _Episode) -> tuple[int, ...]:
        if ep.fine < 0:
            return (0, 1 + ep.coarse)
        return (0, 1 + ep.coarse, 1 + self.n_coarse + ep.fine)

    def _enter(self, s: int, at: float, levels: tuple[int, ...]) -> None:
        for lv in levels:
            self._inside[lv][s] += 1
            self._entered[lv][s] += at

    def _leave(self, ep: _Episode, at: float, read: bool) -> None:
        s = ep.bin
        entry = ep.start + self.lows[s]
        for lv in self._levels(ep):
            self._inside[lv][s] -= 1
            self._entered[lv][s] -= entry
            self._exposure[lv][s] += at - entry
            if read:
                self._reads[lv][s] += 1.0

    def advance(self, now: float) -> float:
        """Move every open episode to the bin of its age at ``now`` (or at the latest time
        seen, if later); returns the table's time."""
        if now <= self._now:
            return self._now
        self._coarse_cache = {}
        self._now = now
        last = len(self.edges) - 1
        for s, q in enumerate(self._queues):
            edge = self.edges[s]
            while q and q[0].start + edge <= now:
                ep = q.popleft()
                self._queued -= 1
                if ep.bin != s:
                    continue  # over already
                at = ep.start + edge
                self._leave(ep, at, read=False)
                if s == last:
                    ep.bin = -1
                    if self._episodes.get(ep.key) is ep:
                        del self._episodes[ep.key]
                    continue
                ep.bin = s + 1
                self._enter(s + 1, at, self._levels(ep))
                self._queues[s + 1].append(ep)
                self._queued += 1
        return now

    def read(self, key: bytes) -> None:
        """``key`` is read (or stored again) now: its open episode, if any, succeeds."""
        ep = self._episodes.pop(key, None)
        if ep is not None and ep.bin >= 0:
            self._leave(ep, self._now, read=True)
            ep.bin = -1

    def start(self, key: bytes, coarse: int) -> None:
        """Open an episode of ``key`` now, in coarse class ``coarse`` (after :meth:`read`)."""
        self._started += 1
        if self._started % self._half_life == 0:
            for table in (self._reads, self._exposure):
                for row in table:
                    row[:] = [x * 0.5 for x in row]
        ep = _Episode(key, self._now, coarse)
        self._episodes[key] = ep
        self._enter(0, self._now, self._levels(ep))
        self._queues[0].append(ep)
        self._queued += 1
        if self._queued > self._max_watched:
            self._stop_watching_oldest()

    def _stop_watching_oldest(self) -> None:
        """Bound memory: stop watching the oldest episodes (the fronts of the highest bins) until
        at most ``max_watched`` are queued. Their time so far counts, their outcome does not
        (censored, like an episode still open)."""
        for s in range(len(self._queues) - 1, -1, -1):
            q = self._queues[s]
            while q and self._queued > self._max_watched:
                ep = q.popleft()
                self._queued -= 1
                if ep.bin != s:
                    continue  # over already
                self._leave(ep, self._now, read=False)
                ep.bin = -1
                if self._episodes.get(ep.key) is ep:
                    del self._episodes[ep.key]
            if self._queued <= self._max_watched:
                return

    def set_cell(self, key: bytes, cell: int) -> None:
        """Put ``key``'s open episode in request cell ``cell`` of its coarse class, from its
        current bin on (its time before that counts in the coarse levels only)."""
        ep = self._episodes.get(key)
        if ep is None or ep.bin < 0 or ep.fine >= 0:
            return
        ep.fine = ep.coarse * self.cells + cell
        lv = 1 + self.n_coarse + ep.fine
        self._inside[lv][ep.bin] += 1
        self._entered[lv][ep.bin] += ep.start + self.lows[ep.bin]

    def _rates(self, level: int, parent: list[float], prior: float) -> list[float]:
        now, w = self._now, self.widths
        reads, exp = self._reads[level], self._exposure[level]
        inside, entered = self._inside[level], self._entered[level]
        return [(reads[s] + prior * w[s] * parent[s])
                / (exp[s] + inside[s] * now - entered[s] + prior * w[s]) for s in range(len(w))]

    def coarse_rates(self, coarse: int) -> list[float]:
        rates = self._coarse_cache.get(coarse)
        if rates is None:
            top = self._coarse_cache.get(-1)
            if top is None:
                top = self._coarse_cache[-1] = self._rates(
                    0, [_GLOBAL_RATE / w for w in self.widths], _GLOBAL_PRIOR)
            rates = self._coarse_cache[coarse] = self._rates(1 + coarse, top, _COARSE_PRIOR)
        return rates

    def fine_rates(self, coarse: int, cell: int, prior: float) -> list[float]:
        """Rates of request cell ``cell`` of ``coarse``, with the coarse rates as a prior worth
        ``prior`` bin-widths."""
        return self._rates(1 + self.n_coarse + coarse * self.cells + cell,
                           self.coarse_rates(coarse), prior)

    def probability(self, rates: list[float]) -> float:
        """P(read again within the last edge) under piecewise-constant ``rates``."""
        return -math.expm1(-sum(r * w for r, w in zip(rates, self.widths)))


class RequestLift:
    """Feeds a :class:`HazardTable` from the notifications and answers the lift of a block's
    fine class over its coarse class."""

    def __init__(self, n_coarse: int, prior: float = 8.0, half_life_episodes: int = 50_000,
                 max_watched: int = 250_000) -> None:
        self.table = HazardTable(n_coarse, LENGTH_BUCKETS * POSITION_BUCKETS,
                                 half_life_episodes=half_life_episodes, max_watched=max_watched)
        self.tracker = RequestTracker()
        self.prior = prior
        self._fine: dict[bytes, int] = {}  # key -> request cell of its last completed request

    def observe(self, meta: BlockMeta, coarse: int, now: float) -> None:
        """``meta`` was read or stored at ``now`` (its coarse class ``coarse``, as it stands
        after the notification)."""
        self.table.advance(now)
        self.table.read(meta.key)
        for key, cell in self.tracker.track(meta).items():
            self._fine[key] = cell.index()
            self.table.set_cell(key, cell.index())
        self._fine.pop(meta.key, None)
        self.table.start(meta.key, coarse)

    def forget(self, key: bytes) -> None:
        """``key`` left the store: its request cell is no longer needed (its episode stays
        open, so a return is still counted)."""
        self._fine.pop(key, None)

    def cell(self, key: bytes) -> int | None:
        """The block's request cell (``RequestCell.index``): of its completed request, or of the
        request still being notified as it stands; None if unknown."""
        got = self._fine.get(key)
        if got is not None:
            return got
        cell = self.tracker.cell(key)
        return None if cell is None else cell.index()

    def lift(self, key: bytes, coarse: int) -> float | None:
        """P(fine) / P(coarse) for the block's request cell in ``coarse``; None if unknown."""
        cell = self.cell(key)
        if cell is None:
            return None
        t = self.table
        pc = t.probability(t.coarse_rates(coarse))
        pf = t.probability(t.fine_rates(coarse, cell, self.prior))
        return pf / max(pc, 1e-6)
