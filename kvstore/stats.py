"""Counters: named monotonic counts kept by the Store (under its lock) and a drainable
event queue for exporters, so metrics never reach into the Store's internals.

:data:`STORE_COUNTERS` names every count the Store keeps; the Store's :class:`Counters` start
with each of them at 0 (:func:`store_counter_names`), so ``Store.stats()["counters"]`` and the
``kvstore_store_counters_*`` gauges exported from it hold every one from the start.
NOTE: a count appeared only at its first event, already at 1: Prometheus' ``increase()`` and
``rate()`` never saw that event, and an alert on the first NVMe commit failure or quota
rejection never fired. A name counted anywhere must be listed here (a test greps the code).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from kvstore.block import Tier

#: every count the Store keeps under one name (what each counts: at its ``counters.add``)
STORE_COUNTERS: tuple[str, ...] = (
    # reads
    "lookups", "hits", "misses", "hits_remote", "integrity_failures",
    # writes and moves
    "blocks_put", "flushed", "evictions", "paused_evictions", "demotions", "promotions",
    "pause_left_in_hbm", "nvme_ancestor_copies", "nvme_copies_dropped", "nvme_damaged_deletes",
    "nvme_commit_failures", "nvme_write_failures", "quota_rejections",
    # removals
    "expired", "deleted", "deleted_elsewhere", "ttl_capped", "evicted_at_close", "dropped_at_close",
    "orphans_dropped", "keyless_dropped", "unreadable_dropped",
    # sessions
    "sessions_idle_paused", "sessions_idle_closed", "sessions_admin_closed",
    # the remote tier, as the Store sees it
    "demotions_remote", "promotions_remote", "remote_queue_full", "remote_skipped_deleted",
    "remote_copy_kept", "remote_copy_check_refused",
)
#: the counts kept per local tier (``{tier}``) and per pair of them (``{src}``, ``{dest}``)
STORE_TIER_COUNTERS: tuple[str, ...] = ("hits_{tier}",)
STORE_PAIR_COUNTERS: tuple[str, ...] = ("moved_{src}_to_{dest}", "bytes_{src}_to_{dest}")


def store_counter_names() -> list[str]:
    """Every count the Store keeps: :data:`STORE_COUNTERS`, and the per-tier and per-pair ones
    for each local tier (HBM, DRAM, NVMe; the ones a store does not have stay at 0)."""
    tiers = [t.label for t in Tier if t != Tier.REMOTE]
    return [*STORE_COUNTERS,
            *(f.format(tier=t) for f in STORE_TIER_COUNTERS for t in tiers),
            *(f.format(src=s, dest=d) for f in STORE_PAIR_COUNTERS for s in tiers for d in tiers if s != d)]


class Counters:
    """``names``: the counts that exist from the start, at 0 (others appear at their first
    event)."""

    def __init__(self, max_events: int = 10_000, names: Iterable[str] = ()) -> None:
        self._counts: Counter[str] = Counter(dict.fromkeys(names, 0))
        self._events: deque[tuple[str, int]] = deque(maxlen=max_events)

    def add(self, name: str, n: int = 1) -> None:
        if n:
            self._counts[name] += n
            self._events.append((name, n))

    def get(self, name: str) -> int:
        return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, Any]:
        """Every count: the seeded ones (0 until counted) and any other counted so far."""
        return dict(self._counts)

    def take_events(self) -> list[tuple[str, int]]:
        """Drain the (name, increment) events recorded since the last call."""
        out = list(self._events)
        self._events.clear()
        return out
