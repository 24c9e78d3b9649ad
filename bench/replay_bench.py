"""Replay benchmark: every policy at several HBM capacities, on the shared trace and ours.

For each trace and capacity (DRAM = 3×, NVMe = 10× HBM) it replays ``lru``, ``gdsf``, ``cost``
and ``belady`` and reports ``net_saved_time_fraction``, the share of the LRU→Belady gap each
online policy closes (``(x − lru) / (belady − lru)``), NVMe bytes written and token hit rate.
The replay is deterministic, so one run per cell is the figure; wall time per run is given
for information. JSON on stdout, a table on stderr.

    python bench/replay_bench.py                       # shared trace + 4 generated workloads
    python bench/replay_bench.py --workloads none --capacities 400
    python bench/replay_bench.py --workloads none --ttl-s 120 --policies lru,cost,cost-ttl-blind,belady

``--ttl-s`` gives every block that TTL in trace seconds (:class:`kvstore.replay.ReplayConfig`;
the traces carry none). ``cost-ttl-blind`` is ``cost`` valuing every block as if it had no
deadline (``CostPolicyConfig.expiry_aware=False``, the policy before it counted expiry), for
a comparison in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.replay import ReplayConfig, make_replay_policy, run_replay
from kvstore.workloads import WORKLOADS, WorkloadConfig, generate, load_trace

#: the Mooncake trace: $KVSTORE_TRACE, else ``shared/data/`` next to the checkout (NOTE: only the
#: latter before, so a checkout anywhere else dropped the trace from the full suite, silently)
SHARED_TRACE = Path(os.environ.get("KVSTORE_TRACE") or
                    Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl")
POLICIES = ("lru", "gdsf", "cost", "belady")


def gap_closed(fractions: Mapping[str, float], names: Iterable[str]) -> dict[str, float | None]:
    """Share of the LRU→Belady gap each of ``names`` closes, ``(x − lru) / (belady − lru)``, from
    net saved time fractions (None for all when Belady does not beat LRU)."""
    lru = fractions["lru"]
    gap = fractions["belady"] - lru
    return {p: (fractions[p] - lru) / gap if gap > 0 else None for p in names}


def trace_and_capacities(description: str, argv: list[str] | None) -> tuple[Path, list[int]]:
    """``--trace`` (the shared Mooncake trace by default) and ``--capacities`` (HBM blocks) of
    the analysis benches."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--trace", type=Path, default=SHARED_TRACE)
    ap.add_argument("--capacities", default="400,1000,1500", help="HBM blocks, comma-separated")
    args = ap.parse_args(argv)
    return args.trace, [int(c) for c in args.capacities.split(",")]


def _trace(name: str, path: str, seed: int, requests: int):
    if name == "mooncake":
        return load_trace(path)
    return generate(name, WorkloadConfig(requests=requests), seed=seed)  # type: ignore[arg-type]


def _policy(name: str, cfg: ReplayConfig):
    """A registered policy, or ``cost-ttl-blind`` (see the module docstring)."""
    if name != "cost-ttl-blind":
        return make_replay_policy(name, cfg)
    from policy.cost import CostPolicy, CostPolicyConfig

    spec = cfg.spec
    return CostPolicy(lambda fp: spec if fp == spec.fingerprint else None,
                      CostPolicyConfig(costs=cfg.costs, expiry_aware=False))


