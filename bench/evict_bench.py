"""Eviction cost against tier size: does a put into a full store stay cheap as NVMe grows?

An in-process Store with small blocks (2 KiB), HBM 100 and DRAM 300 blocks and NVMe of each
``--nvme`` size, fed 8-block puts of new prefixes (never read back). For each size it reports
the median time of an 8-block put, in batches of up to 100 puts (fewer where the room phase
would otherwise hold fewer than ``MIN_ROOM_BATCHES`` timed batches; the first batch warms up
and is not timed; each row says its batch size and how many batches each median is over):

  room  — while NVMe still has room (HBM and DRAM, 400 blocks, fill within the first 50 puts,
          so their evictions are in it): the baseline, same run
  full  — once the store has taken twice its capacity (NVMe evicts too, in make-room loops
          that go from the high watermark down to the low one)

and the ratio full / room. With the ``lru`` policy every victim is demoted to the next tier
(the most eviction work); ``cost`` drops blocks it does not expect back. Before
:class:`kvstore.victims.VictimQueue` each victim re-ranked the whole tier, and ``full`` grew
with the tier: this bench on the code before it (2026-11-30) gave full / room 5.61 with 2,000
NVMe blocks and 15.69 with 8,000 (12.0 and 41.4 ms per 8-block put); after it, 1.47, 1.31 and,
with 32,000 blocks, 1.05 (1.05, 1.19, 1.04 ms), with the same eviction counts (the 2,000-block
baseline of those runs was two 100-put batches, one cold; see README for runs with 5 or more).

    python -m bench.evict_bench [--nvme 2000,8000,32000] [--policy lru] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.output import emit_json

BATCH = 100  # puts per timed batch, at most
FULL_PUTS = 10 * BATCH  # puts timed once the store is full
MIN_ROOM_BATCHES = 5  # timed batches of the baseline, at least (the warm-up one not counted)


def _spec():
    from kvstore.spec import ModelSpec

    return ModelSpec(model="evict", revision="r", num_layers=2, num_kv_heads=2, head_dim=8,
                     dtype="float16", block_tokens=16)


def run(nvme_blocks: int, policy: str) -> dict[str, float]:
    from kvstore.config import StoreConfig
    from kvstore.store import Store

    spec = _spec()
    n = spec.block_nbytes
    capacity = 100 + 300 + nvme_blocks
    # NOTE: with 100-put batches, --nvme 2000 left room for two batches, one of them cold, and
    # the baseline "median" was of those two; now the batch shrinks (same size in both phases)
    # so that the room phase has MIN_ROOM_BATCHES timed batches after a warm-up one.
    room_puts = int(0.8 * capacity) // 8
    batch = max(1, min(BATCH, room_puts // (MIN_ROOM_BATCHES + 1)))
    kv = torch.zeros((8, *spec.block_shape), dtype=torch.float16)
    with tempfile.TemporaryDirectory() as d:
        store = Store.open(StoreConfig(path=Path(d) / "s", hbm_bytes=100 * n, dram_bytes=300 * n,
                                       nvme_bytes=nvme_blocks * n, master_key=os.urandom(32), durable=False,
                                       policy=policy))
        try:
            room: list[float] = []
            full: list[float] = []
            stored = r = 0
            while stored < 2 * capacity + FULL_PUTS * 8:
                t0 = time.perf_counter()
                for _ in range(batch):
                    keys = store.block_keys("a", spec, list(range(r * 1000, r * 1000 + 8 * 16)))
                    store.put("a", spec, keys, kv)
                    r += 1
                per_put = (time.perf_counter() - t0) / batch
                if 0 < stored and stored + batch * 8 <= 0.8 * capacity:  # batch 0 warms up
                    room.append(per_put)
                elif stored >= 2 * capacity:
                    full.append(per_put)
                stored += batch * 8
            evictions = store.stats().get("evictions", 0)
        finally:
            store.close()
    room_ms = statistics.median(room) * 1e3
    full_ms = statistics.median(full) * 1e3
    return {"nvme_blocks": nvme_blocks, "room_ms_per_put": round(room_ms, 3),
            "full_ms_per_put": round(full_ms, 3), "full/room": round(full_ms / room_ms, 2),
            "puts_per_batch": batch, "room_batches": len(room), "full_batches": len(full),
            "evictions": evictions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme", default="2000,8000,32000", help="NVMe sizes in blocks, comma-separated")
    ap.add_argument("--policy", default="lru", choices=("lru", "gdsf", "cost"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for size in (int(x) for x in args.nvme.split(",")):
        rows.append(run(size, args.policy))
        print(f"NVMe {size:6d} blocks: {rows[-1]}", file=sys.stderr, flush=True)
    emit_json({"bench": "evict", "policy": args.policy, "max_puts_per_batch": BATCH,
               "blocks_per_put": 8,
               "unit": "ms per put (median of batches; each row gives its batch size and counts,"
                       " the warm-up batch excluded)", "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
