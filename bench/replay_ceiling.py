"""How much of the LRU→Belady gap is open to an online policy at all (issue 3's analysis).

Replays the trace with ``lru``, ``cost`` (the online default) and ``belady``, and between them
the references of :mod:`bench.replay_bounds`:

* ``fitted-features`` — ``cost``'s decisions with ``p`` fitted in-sample on online-knowable
  features (uses before, request length, position from the request's end, time since the
  last use): how far a calibrated estimate from these features can go;
* ``oracle-p`` — ``cost``'s decisions with the true "read again?" as ``p``;
* ``oracle-reuse`` — LRU order with the true "read again?" (never-read blocks dropped first).

JSON on stdout (gap closed = (x − lru) / (belady − lru)), a table on stderr.

    python -m bench.replay_ceiling --capacities 400,1000,1500
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.replay_bench import gap_closed, trace_and_capacities
from bench.replay_bounds import (
    FittedFeaturesCost,
    OracleProbabilityCost,
    OracleReuseLRU,
    spec_lookup,
)
from kvstore.replay import ReplayConfig, make_replay_policy, run_replay
from kvstore.workloads import TraceRequest, load_trace
from policy.base import EvictionPolicy

REFERENCES = ("lru", "cost", "fitted-features", "oracle-p", "oracle-reuse", "belady")


def _policy(name: str, cfg: ReplayConfig, trace: Sequence[TraceRequest]) -> EvictionPolicy:
    if name == "oracle-reuse":
        return OracleReuseLRU()
    if name == "oracle-p":
        return OracleProbabilityCost(spec_lookup(cfg))
    if name == "fitted-features":
        return FittedFeaturesCost(trace, spec_lookup(cfg))
    return make_replay_policy(name, cfg)


def run(trace_path: Path, capacities: list[int]) -> list[dict]:
    trace = load_trace(trace_path)
    rows = []
    for hbm in capacities:
        cfg = ReplayConfig.with_defaults(hbm)
        got: dict[str, float] = {}
        nvme: dict[str, int] = {}
        for name in REFERENCES:
            r = run_replay(trace, cfg, _policy(name, cfg, trace))
            got[name] = r.net_saved_time_fraction
            nvme[name] = r.bytes_written_by_tier["nvme"]
        rows.append({"hbm_blocks": hbm, "net_saved_time_fraction": got, "nvme_bytes_written": nvme,
                     "gap_closed": gap_closed(got, [k for k in REFERENCES if k not in ("lru", "belady")])})
    return rows


def main(argv: list[str] | None = None) -> int:
    trace, capacities = trace_and_capacities(__doc__.splitlines()[0], argv)
    rows = run(trace, capacities)
    for r in rows:
        f, g = r["net_saved_time_fraction"], r["gap_closed"]
        cells = " ".join(f"{k} {f[k]:.4f} [{'-' if g[k] is None else format(g[k], '.2f')}]"
                         for k in g)
        print(f"HBM {r['hbm_blocks']:5d}: lru {f['lru']:.4f} {cells} belady {f['belady']:.4f}",
              file=sys.stderr)
    print(json.dumps({"bench": "replay_ceiling", "trace": str(trace), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
