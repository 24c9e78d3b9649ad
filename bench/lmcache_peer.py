"""LMCache side of the ``peers`` suite; runs INSIDE LMCache's own venv (never imports kvstore).

    LMCACHE_TRACK_USAGE=false ~/.cache/kvstore/lmcache-venv/bin/python bench/lmcache_peer.py \
        --dir /tmp/x --tokens 16 --blocks 16 --rounds 5 [--aesgcm]

Drives LMCache 0.5.6's multiprocess-mode ``StorageManager`` (``lmcache.v1.distributed``) with a
DRAM L1 and the ``fs`` L2 adapter (optionally wrapped in its ``aesgcm`` serde), on chunks of
32 layers x 8 KV heads x 128 head dim, fp16 (layout ``[2, L, T, H*D]``):

* ``l1_put``   — reserve_write + copy into the reserved objects + finish_write;
* ``l2_store`` — from the start of the L1 put until the fs adapter reports all bytes stored
  (LMCache stores to L2 asynchronously after finish_write);
* ``l1_get``   — prefetch (hits L1) + read_prefetched_results + copy out + finish_read;
* ``l2_get``   — same after deleting the keys from L1, so the prefetch loads them from L2.

Every read-back is compared byte for byte with what was written. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--aesgcm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from lmcache.v1.distributed.api import (
        GroupedObjectKeys,
        MemoryLayoutDesc,
        ObjectKey,
        PrefetchTaskSpec,
    )
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    layers, heads, dim = 32, 8, 128
    shape = torch.Size([2, layers, args.tokens, heads * dim])
    nbytes = shape.numel() * 2
    os.makedirs(os.path.join(args.dir, "fs"), exist_ok=True)
    adapter: dict = {"type": "fs", "base_path": os.path.join(args.dir, "fs")}
    if args.aesgcm:
        key_path = os.path.join(args.dir, "master.key")
        with open(key_path, "wb") as f:
            f.write(os.urandom(32))
        adapter["serde"] = {"type": "aesgcm", "master_key_path": key_path, "aes_bits": 256}
    l1_gb = max(1.0, 4 * args.blocks * nbytes / 2**30)
    cfg = parse_args(["--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
                      "--l2-adapter", json.dumps(adapter)])
    sm = StorageManager(cfg)
    layout = MemoryLayoutDesc(shapes=[shape], dtypes=[torch.float16])
    gen = torch.Generator().manual_seed(args.tokens)
    data = [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(args.blocks)]
    sink = [torch.empty_like(d) for d in data]
    total = args.blocks * nbytes
    times: dict[str, list[float]] = {k: [] for k in ("l1_put", "l2_store", "l1_get", "l2_get")}

    def l2_bytes() -> int:
        return sum(int(u) for u, _ in sm.get_l2_usages())

    def read(keys: list) -> None:
        spec = PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0,
                                                              layout_desc=layout)])
        handle = sm.submit_prefetch_task(spec)
        assert sm.wait_prefetch_status(handle, timeout=120), "prefetch timed out"
        result = sm.query_prefetch_status(handle)
        hits = sum(row.popcount() for row in result.hit_cells)
        assert hits == len(keys), f"prefetch found {hits} of {len(keys)}"
        with sm.read_prefetched_results(keys) as objs:
            assert objs is not None, "read_prefetched_results missed"
            for o, s in zip(objs, sink):
                s.view(-1).copy_(o.tensor.view(torch.float16).view(-1))
        sm.finish_read_prefetched(keys)

    def drop_l1(keys: list) -> None:
        """Delete the keys from L1 so the next read comes from L2. A key still locked (its
        read or asynchronous L2 store not released yet) is skipped by LMCache: retry until none
        is (keys already deleted are simply not found again)."""
        deadline = time.perf_counter() + 30
        while sm.delete_l1_keys(keys)[1]:
            assert time.perf_counter() < deadline, "keys stayed locked in L1 for 30 s"
            time.sleep(0.001)

    try:
        for r in range(args.rounds + 1):
            keys = [ObjectKey(chunk_hash=os.urandom(32), model_name="bench", kv_rank=0)
                    for _ in range(args.blocks)]
            base = l2_bytes()
            t0 = time.perf_counter()
            objs = sm.reserve_write(keys, layout)
            assert len(objs) == len(keys), f"reserved {len(objs)} of {len(keys)}"
            for k, d in zip(keys, data):
                objs[k].tensor.view(torch.float16).view(-1).copy_(d.view(-1))
            sm.finish_write(keys)
            t1 = time.perf_counter()
            deadline = t1 + 300
            while l2_bytes() < base + total:  # the asynchronous L2 store
                assert time.perf_counter() < deadline, "L2 store did not finish"
                time.sleep(0.0005)
            t2 = time.perf_counter()
            for s in sink:
                s.zero_()
            t3 = time.perf_counter()
            read(keys)
            t4 = time.perf_counter()
            assert all(torch.equal(s.view(torch.int16), d.view(torch.int16))
                       for s, d in zip(sink, data)), "L1 read-back differs"
            drop_l1(keys)
            for s in sink:
                s.zero_()
            t5 = time.perf_counter()
            read(keys)
            t6 = time.perf_counter()
            assert all(torch.equal(s.view(torch.int16), d.view(torch.int16))
                       for s, d in zip(sink, data)), "L2 read-back differs"
            sm.delete_l1_keys(keys)
            if r:  # round 0 warms up
                times["l1_put"].append(t1 - t0)
                times["l2_store"].append(t2 - t0)
                times["l1_get"].append(t4 - t3)
                times["l2_get"].append(t6 - t5)
    finally:
        sm.close()
    out = {k: round(total / statistics.median(v) / 1e9, 3) for k, v in times.items()}
    print(json.dumps({"gbps": out, "bytes_per_op": total, "blocks": args.blocks,
                      "tokens": args.tokens, "aesgcm": args.aesgcm, "verified": True,
                      "lmcache": __import__("lmcache").__version__ if hasattr(
                          __import__("lmcache"), "__version__") else "0.5.6"}))


if __name__ == "__main__":
    main()
