"""SGLang HiCache batches through the sidecar: one RPC per page against one per batch, same run.

The SGLang backend (``kvstore.integrations.sglang``) stores each page as an independent root
block. Its batch verbs made one RPC per page (``lookup``, ``put_bytes``, ``get_into`` of one
key); they now make one per batch (``lookup_roots``, ``put_bytes(roots=True)``,
``get_roots_into``: ``Target.roots``). This times both call patterns, with the client calls the
backend makes, for a batch of ``--pages`` pages of ``--page-kib`` KiB, on each data plane
(shared memory, in-band streams), interleaved round by round; median ms per batch:

  exists — presence of every page (all present)
  set    — store every page (fresh keys each round)
  get    — every page into a [pages, page_bytes] buffer (all present)

The sidecar runs in a child process (``bench.service_bench.sidecar_and_raw``).

    python -m bench.sglang_batch_bench [--pages 64] [--page-kib 256] [--rounds 15] [--out FILE]

Prints one JSON document.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.output import emit_json
from bench.service_bench import MiB, sidecar_and_raw


def _page_spec(page_kib: int) -> Any:
    from kvstore.spec import ModelSpec

    # a flat bytes spec as the backend makes (kvstore.integrations.sglang.page_spec)
    return ModelSpec(model="bench-sglang", revision="", num_layers=1, num_kv_heads=1,
                     head_dim=page_kib * 1024 // 4, dtype="float16", block_tokens=1, layout="sglang-page:bench")


def _keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest() for i in range(n)]


def _per_page(kv: Any, spec: Any, op: str, keys: list[bytes], rows: np.ndarray) -> None:
    for i, key in enumerate(keys):
        if op == "exists":
            kv.lookup(spec, [key])
        elif op == "set":
            kv.put_bytes(spec, [key], rows[i : i + 1])
        else:
            kv.get_into(spec, [key], rows[i : i + 1])


def _batched(kv: Any, spec: Any, op: str, keys: list[bytes], rows: np.ndarray) -> None:
    if op == "exists":
        assert all(kv.lookup_roots(spec, keys))
    elif op == "set":
        kv.put_bytes(spec, keys, rows, roots=True)
    else:
        assert all(kv.get_roots_into(spec, keys, rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64, help="pages per batch")
    ap.add_argument("--page-kib", type=int, default=256, help="KiB per page")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from kvstore.client import Client

    spec = _page_spec(args.page_kib)
    nbytes = spec.block_nbytes
    batch = args.pages * nbytes
    rows = np.random.default_rng(0).integers(0, 256, (args.pages, nbytes), dtype=np.uint8)
    fresh = itertools.count()
    results: dict[str, Any] = {}
    with sidecar_and_raw(hbm=max(512 * MiB, 8 * batch), dram=max(1024 * MiB, 16 * batch), nvme=0) as srv:
        for plane, local in (("shm", None), ("stream", False)):
            with Client(srv.target, srv.token, local=local) as kv:
                stored = _keys(f"{plane}/stored", args.pages)
                kv.put_bytes(spec, stored, rows, roots=True)
                times: dict[str, list[float]] = {}
                for _ in range(args.rounds):
                    for op in ("exists", "set", "get"):
                        for how, run in (("per_page", _per_page), ("batched", _batched)):
                            keys = _keys(f"{plane}/{next(fresh)}", args.pages) if op == "set" else stored
                            out = rows if op == "set" else np.empty_like(rows)
                            t0 = time.perf_counter()
                            run(kv, spec, op, keys, out)
                            times.setdefault(f"{op}.{how}", []).append((time.perf_counter() - t0) * 1e3)
                            if op == "get":
                                assert np.array_equal(out, rows)
                med = {name: statistics.median(ts) for name, ts in times.items()}
                results[plane] = {
                    "uses_shared_memory": kv.uses_shared_memory,
                    "median_ms": {k: round(v, 3) for k, v in med.items()},
                    "per_page_over_batched": {op: round(med[f"{op}.per_page"] / med[f"{op}.batched"], 2)
                                              for op in ("exists", "set", "get")},
                }
    emit_json({"pages": args.pages, "page_bytes": nbytes, "rounds": args.rounds, "planes": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
