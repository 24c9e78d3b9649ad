"""The ``replay`` suite: every placement policy over HBM capacities, through bench/replay_bench.py.

Cells (trace x capacity x policy) are replayed by ``replay_bench._cell`` on a process pool of
two and summarised by ``replay_bench.summarize`` (share of the LRU->Belady gap each online policy
closes). The replay is deterministic, so one run per cell is the figure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from bench.replay_bench import POLICIES, SHARED_TRACE, _cell, summarize
from kvstore.workloads import WORKLOADS

QUICK = {"traces": [("chat", "", 1), ("agent", "", 1)], "requests": 300,
         "capacities": [25, 50, 100, 200]}
FULL = {"traces": [("mooncake", str(SHARED_TRACE), 0), *((w, "", 1) for w in WORKLOADS)],
        "requests": 4000, "capacities": [100, 200, 400, 700, 1000, 1500]}


def run_replay_suite(quick: bool, tick: Callable[[str, int], Callable[[], None]]) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    traces = [t for t in plan["traces"] if t[0] != "mooncake" or SHARED_TRACE.exists()]
    skipped = [f"mooncake: no trace at {SHARED_TRACE} (set KVSTORE_TRACE to its path)"
               for t in plan["traces"] if t not in traces]
    for line in skipped:
        print(f"replay suite: skipped {line}", file=sys.stderr)
    jobs = [(name, path, seed, plan["requests"], cap, pol) for name, path, seed in traces
            for cap in plan["capacities"] for pol in POLICIES]
    step = tick("replay cells", len(jobs))
    rows = []
    workers = min(2, os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=workers) as ex:
        for row in ex.map(_cell, jobs):
            rows.append(row)
            step()
    return {"policies": list(POLICIES), "capacities": plan["capacities"],
            "traces": [f"{n}#{s}" for n, _, s in traces], "requests_per_workload": plan["requests"],
            "dram_factor": 3, "nvme_factor": 10, "skipped": skipped, "summary": summarize(rows), "runs": rows}
