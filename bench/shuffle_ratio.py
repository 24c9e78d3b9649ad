"""What byte-shuffling buys zstd on KV blocks: a real model's KV against random data (issue 5).

KV comes from SmolLM2-135M-Instruct (the GGUF fixture of ``bench.kv_accuracy``): the K and V
of each prompt of the accuracy set, stored as the store would store them (fp16 and bf16 blocks
``[n, 2, L, H, T, D]``, T = 16). For each, zstd level 1 (the codec's default) and level 3:

* ``plain`` — zstd over the block bytes as they are,
* ``shuffled`` — over the byte-shuffled bytes (all planes: ``kernels.shuffle.shuffle_into``),
* ``top_plane`` — the codec's default: only the top byte plane (sign + exponent) compressed,
  the low plane stored raw.

Ratios are raw bytes / stored bytes. The same for ``random`` data: Gaussian values of the same
dtype and standard deviation, and uniform random bytes (incompressible: the floor). Writes
``bench/results/shuffle_ratio.json`` and prints it.

    python -m bench.shuffle_ratio
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from kernels.shuffle import shuffle_into

RESULTS = Path(__file__).resolve().parent / "results" / "shuffle_ratio.json"
BLOCK_TOKENS = 16
LEVELS = (1, 3)


def ratios(data: np.ndarray, itemsize: int) -> dict[str, dict[str, float]]:
    """Compression ratios of ``data`` (uint8, a whole number of items) per zstd level."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    shuffled = np.empty_like(flat)
    shuffle_into(flat, itemsize, shuffled)
    plane = flat.size // itemsize
    out: dict[str, dict[str, float]] = {}
    for level in LEVELS:
        c = zstandard.ZstdCompressor(level=level)
        top = len(c.compress(shuffled[-plane:].tobytes())) + flat.size - plane
        out[f"zstd{level}"] = {
            "plain": round(flat.size / len(c.compress(flat.tobytes())), 4),
            "shuffled": round(flat.size / len(c.compress(shuffled.tobytes())), 4),
            "top_plane": round(flat.size / top, 4),
        }
    return out


def to_blocks(keys: list[torch.Tensor], values: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A prompt's cache (per layer ``[1, H, S, D]``) as whole store blocks ``[n, 2, L, H, T, D]``."""
    kv = torch.stack([torch.stack([k[0] for k in keys]), torch.stack([v[0] for v in values])])
    two, layers, heads, seq, dim = kv.shape
    n = seq // BLOCK_TOKENS
    kv = kv[:, :, :, : n * BLOCK_TOKENS].reshape(two, layers, heads, n, BLOCK_TOKENS, dim)
    return kv.permute(3, 0, 1, 2, 4, 5).to(dtype).contiguous()


def measure(blocks: torch.Tensor) -> dict[str, Any]:
    raw = blocks.view(torch.uint8).numpy()
    gen = torch.Generator().manual_seed(0)
    gauss = (torch.randn(blocks.shape, generator=gen) * float(blocks.float().std())).to(blocks.dtype)
    noise = np.random.default_rng(0).integers(0, 256, raw.size, dtype=np.uint8)
    return {"bytes": int(raw.size), "std": round(float(blocks.float().std()), 4),
            "kv": ratios(raw, blocks.element_size()),
            "gaussian": ratios(gauss.view(torch.uint8).numpy(), blocks.element_size()),
            "uniform_bytes": ratios(noise, blocks.element_size())}


def run(*, quick: bool = False) -> dict[str, Any]:
    from bench.kv_accuracy import _cache_tensors, _prefill, build_prompts, load_model
    from kvstore.integrations.smollm2 import ensure_smollm2

    torch.set_num_threads(1)
    model, tokenizer = load_model(ensure_smollm2())
    prompts = build_prompts(tokenizer, long_doc_sentences=8 if quick else 90)
    result: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1), KV computed in float32",
                              "block_tokens": BLOCK_TOKENS, "prompts": {}}
    with torch.inference_mode():
        for name, ids in prompts.items():
            keys, values = _cache_tensors(_prefill(model, ids))
            result["prompts"][name] = {
                "tokens": int(ids.shape[1]),
                **{str(dt).removeprefix("torch."): measure(to_blocks(keys, values, dt))
                   for dt in (torch.float16, torch.bfloat16)}}
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short prompts")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    result = run(quick=args.quick)
    text = json.dumps(result, indent=1)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
