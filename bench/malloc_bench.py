"""What keeping freed buffers in the process buys (``StoreConfig.retain_freed_memory``).

``mallopt`` is process-wide and cannot be undone, so each side runs in its own child process:
an NVMe-only Store (durable, AES-256-GCM, default codec), ``put`` of ``--blocks`` fp16 blocks
of ``--mib`` MiB per op, the keys deleted after each op, ``--rounds`` timed ops after one
warm-up. The two sides alternate ``--passes`` times so the machine's drift hits both; prints
JSON with the median GB/s of each side over passes and their ratio.

    python -m bench.malloc_bench [--mib 2,32] [--passes 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.output import emit_json


def child(mib: int, blocks: int, rounds: int, retain: bool) -> float:
    import torch

    from bench.store_bench import MASTER_KEY, TENANT, kv_like, make_spec, token_ids
    from kvstore.config import StoreConfig
    from kvstore.store import Store

    torch.set_num_threads(1)
    spec = make_spec(mib, "float16")
    kv = kv_like(spec, blocks, seed=mib)
    total = blocks * spec.block_nbytes
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        store = Store.open(StoreConfig(path=Path(tmp), hbm_bytes=0, dram_bytes=0, nvme_bytes=4 * total + (64 << 20),
                                       device="cpu", master_key=MASTER_KEY, durable=True,
                                       persist_on_close=False, policy="lru", retain_freed_memory=retain))
        times = []
        try:
            for r in range(rounds + 1):
                keys = store.block_keys(TENANT, spec, token_ids(spec, blocks, r << 24))
                t0 = time.perf_counter()
                store.put(TENANT, spec, keys, kv)
                if r:
                    times.append(time.perf_counter() - t0)
                store.delete(TENANT, keys)
        finally:
            store.close()
    return total / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", default="2,32", help="block sizes in MiB")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        mib, blocks, retain = args.child.split(",")
        print(child(int(mib), int(blocks), args.rounds, retain == "1"))
        return 0
    results: dict[str, object] = {"unit": "GB/s (median over passes)", "op": "NVMe put, durable, AES-256-GCM"}
    for mib in (int(m) for m in args.mib.split(",")):
        blocks = max(2, 32 // mib)
        runs: dict[str, list[float]] = {"default_malloc": [], "retain_freed_memory": []}
        for _ in range(args.passes):
            for name, retain in (("default_malloc", 0), ("retain_freed_memory", 1)):
                out = subprocess.run([sys.executable, "-m", "bench.malloc_bench", "--rounds", str(args.rounds),
                                      "--child", f"{mib},{blocks},{retain}"],
                                     check=True, capture_output=True, text=True).stdout
                runs[name].append(round(float(out.split()[-1]), 3))
        med = {k: round(statistics.median(v), 3) for k, v in runs.items()}
        results[f"{mib}MiB"] = {"blocks_per_op": blocks, **med, "passes": runs,
                                "ratio": round(med["retain_freed_memory"] / med["default_malloc"], 2)}
    emit_json(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
