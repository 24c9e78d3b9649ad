"""One Store path in a loop, for a sampling profiler to look at (``bench.pyspy_profile``).

    python -m bench.profile_target nvme-put --mib 2 --blocks 16 --rounds 20 [--level 1] [--no-encrypt]

Targets: ``dram-put`` (put into a DRAM-only store), ``nvme-put`` (put into an NVMe-only store,
durable), ``nvme-put-nosync`` (the same, ``durable=False``), ``dram-nvme`` (flush of DRAM-resident blocks: the DRAM -> NVMe spill), ``nvme-get``
(get_into from an NVMe-only store), ``dram-get`` (get_into from a DRAM-only store). The data, shapes and stores are the benchmarks' own
(``bench.store_bench``), the policy the LRU baseline as in the suites (``bench.suite_tiers``);
keys are deleted after each put so every round writes anew.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from bench.store_bench import MASTER_KEY, TENANT, kv_like, make_spec, token_ids
from kvstore.config import StoreConfig
from kvstore.store import Store

TARGETS = ("dram-put", "dram-get", "nvme-put", "nvme-put-nosync", "dram-nvme", "nvme-get")


def run(target: str, mib: int, blocks: int, rounds: int, level: int, encrypt: bool,
        workdir: Path) -> None:
    torch.set_num_threads(1)
    spec = make_spec(mib, "float16")
    kv = kv_like(spec, blocks, seed=mib)
    cap = 4 * blocks * spec.block_nbytes + (64 << 20)
    dram = cap if target in ("dram-put", "dram-get", "dram-nvme") else 0
    nvme = cap if target in ("nvme-put", "nvme-put-nosync", "dram-nvme", "nvme-get") else 0
    store = Store.open(StoreConfig(path=workdir, hbm_bytes=0, dram_bytes=dram, nvme_bytes=nvme,
                                   device="cpu", master_key=MASTER_KEY,
                                   durable=target != "nvme-put-nosync",
                                   encrypt=encrypt, compression_level=level,
                                   min_compress_ratio=1.0,  # --level N compresses every block
                                   persist_on_close=False, policy="lru"))  # as the suites
    outs = [np.empty(spec.block_nbytes, np.uint8) for _ in range(blocks)]
    try:
        reads = target.endswith("-get")
        if reads:
            keys = store.block_keys(TENANT, spec, token_ids(spec, blocks, 0))
            store.put(TENANT, spec, keys, kv)
        for r in range(rounds):
            if reads:
                assert store.get_into(TENANT, spec, keys, outs) == blocks
                continue
            keys = store.block_keys(TENANT, spec, token_ids(spec, blocks, (r + 1) << 24))
            store.put(TENANT, spec, keys, kv)
            if target == "dram-nvme":
                assert store.flush() == blocks
            store.delete(TENANT, keys[:1])
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", choices=TARGETS)
    ap.add_argument("--mib", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--no-encrypt", dest="encrypt", action="store_false")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvstore-profile-") as tmp:
        run(args.target, args.mib, args.blocks, args.rounds, args.level, args.encrypt,
            Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
