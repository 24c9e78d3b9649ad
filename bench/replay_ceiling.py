"""How much of the LRU→Belady gap is open to an online policy at all (issue 3's analysis).

Replays the trace with two references next to ``lru`` and ``belady``:

* ``oracle-reuse`` — LRU order, but with *perfect* knowledge of whether each block will ever be
  read again: never-read blocks are evicted first and dropped, the others demoted. This is the
  best any policy can do that knows "will it come back" but not "when".
* ``cost`` — the online policy, for comparison.

JSON on stdout (gap closed = (x − lru) / (belady − lru)), a table on stderr.

    python -m bench.replay_ceiling --capacities 400,1000,1500
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvstore.block import BlockMeta, Tier
from kvstore.replay import ReplayConfig, make_replay_policy, run_replay
from kvstore.workloads import load_trace
from policy.belady import INF, BeladyPolicy

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


class OracleReuseLRU(BeladyPolicy):
    """Leaf-first LRU that knows (only) whether a block is ever read again."""

    name = "oracle-reuse"

    def evict_key(self, meta: BlockMeta, tier: Tier, now: float) -> tuple[int, float, int]:
        return (0 if self._nu(meta) == INF else 1, meta.last_access, -meta.depth)

    def rank(self, tier: Tier, candidates: Sequence[BlockMeta], now: float) -> list[BlockMeta]:
        return sorted(candidates, key=lambda m: self.evict_key(m, tier, now))


def run(trace_path: Path, capacities: list[int]) -> list[dict]:
    trace = load_trace(trace_path)
    rows = []
    for hbm in capacities:
        cfg = ReplayConfig.with_defaults(hbm)
        got: dict[str, float] = {}
        for name in ("lru", "cost", "oracle-reuse", "belady"):
            pol = OracleReuseLRU() if name == "oracle-reuse" else make_replay_policy(name, cfg)
            got[name] = run_replay(trace, cfg, pol).net_saved_time_fraction
        gap = got["belady"] - got["lru"]
        rows.append({"hbm_blocks": hbm, "net_saved_time_fraction": got,
                     "gap_closed": {k: (got[k] - got["lru"]) / gap if gap > 0 else None
                                    for k in ("cost", "oracle-reuse")}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=SHARED_TRACE)
    ap.add_argument("--capacities", default="400,1000,1500", help="HBM blocks, comma-separated")
    args = ap.parse_args(argv)
    rows = run(args.trace, [int(c) for c in args.capacities.split(",")])
    for r in rows:
        f, g = r["net_saved_time_fraction"], r["gap_closed"]
        print(f"HBM {r['hbm_blocks']:5d}: lru {f['lru']:.4f} cost {f['cost']:.4f} "
              f"[{g['cost']:.2f}] oracle-reuse {f['oracle-reuse']:.4f} [{g['oracle-reuse']:.2f}] "
              f"belady {f['belady']:.4f}", file=sys.stderr)
    print(json.dumps({"bench": "replay_ceiling", "trace": str(args.trace), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
