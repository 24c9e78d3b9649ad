"""Triton kernel for :mod:`kernels.paged`: gather/scatter between paged caches and store blocks.

Imports triton: import this module only after :func:`kernels.backend.use_triton` said so.

One launch moves every layer: program ``(j, kv*H + h, layer)`` copies the ``[bs, D]`` tile of
engine block ``table[j]`` (K or V, head ``h``) to/from token rows ``(j % k)*bs ...`` of store block
``j // k``, directly between the two tensors (the torch path goes through an ``index_select``
scratch buffer: twice the memory traffic and two launches per layer). Layers are reached through a
device table of their base addresses, so they need not be one tensor, only share shape, dtype and
strides. Elements move as same-size integers: the copy is bit-exact for every dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.errors import ShapeMismatch
from kernels.paged import PagedLayout

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TILE = 4096  # elements per tile (BLOCK_S * D_PAD)


@triton.jit
def _paged_kernel(layer_ptrs, store_ptr, table_ptr, K, H, BS, D,
                  s_block, s_kv, s_head, s_tok_k, s_dim_k, s_tok_v, s_dim_v,
                  o_block, o_kv, o_layer, o_head, o_tok, o_dim,
                  GATHER: tl.constexpr, BLOCK_S: tl.constexpr, D_PAD: tl.constexpr):
    j = tl.program_id(0)
    kv = tl.program_id(1) // H
    h = tl.program_id(1) % H
    layer = tl.program_id(2)
    cache = tl.load(layer_ptrs + layer).to(store_ptr.dtype, bitcast=True)
    block = tl.load(table_ptr + j)  # int64
    s_tok = tl.where(kv == 0, s_tok_k, s_tok_v)
    s_dim = tl.where(kv == 0, s_dim_k, s_dim_v)
    paged = block * s_block + kv * s_kv + h * s_head
    stored = ((j // K).to(tl.int64) * o_block + kv * o_kv + layer.to(tl.int64) * o_layer
              + h * o_head + ((j % K) * BS).to(tl.int64) * o_tok)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D_PAD)
    for s0 in range(0, BS, BLOCK_S):
        rows = s0 + offs_s
        mask = (rows < BS)[:, None] & (offs_d < D)[None, :]
        p = paged + rows[:, None] * s_tok + offs_d[None, :] * s_dim
        q = stored + rows[:, None] * o_tok + offs_d[None, :] * o_dim
        if GATHER:
            tl.store(store_ptr + q, tl.load(cache + p, mask=mask), mask=mask)
        else:
            tl.store(cache + p, tl.load(store_ptr + q, mask=mask), mask=mask)


def _cache_strides(cache: torch.Tensor, layout: PagedLayout) -> tuple[int, ...]:
    """``(block, kv, head, tok_k, dim_k, tok_v, dim_v)`` element strides of one layer's cache."""
    st = cache.stride()
    if layout is PagedLayout.BLOCKS_FIRST:
        return st[0], st[1], st[3], st[2], st[4], st[2], st[4]
    if layout is PagedLayout.KV_FIRST:
        return st[1], st[0], st[3], st[2], st[4], st[2], st[4]
    _, _, bs, dim2 = cache.shape
    dim = dim2 // 2
    if layout is PagedLayout.CPU_FUSED:
        return st[0], dim * st[3], st[1], st[2], st[3], st[2], st[3]
    if bs > 1 and st[2] != dim2 * st[3]:
        raise ShapeMismatch(f"{layout.value} cache must have its last two axes contiguous")
    slab = bs * dim * st[3]
    if layout is PagedLayout.CPU_SPLIT:
        return st[0], slab, st[1], dim * st[3], st[3], dim * st[3], st[3]
    return st[0], slab, st[1], st[3], bs * st[3], dim * st[3], st[3]  # CPU_SPLIT_KDIM


def move(layers: Sequence[torch.Tensor], idx: torch.Tensor, layout: PagedLayout,
         blocks: torch.Tensor, k: int, *, gather: bool) -> None:
    """Gather layers into (or scatter from) ``blocks`` ``[n, 2, L, H, T, D]`` (a view is fine).

    Everything was checked by :mod:`kernels.paged`: same shape/dtype/device for all layers,
    ``idx`` int64 on their device with ``n * k`` valid (for scatter: distinct) entries.
    """
    from kernels.paged import cache_geometry

    first = layers[0]
    _, bs, heads, dim = cache_geometry(first, layout)
    if idx.numel() == 0 or heads == 0 or dim == 0 or bs == 0:
        return
    groups = [list(layers)]
    if any(c.stride() != first.stride() for c in layers):  # one launch per layer instead
        groups = [[c] for c in layers]
    raw = _RAW[first.element_size()]
    store = blocks.view(raw)
    o_block, o_kv, o_layer, o_head, o_tok, o_dim = store.stride()
    d_pad = triton.next_power_of_2(dim)
    block_s = min(triton.next_power_of_2(bs), max(1, _TILE // d_pad))
    first_layer = 0
    for group in groups:
        ptrs = torch.tensor([c.data_ptr() for c in group], dtype=torch.int64).to(first.device)
        strides = _cache_strides(group[0], layout)
        base = store[:, :, first_layer:]
        _paged_kernel[(idx.numel(), 2 * heads, len(group))](
            ptrs, base, idx, k, heads, bs, dim, *strides,
            o_block, o_kv, o_layer, o_head, o_tok, o_dim,
            GATHER=gather, BLOCK_S=block_s, D_PAD=d_pad, enable_fp_fusion=False)
        first_layer += len(group)


__all__ = ["move"]
