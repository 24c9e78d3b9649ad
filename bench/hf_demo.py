"""Two-turn chat with SmolLM2-135M where turn 2 reuses turn 1's KV from kvstore (HF transformers).

Turn 1 (a system prompt carrying a document, and a question) is generated through
:class:`kvstore.integrations.hf.PrefixCache`, which saves the full blocks of the conversation.
Turn 2 appends the answer and a follow-up question; its prompt shares turn 1's tokens. Measured in
the same run (medians of ``--repeats``):

* ``full_prefill_s``: one forward pass over the whole turn-2 prompt (no store);
* ``restore_s``, ``suffix_prefill_s`` and their sum ``with_store_s``: look up and fetch the longest
  stored prefix, rebuild the cache, and prefill only the uncached suffix.

Then turn 2 is generated greedily both ways and the texts are compared (``identical``; exit code 1
when they differ). ``--target grpc`` goes through an embedded sidecar instead of the in-process
Store. Prints JSON. Needs transformers, gguf and accelerate (``pip install 'kvstore[hf]'``)::

    python -m bench.hf_demo [--target store|grpc] [--repeats 3] [--doc-sentences 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.kv_accuracy import PPL_TEXT
from kvstore.config import StoreConfig
from kvstore.integrations.hf import PrefixCache, TenantStore, forward, spec_from_config
from kvstore.integrations.smollm2 import MODEL_ID, chat_ids, ensure_smollm2, load_smollm2
from kvstore.store import Store

__all__ = ["chat_ids", "load_smollm2", "main", "run"]

BLOCK_TOKENS = 16
def _document(sentences: int) -> str:
    parts = [s.strip() + "." for s in PPL_TEXT.split(". ") if s.strip()]
    return " ".join(parts[i % len(parts)] for i in range(sentences))


@contextmanager
def _target(kind: str, root: Path) -> Iterator[Any]:
    if kind == "store":
        store = Store.open(StoreConfig(path=root / "store", hbm_bytes=256 << 20, dram_bytes=256 << 20,
                                       nvme_bytes=1 << 30, durable=False, master_key=bytes(range(32))))
        try:
            yield TenantStore(store, "demo")
        finally:
            store.close()
        return
    from kvstore import server_config
    from kvstore.admin_client import AdminClient
    from kvstore.client import Client
    from kvstore.server import bootstrap, create_server

    cfg = server_config.build({"listen": "127.0.0.1:0", "metrics": {"enabled": False},
                               "expire_interval_s": 0, "audit_fsync": False,
                               "store": {"hbm_bytes": 256 << 20, "dram_bytes": 256 << 20,
                                         "nvme_bytes": 1 << 30, "durable": False}},
                              data_dir=root / "sidecar")
    admin_token = bootstrap(cfg)
    server, port = create_server(cfg)
    server.start()
    try:
        with AdminClient(f"127.0.0.1:{port}", admin_token) as admin:
            token = admin.create_tenant("demo")
        with Client(f"127.0.0.1:{port}", token) as client:
            yield client
    finally:
        server.stop(0)


def _median_s(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def run(*, target: str = "store", repeats: int = 3, doc_sentences: int = 40,
        max_new_tokens: int = 24) -> dict[str, Any]:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model, tokenizer = load_smollm2(ensure_smollm2())
    load_s = time.perf_counter() - t0
    spec = spec_from_config(model.config, model.dtype, BLOCK_TOKENS, model=MODEL_ID)
    messages = [
        {"role": "system",
         "content": "You answer questions about this document.\n\n" + _document(doc_sentences)},
        {"role": "user", "content": "When was the lighthouse built?"},
    ]
    gen = {"max_new_tokens": max_new_tokens, "do_sample": False}
    with tempfile.TemporaryDirectory(prefix="kvstore-hf-demo-") as tmp, _target(target, Path(tmp)) as kv:
        pc = PrefixCache(kv, spec)
        turn1 = chat_ids(tokenizer, messages)
        first = pc.generate(model, turn1, **gen)
        answer1 = tokenizer.decode(first.sequences[0, turn1.shape[1]:], skip_special_tokens=True)
        messages += [{"role": "assistant", "content": answer1},
                     {"role": "user", "content": "Who was the first keeper?"}]
        turn2 = chat_ids(tokenizer, messages)

        full_s, _ = _median_s(lambda: forward(model, turn2, None), repeats)
        restore_t, suffix_t = [], []
        for _ in range(repeats):  # the cache is extended by the forward: restore anew each time
            t1 = time.perf_counter()
            restored = pc.restore(turn2)
            t2 = time.perf_counter()
            forward(model, turn2[:, restored.num_tokens:], restored.cache)
            restore_t.append(t2 - t1)
            suffix_t.append(time.perf_counter() - t2)
        restore_s, suffix_s = statistics.median(restore_t), statistics.median(suffix_t)
        with_store_s = statistics.median([a + b for a, b in zip(restore_t, suffix_t)])
        n = restored.num_tokens

        with_store = pc.generate(model, turn2, save=False, **gen)
        with torch.no_grad():
            reference = model.generate(turn2, **gen)
        text_store = tokenizer.decode(with_store.sequences[0, turn2.shape[1]:], skip_special_tokens=True)
        text_ref = tokenizer.decode(reference[0, turn2.shape[1]:], skip_special_tokens=True)
    return {
        "model": MODEL_ID,
        "target": "in-process Store" if target == "store" else "gRPC sidecar (embedded)",
        "threads": 1,
        "block_tokens": BLOCK_TOKENS,
        "kv_bytes_per_block": spec.block_nbytes,
        "turn1": {"prompt_tokens": int(turn1.shape[1]), "blocks_saved": first.saved.num_blocks,
                  "answer": answer1},
        "turn2": {"prompt_tokens": int(turn2.shape[1]), "tokens_reused": n,
                  "tokens_prefilled": int(turn2.shape[1]) - n, "tiers": sorted(set(restored.tiers))},
        "median_s": {"full_prefill": round(full_s, 4), "restore": round(restore_s, 4),
                     "suffix_prefill": round(suffix_s, 4), "with_store": round(with_store_s, 4)},
        "prefill_speedup": round(full_s / with_store_s, 2) if with_store_s > 0 else None,
        "repeats": repeats,
        "identical": torch.equal(with_store.sequences, reference),
        "text_with_store": text_store,
        "text_full_recompute": text_ref,
        "seconds": {"load": round(load_s, 1), "total": round(time.perf_counter() - t0, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=["store", "grpc"], default="store")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--doc-sentences", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    result = run(target=args.target, repeats=args.repeats, doc_sentences=args.doc_sentences,
                 max_new_tokens=args.max_new_tokens)
    print(json.dumps(result, indent=2))
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
