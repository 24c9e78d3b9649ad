"""End-to-end time to first token with SmolLM2-135M on CPU: full prefill vs kvstore restore.

For each prefix length P (2K and 8K tokens; ``--quick``: 512) the prompt is P document tokens
followed by a ``--suffix-tokens`` question. Measured in the same run, medians of ``--repeats``:

* ``full``: one forward pass over the whole prompt (no store) and the argmax of its last logits;
* ``dram`` / ``nvme``: :meth:`PrefixCache.restore` of the P-token prefix (lookup, get, rebuild a
  ``DynamicCache``) from a Store that has only that tier (``hbm_bytes=0``; the DRAM store has no
  NVMe tier, the NVMe store no memory tiers, so the tier is forced), then a forward pass over the
  suffix only. ``ttft_s`` = restore + suffix prefill; ``speedup`` = full / ttft.

The prefix blocks come from the last full prefill (the KV of the first P tokens). The NVMe store
uses the default codec (zstd level 1, AES-256-GCM) on LMDB without fsync; its file was just
written, so reads hit the page cache (a warm NVMe read: the codec cost is real, the disk's is not).
``first_token_equal`` checks the restored path predicts the same first token as the full prefill.
Target (issue 6): restore + suffix prefill >= 5x faster than full prefill at 8K.

Prints JSON and writes it to ``--out``. Needs transformers, gguf, accelerate::

    python -m bench.ttft_bench [--quick] [--repeats 3] [--threads 1] [--out bench/results/ttft.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.hf_demo import BLOCK_TOKENS
from bench.kv_accuracy import PPL_TEXT
from bench.output import emit_json
from kvstore.config import StoreConfig
from kvstore.integrations.hf import PrefixCache, TenantStore, forward, spec_from_config
from kvstore.integrations.smollm2 import MODEL_ID, ensure_smollm2, load_smollm2
from kvstore.store import Store

__all__ = ["main", "run"]

TENANT = "bench"
QUESTION = ("Question: according to the text above, what happened first, and why does it matter? "
            "Answer in one sentence.")
#: Prefix lengths (tokens, whole blocks). SmolLM2's context is 8192, so "8K" leaves room for the
#: suffix: 8160 + 32 = 8192.
FULL_PREFIXES = (2048, 8160)
QUICK_PREFIXES = (512,)
TIER_STORES: dict[str, dict[str, int]] = {
    "dram": {"hbm_bytes": 0, "dram_bytes": 2 << 30, "nvme_bytes": 0},
    "nvme": {"hbm_bytes": 0, "dram_bytes": 0, "nvme_bytes": 4 << 30},
}


def _prompt_tokens(tokenizer: Any, prefix: int, suffix: int) -> torch.Tensor:
    """``[1, prefix + suffix]``: the document repeated to ``prefix`` tokens, then the question
    (padded with its own tokens or cut to ``suffix``)."""
    doc = tokenizer(PPL_TEXT, add_special_tokens=False)["input_ids"]
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    body = (doc * (prefix // len(doc) + 1))[:prefix]
    tail = (question * (suffix // len(question) + 1))[:suffix]
    return torch.tensor([body + tail], dtype=torch.long)


def _times(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return times, result


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def _open_store(root: Path, tier: str) -> Store:
    return Store.open(StoreConfig(path=root / tier, durable=False, persist_on_close=False,
                                  master_key=bytes(range(32)), **TIER_STORES[tier]))


def _measure_prefix(model: Any, spec: Any, stores: dict[str, Store], ids: torch.Tensor,
                    prefix: int, repeats: int) -> dict[str, Any]:
    def full() -> Any:
        return forward(model, ids, None)

    full_t, out = _times(full, repeats)
    want = int(out.logits[0, -1].argmax())
    cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
    row: dict[str, Any] = {"prefix_tokens": prefix, "prompt_tokens": int(ids.shape[1]),
                           "kv_bytes": prefix // spec.block_tokens * spec.block_nbytes,
                           "full": {"ttft_s": _med(full_t), "runs_s": [round(t, 3) for t in full_t]}}
    del out
    for tier, store in stores.items():
        pc = PrefixCache(TenantStore(store, TENANT), spec)
        t0 = time.perf_counter()
        saved = pc.save(ids[:, :prefix], cache)
        save_s = time.perf_counter() - t0
        restore_t, suffix_t, total_t, firsts, tiers, reused = [], [], [], [], Counter(), 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            restored = pc.restore(ids)
            t1 = time.perf_counter()
            o = forward(model, ids[:, restored.num_tokens:], restored.cache)
            first = int(o.logits[0, -1].argmax())
            t2 = time.perf_counter()
            restore_t.append(t1 - t0)
            suffix_t.append(t2 - t1)
            total_t.append(t2 - t0)
            firsts.append(first)
            tiers, reused = Counter(restored.tiers), restored.num_tokens
            del restored, o
        ttft = statistics.median(total_t)
        row[tier] = {"blocks_saved": saved.num_blocks, "save_s": round(save_s, 3),
                     "tokens_reused": reused, "hit_tiers": dict(tiers),
                     "restore_s": _med(restore_t), "suffix_prefill_s": _med(suffix_t),
                     "ttft_s": round(ttft, 4),
                     "restore_gb_s": round(row["kv_bytes"] / statistics.median(restore_t) / 1e9, 2),
                     "speedup": round(statistics.median(full_t) / ttft, 1),
                     "first_token_equal": all(f == want for f in firsts)}
    return row


def run(*, quick: bool = False, repeats: int = 3, threads: int = 1, suffix_tokens: int = 32,
        prefixes: tuple[int, ...] | None = None) -> dict[str, Any]:
    torch.set_num_threads(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    load_start = os.getloadavg()
    model, tokenizer = load_smollm2(ensure_smollm2())
    load_s = time.perf_counter() - started
    spec = spec_from_config(model.config, model.dtype, BLOCK_TOKENS, model=MODEL_ID)
    prefixes = prefixes or (QUICK_PREFIXES if quick else FULL_PREFIXES)
    forward(model, _prompt_tokens(tokenizer, 64, 16), None)  # warm-up
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvstore-ttft-") as tmp:
        stores = {tier: _open_store(Path(tmp), tier) for tier in TIER_STORES}
        try:
            for prefix in prefixes:
                ids = _prompt_tokens(tokenizer, prefix, suffix_tokens)
                rows.append(_measure_prefix(model, spec, stores, ids, prefix, repeats))
        finally:
            for store in stores.values():
                store.close()
    last = rows[-1]
    return {
        "bench": "ttft",
        "model": MODEL_ID,
        "kv_dtype": spec.dtype,
        "block_tokens": BLOCK_TOKENS,
        "suffix_tokens": suffix_tokens,
        "repeats": repeats,
        "threads": threads,
        "nvme_codec": "zstd level 1 + AES-256-GCM, LMDB, durable=False, page cache warm",
        "results": rows,
        "target": {"prefix_tokens": last["prefix_tokens"], "min_speedup": 5.0,
                   "met": {t: last[t]["speedup"] >= 5.0 for t in TIER_STORES}},
        "machine": {"cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load_start],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                    "torch": torch.__version__, "python": platform.python_version()},
        "seconds": {"load": round(load_s, 1), "total": round(time.perf_counter() - started, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one 512-token prefix")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--prefixes", type=int, nargs="+", help="prefix lengths (whole blocks)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.prefixes and any(p % BLOCK_TOKENS for p in args.prefixes):
        parser.error(f"prefix lengths must be multiples of {BLOCK_TOKENS}")
    result = run(quick=args.quick, repeats=args.repeats, threads=args.threads,
                 suffix_tokens=args.suffix_tokens,
                 prefixes=tuple(args.prefixes) if args.prefixes else None)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
