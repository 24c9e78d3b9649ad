"""The trace twice: how each policy does after a first pass of learning (issue 3's analysis).

A store runs for days, and a replay of a 17-minute trace sees mostly its first minutes. This
replays the trace, then a copy of it with new hash ids (nothing of the first pass is read
again) that starts a minute after the first ends, through one policy object. The second pass's
figures are the doubled replay's minus the single one's (the first pass of the doubled replay is
that single replay, step for step). A policy that keeps blocks the first pass valued, after
they stopped being read, loses capacity in the second pass; LRU flushes them within one
turnover.

JSON on stdout, a table on stderr (gap closed = (x − lru) / (belady − lru)).

    python -m bench.replay_repeat --capacities 400,1000,1500
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from bench.replay_bench import POLICIES, gap_closed, trace_and_capacities
from kvstore.replay import ReplayConfig, make_replay_policy, run_replay
from kvstore.workloads import TraceRequest, load_trace

GAP_MS = 60_000.0


def doubled(trace: Sequence[TraceRequest], gap_ms: float = GAP_MS) -> list[TraceRequest]:
    """``trace`` followed by a copy with fresh hash ids, ``gap_ms`` after its last request."""
    if not trace:
        return []
    offset = max((h for r in trace for h in r.hash_ids), default=-1) + 1
    shift = trace[-1].timestamp_ms + gap_ms
    return [*trace, *(replace(r, timestamp_ms=r.timestamp_ms + shift,
                              hash_ids=tuple(h + offset for h in r.hash_ids)) for r in trace)]


def passes(trace: Sequence[TraceRequest], cfg: ReplayConfig, policy: str) -> tuple[float, float]:
    """(net saved time fraction of the first pass, of the second)."""
    one = run_replay(trace, cfg, make_replay_policy(policy, cfg))
    two = run_replay(doubled(trace), cfg, make_replay_policy(policy, cfg))
    second = (two.net_saved_s - one.net_saved_s) / (two.total_recompute_s - one.total_recompute_s)
    return one.net_saved_time_fraction, second


def _cell(args: tuple[str, int, str]) -> tuple[int, str, tuple[float, float]]:
    path, hbm, policy = args
    return hbm, policy, passes(load_trace(path), ReplayConfig.with_defaults(hbm), policy)


def run(trace_path: Path, capacities: list[int], workers: int = 2) -> list[dict]:
    jobs = [(str(trace_path), c, p) for c in capacities for p in POLICIES]
    got: dict[tuple[int, str], tuple[float, float]] = {}
    with ProcessPoolExecutor(max_workers=workers) as ex:
        for hbm, policy, figs in ex.map(_cell, jobs):
            got[(hbm, policy)] = figs
    rows = []
    for hbm in capacities:
        row: dict = {"hbm_blocks": hbm}
        for i, name in enumerate(("first_pass", "second_pass")):
            f = {p: got[(hbm, p)][i] for p in POLICIES}
            row[name] = {"net_saved_time_fraction": f, "gap_closed": gap_closed(f, ("gdsf", "cost"))}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    trace, capacities = trace_and_capacities(__doc__.splitlines()[0], argv)
    rows = run(trace, capacities)
    for r in rows:
        for name in ("first_pass", "second_pass"):
            g = r[name]["gap_closed"]
            cells = " ".join(f"{p} {'-' if g[p] is None else format(g[p], '+.2f')}" for p in g)
            print(f"HBM {r['hbm_blocks']:5d} {name:11s}: gap closed {cells}", file=sys.stderr)
    print(json.dumps({"bench": "replay_repeat", "trace": str(trace), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