def _cell(args: tuple) -> dict:
    """One replay: (trace, path, seed, requests, hbm, policy[, ttl_s])."""
    name, path, seed, requests, hbm, policy, *rest = args
    ttl_s = rest[0] if rest else None
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    trace = _trace(name, path, seed, requests)
    cfg = ReplayConfig.with_defaults(hbm, ttl_s=ttl_s)
    pol = _policy(policy, cfg)
    t0 = time.perf_counter()
    r = run_replay(trace, cfg, pol)
    wall = time.perf_counter() - t0
    return {"trace": name, "seed": seed, "hbm_blocks": hbm, "policy": policy,
            "net_saved_time_fraction": r.net_saved_time_fraction,
            "token_hit_rate": r.token_hit_rate,
            "nvme_bytes_written": r.bytes_written_by_tier["nvme"],
            "dram_bytes_written": r.bytes_written_by_tier["dram"],
            "block_hits_by_tier": r.block_hits_by_tier, "ttl_s": ttl_s,
            "expired_blocks": r.expired_blocks, "wall_s": round(wall, 2)}


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (trace, seed, capacity): per-policy figures and gap closed."""
    cells: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        cells.setdefault((row["trace"], row["seed"], row["hbm_blocks"]), {})[row["policy"]] = row
    out = []
    for (trace, seed, hbm), by in sorted(cells.items()):
        entry: dict = {"trace": trace, "seed": seed, "hbm_blocks": hbm}
        for p, row in by.items():
            entry[p] = {"net_saved_time_fraction": round(row["net_saved_time_fraction"], 4),
                        "nvme_written_tb": round(row["nvme_bytes_written"] / 1e12, 3),
                        "token_hit_rate": round(row["token_hit_rate"], 4)}
        if "lru" in by and "belady" in by:
            online = [p for p in by if p not in ("lru", "belady")]
            closed = gap_closed({p: r["net_saved_time_fraction"] for p, r in by.items()}, online)
            for p in online:
                g = closed[p]
                entry[p]["gap_closed"] = None if g is None else round(g, 3)
                entry[p]["nvme_below_lru"] = by[p]["nvme_bytes_written"] < by["lru"]["nvme_bytes_written"]
        out.append(entry)
    return out


def print_table(summary: list[dict], stream=sys.stderr, policies: Iterable[str] = POLICIES) -> None:
    policies = list(policies)
    head = f"{'trace':14s} {'hbm':>5s} " + " ".join(f"{p:>20s}" for p in policies)
    print("net_saved_time_fraction / NVMe TB written [gap closed]", file=stream)
    print(head, file=stream)
    for e in summary:
        cols = []
        for p in policies:
            if p not in e:
                cols.append(f"{'-':>20s}")
                continue
            s = f"{e[p]['net_saved_time_fraction']:.4f}/{e[p]['nvme_written_tb']:.2f}"
            if e[p].get("gap_closed") is not None:
                s += f" [{e[p]['gap_closed']:.2f}]"
            cols.append(f"{s:>20s}")
        print(f"{e['trace'] + '#' + str(e['seed']):14s} {e['hbm_blocks']:5d} " + " ".join(cols), file=stream)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(SHARED_TRACE), help="shared Mooncake trace ('' to skip)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="generated workloads, comma-separated, or 'none'")
    ap.add_argument("--seeds", default="1", help="seeds of the generated workloads, e.g. 1,2")
    ap.add_argument("--requests", type=int, default=4000, help="requests per generated workload")
    ap.add_argument("--capacities", default="400,1000,1500", help="HBM blocks, comma-separated")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--ttl-s", type=float, default=None,
                    help="TTL of every block, trace seconds (default: none)")
    args = ap.parse_args(argv)

    traces: list[tuple[str, str, int]] = []
    if args.trace:
        traces.append(("mooncake", args.trace, 0))
    if args.workloads != "none":
        for w in args.workloads.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                traces.append((w, "", seed))
    caps = [int(c) for c in args.capacities.split(",")]
    jobs = [(n, p, s, args.requests, c, pol, args.ttl_s) for (n, p, s) in traces for c in caps
            for pol in args.policies.split(",")]
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as ex:
            rows = list(ex.map(_cell, jobs))
    else:
        rows = [_cell(j) for j in jobs]
    summary = summarize(rows)
    doc = {"bench": "replay", "capacities": caps, "dram_factor": 3, "nvme_factor": 10, "ttl_s": args.ttl_s,
           "wall_s": round(time.perf_counter() - t0, 1), "summary": summary, "runs": rows}
    print_table(summary, policies=args.policies.split(","))
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
