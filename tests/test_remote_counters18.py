"""The remote tier's counters (``remote_*`` in the Store's counters and the
``kvstore_store_counters_remote_*`` gauges) exist from the start, at 0: like the Store's
(68fc5ca), they appeared only at their first event, already at 1, so Prometheus' increase() and
rate() missed it and an alert on the first remote fault never fired. The last test greps tiers/
for every name counted, so a new counter that is not in the list fails here."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import make_kv, tokens

from tiers.remote import REMOTE_COUNTERS

ROOT = Path(__file__).resolve().parents[1]
_COUNTED = (r'_count\("([a-z_]+)"', r'_counts\["([a-z_]+)"\]', r'_refused\("([a-z_]+)"')


def test_a_fresh_remote_tier_reports_every_counter_at_zero(servers, spec):
    s = servers("a")
    counters = s.stats()["counters"]
    for name in REMOTE_COUNTERS:
        assert counters[f"remote_{name}"] == 0, name  # was absent until its first event
    s.put("acme", spec, s.block_keys("acme", spec, tokens(1, spec)), make_kv(spec, 1))
    s.flush()
    assert s.stats()["counters"]["remote_puts"] >= 1


def test_every_name_counted_in_tiers_is_listed():
    src = "\n".join(p.read_text() for p in sorted((ROOT / "tiers").glob("*.py")))
    counted = {n for pattern in _COUNTED for n in re.findall(pattern, src)}
    # the counters error_reply names (counted as self._count(kind))
    counted |= {"oom", "error_replies"}
    missing = counted - set(REMOTE_COUNTERS)
    assert not missing, f"counted in tiers/ but not in REMOTE_COUNTERS: {sorted(missing)}"
    unused = set(REMOTE_COUNTERS) - counted
    assert not unused, f"listed but counted nowhere: {sorted(unused)}"
