"""bench.shuffle_ratio's measurement on synthetic data (the real-model run is a benchmark)."""

from __future__ import annotations

import numpy as np
import torch

from bench.shuffle_ratio import ratios, to_blocks


def test_shuffle_helps_zstd_on_bf16_and_not_on_noise() -> None:
    gen = torch.Generator().manual_seed(0)
    gauss = torch.randn(1 << 20, generator=gen).to(torch.bfloat16).view(torch.uint8).numpy()
    r = ratios(gauss, 2)["zstd1"]
    assert r["shuffled"] > r["plain"] * 1.05 and r["top_plane"] > r["plain"] * 1.05
    noise = np.random.default_rng(0).integers(0, 256, 1 << 17, dtype=np.uint8)
    for v in ratios(noise, 2)["zstd1"].values():
        assert 0.95 < v <= 1.0


def test_to_blocks_cuts_whole_blocks_in_store_order() -> None:
    layers, heads, seq, dim = 3, 2, 40, 4  # 40 tokens -> 2 whole 16-token blocks
    keys = [torch.randn(1, heads, seq, dim) for _ in range(layers)]
    values = [torch.randn(1, heads, seq, dim) for _ in range(layers)]
    b = to_blocks(keys, values, torch.float16)
    assert b.shape == (2, 2, layers, heads, 16, dim) and b.dtype == torch.float16
    assert torch.equal(b[1, 1, 2, 0, 3], values[2][0, 0, 16 + 3].to(torch.float16))
    assert torch.equal(b[0, 0, 1, 1, 15], keys[1][0, 1, 15].to(torch.float16))
