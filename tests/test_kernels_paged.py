"""kernels.paged: gather/scatter between engine paged KV caches and store blocks is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.paged import (
    PagedLayout,
    cache_geometry,
    gather_blocks,
    gather_layer,
    scatter_blocks,
    scatter_layer,
)
from kvstore.errors import DTypeMismatch, InvalidArgument, ShapeMismatch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA not available"))]  # fmt: skip


def layer_shape(layout, num_blocks, bs, heads, dim):
    return {
        PagedLayout.BLOCKS_FIRST: (num_blocks, 2, bs, heads, dim),
        PagedLayout.KV_FIRST: (2, num_blocks, bs, heads, dim),
        PagedLayout.CPU_FUSED: (num_blocks, heads, bs, 2 * dim),
        PagedLayout.CPU_SPLIT: (num_blocks, heads, bs, 2 * dim),
        PagedLayout.CPU_SPLIT_KDIM: (num_blocks, heads, bs, 2 * dim),
    }[layout]


def make_layers(layout, num_layers, num_blocks, bs, heads, dim, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shape = layer_shape(layout, num_blocks, bs, heads, dim)
    return [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(num_layers)]


def engine_token(cache, layout, block, kv, token, head):
    """Reference accessor: the head_dim vector of one (engine block, kv, token, head)."""
    if layout is PagedLayout.BLOCKS_FIRST:
        return cache[block, kv, token, head]
    if layout is PagedLayout.KV_FIRST:
        return cache[kv, block, token, head]
    nb, heads, bs, dim2 = cache.shape
    dim = dim2 // 2
    if layout is PagedLayout.CPU_FUSED:
        return cache[block, head, token, kv * dim : (kv + 1) * dim]
    slab = cache.reshape(nb, heads, 2, bs * dim)[block, head, kv]  # K slab, then V slab
    if layout is PagedLayout.CPU_SPLIT_KDIM and kv == 0:
        return slab.view(dim, bs)[:, token]  # K dim-major [D, bs]
    return slab.view(bs, dim)[token]  # token-major [bs, D]


def reference_gather(layers, table, layout, tokens):
    """Slow, obviously-correct gather: one vector at a time."""
    _, bs, heads, dim = cache_geometry(layers[0], layout)
    k = tokens // bs
    n = len(table) // k
    out = torch.empty((n, 2, len(layers), heads, tokens, dim), dtype=layers[0].dtype)
    for i in range(n):
        for layer, cache in enumerate(layers):
            for kv in range(2):
                for head in range(heads):
                    for t in range(tokens):
                        block = table[i * k + t // bs]
                        out[i, kv, layer, head, t] = engine_token(
                            cache.cpu(), layout, block, kv, t % bs, head)  # fmt: skip
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(PagedLayout))
@pytest.mark.parametrize("engine_blocks_per_store_block", [1, 2])
def test_paged_gather_matches_reference_on_each_layout(device, layout, engine_blocks_per_store_block):
    bs, k = 4, engine_blocks_per_store_block
    layers = make_layers(layout, 3, 12, bs, 2, 5, torch.float16, seed=1, device=device)
    table = torch.randperm(12, generator=torch.Generator().manual_seed(2))[: 3 * k].tolist()
    out = gather_blocks(layers, table, layout, block_tokens=bs * k)
    assert out.shape == (3, 2, 3, 2, bs * k, 5) and out.device.type == device
    assert torch.equal(out.cpu(), reference_gather(layers, table, layout, bs * k))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(PagedLayout))
def test_paged_scatter_writes_only_named_slots_and_gathers_back(device, layout):
    layers = make_layers(layout, 2, 10, 4, 3, 8, torch.bfloat16, seed=3, device=device)
    before = [c.clone() for c in layers]
    blocks = torch.randn(3, 2, 2, 3, 8, 8).to(torch.bfloat16).to(device)
    table = [7, 0, 4, 9, 2, 5]  # 3 store blocks x 2 engine blocks
    scatter_blocks(blocks, layers, table, layout)
    assert torch.equal(gather_blocks(layers, table, layout, block_tokens=8), blocks)
    untouched = sorted(set(range(10)) - set(table))
    axis = layout.block_axis
    for cache, old in zip(layers, before):
        sel = torch.tensor(untouched, device=device)
        assert torch.equal(cache.index_select(axis, sel), old.index_select(axis, sel))


@pytest.mark.parametrize("layout", list(PagedLayout))
def test_paged_gather_into_preallocated_out_and_layer_by_layer(layout):
    layers = make_layers(layout, 4, 6, 2, 1, 4, torch.float32, seed=4)
    table = torch.tensor([5, 1, 3], dtype=torch.int32)
    out = torch.full((3, 2, 4, 1, 2, 4), float("nan"))
    assert gather_blocks(layers, table, layout, out=out) is out
    expected = reference_gather(layers, table.tolist(), layout, 2)
    assert torch.equal(out, expected)
    # one layer at a time into a strided view, then back into a fresh cache
    fresh = [torch.zeros_like(c) for c in layers]
    for layer in range(4):
        view = torch.empty(3, 2, 1, 2, 4)
        gather_layer(layers[layer], table, layout, view)
        assert torch.equal(view, expected[:, :, layer])
        scatter_layer(view, fresh[layer], table, layout)
    assert torch.equal(gather_blocks(fresh, table, layout), expected)


def test_paged_gather_allows_repeated_blocks_and_empty_table():
    layout = PagedLayout.BLOCKS_FIRST
    layers = make_layers(layout, 1, 4, 2, 1, 2, torch.float32, seed=5)
    out = gather_blocks(layers, [2, 2], layout)
    assert torch.equal(out[0], out[1])
    empty = gather_blocks(layers, [], layout)
    assert empty.shape == (0, 2, 1, 1, 2, 2)


def test_paged_rejects_misuse():
    layout = PagedLayout.BLOCKS_FIRST
    layers = make_layers(layout, 2, 4, 2, 1, 2, torch.float32, seed=6)
    blocks = torch.zeros(2, 2, 2, 1, 2, 2)
    with pytest.raises(InvalidArgument):  # out of range
        gather_blocks(layers, [0, 4], layout)
    with pytest.raises(InvalidArgument):  # negative
        gather_blocks(layers, [-1, 0], layout)
    with pytest.raises(InvalidArgument):  # duplicate slot on scatter
        scatter_blocks(blocks, layers, [1, 1], layout)
    with pytest.raises(InvalidArgument):  # float table
        gather_blocks(layers, torch.tensor([0.0, 1.0]), layout)
    with pytest.raises(ShapeMismatch, match="not a whole number of store blocks"):
        gather_blocks(layers, [0, 1, 2], layout, block_tokens=4)  # table does not fill whole store blocks
    for scalar in (torch.tensor(1), np.int64(1), np.array(1), 1):  # was TypeError from len()
        with pytest.raises(InvalidArgument, match="1-D"):
            gather_blocks(layers, scalar, layout)
    with pytest.raises(ShapeMismatch):  # T not a multiple of the engine block size
        gather_blocks(layers, [0, 1], layout, block_tokens=3)
    with pytest.raises(DTypeMismatch):
        scatter_blocks(blocks.half(), layers, [0, 1], layout)
    with pytest.raises(ShapeMismatch):  # wrong layer count
        scatter_blocks(torch.zeros(2, 2, 3, 1, 2, 2), layers, [0, 1], layout)
    with pytest.raises(ShapeMismatch):  # wrong rank for the layout
        gather_blocks(layers, [0], PagedLayout.CPU_FUSED)
    with pytest.raises(ShapeMismatch):  # heads mismatch
        scatter_layer(torch.zeros(1, 2, 2, 2, 2), layers[0], [0], layout)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(list(PagedLayout)),
    num_layers=st.integers(1, 3),
    num_blocks=st.integers(1, 9),
    bs=st.integers(1, 4),
    k=st.integers(1, 3),
    heads=st.integers(1, 3),
    dim=st.integers(1, 6),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                           torch.int8, torch.uint8]),
    data=st.data(),
)
def test_paged_gather_scatter_property(layout, num_layers, num_blocks, bs, k, heads, dim, dtype, data):
    seed = data.draw(st.integers(0, 2**16))
    # a random table of distinct slots, a whole number of store blocks
    n = data.draw(st.integers(0, num_blocks // k))
    table = data.draw(st.permutations(range(num_blocks)))[: n * k]
    gen = torch.Generator().manual_seed(seed)
    shape = layer_shape(layout, num_blocks, bs, heads, dim)
    layers = [torch.randint(-100, 100, shape, generator=gen).to(dtype) for _ in range(num_layers)]
    out = gather_blocks(layers, table, layout, block_tokens=bs * k)
    assert out.shape == (n, 2, num_layers, heads, bs * k, dim) and out.dtype == dtype
    if n:  # spot-check one element against the reference accessor
        i = data.draw(st.integers(0, n - 1))
        t = data.draw(st.integers(0, bs * k - 1))
        kv, layer, head = data.draw(st.integers(0, 1)), data.draw(st.integers(0, num_layers - 1)), 0
        ref = engine_token(layers[layer], layout, table[i * k + t // bs], kv, t % bs, head)
        # NOTE: a fresh dense copy: .contiguous() keeps a size-1 tensor's stride, and a strided
        # 2-byte tensor cannot be viewed as bytes
        dense = torch.empty(ref.shape, dtype=ref.dtype).copy_(ref)
        assert torch.equal(out[i, kv, layer, head, t].view(torch.uint8), dense.view(torch.uint8))
    # scatter into zeroed caches then gather again: identity on the named slots
    fresh = [torch.zeros_like(c) for c in layers]
    scatter_blocks(out, fresh, table, layout)
    again = gather_blocks(fresh, table, layout, block_tokens=bs * k)
    assert torch.equal(again.view(torch.uint8), out.view(torch.uint8))


@pytest.mark.parametrize("layout", list(PagedLayout))
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_paged_one_byte_dtypes_move_bytes_exactly(layout, dtype):
    """Regression: CPU has no index_copy_ kernel for fp8; such caches must still round-trip."""
    layers = [t.to(dtype) for t in make_layers(layout, 2, 6, 2, 2, 4, torch.float32, seed=7)]
    table = [4, 0, 5]
    out = gather_blocks(layers, table, layout)
    fresh = [torch.zeros_like(c) for c in layers]
    scatter_blocks(out, fresh, table, layout)
    sel = torch.tensor(table)
    for cache, old in zip(fresh, layers):
        got = cache.view(torch.uint8).index_select(layout.block_axis, sel)
        assert torch.equal(got, old.view(torch.uint8).index_select(layout.block_axis, sel))


# -- vLLM 0.32 CPU cache: what kvstore.integrations.vllm does by hand, as one layout ---------------
def connector_gather(cache, table, k_dim_major):
    """The connector's path (kept in step with kvstore/integrations/vllm.py, which imports vLLM):
    a BLOCKS_FIRST view of [nb, H, 2, bs, D], then K transposed from [D, T] bytes to [T, D]."""
    nb, heads, bs, dim2 = cache.shape
    canon = cache.view(nb, heads, 2, bs, dim2 // 2).permute(0, 2, 3, 1, 4)
    out = torch.empty(len(table), 2, heads, bs, dim2 // 2, dtype=cache.dtype)
    gather_layer(canon, table, PagedLayout.BLOCKS_FIRST, out)
    if k_dim_major:  # k_to_token_major
        k = out[:, 0]
        k.copy_(k.reshape(len(table), heads, dim2 // 2, bs).transpose(-1, -2).clone())
    return out


@pytest.mark.parametrize(("layout", "k_dim_major"), [(PagedLayout.CPU_SPLIT, False),
                                                     (PagedLayout.CPU_SPLIT_KDIM, True)])
def test_paged_vllm_cpu_split_layouts_match_the_connector_path(layout, k_dim_major):
    nb, heads, bs, dim = 6, 2, 4, 3
    cache = torch.randn(nb, heads, bs, 2 * dim)  # the tensor vLLM 0.32 allocates
    table = [4, 0, 5]
    want = connector_gather(cache, table, k_dim_major)
    out = torch.empty(3, 2, heads, bs, dim)
    assert torch.equal(gather_layer(cache, table, layout, out), want)
    # and back: scatter writes the engine's bytes where the connector's scatter would
    back = torch.zeros_like(cache)
    scatter_layer(out, back, table, layout)
    for b in range(nb):
        assert torch.equal(back[b], cache[b] if b in table else torch.zeros_like(cache[b]))


def test_paged_cpu_split_kdim_gathers_tokens_written_dim_major():
    """A K written the way vLLM's ``vec`` CPU kernel writes it comes out canonical [T, D]."""
    nb, heads, bs, dim = 3, 2, 4, 5
    key = torch.randn(2 * bs, heads, dim)  # tokens 0..7 in engine blocks 2 then 0
    value = torch.randn(2 * bs, heads, dim)
    cache = torch.zeros(nb, heads, bs, 2 * dim)
    slabs = cache.view(nb, heads, 2, bs * dim)
    for t in range(2 * bs):
        block, s = (2, 0)[t // bs], t % bs
        slabs[block, :, 0].view(heads, dim, bs)[:, :, s] = key[t]  # K slab [D, bs]
        slabs[block, :, 1].view(heads, bs, dim)[:, s] = value[t]  # V slab [bs, D]
    blocks = gather_blocks([cache], [2, 0], PagedLayout.CPU_SPLIT_KDIM, block_tokens=2 * bs)
    assert torch.equal(blocks[0, 0, 0], key.transpose(0, 1))
    assert torch.equal(blocks[0, 1, 0], value.transpose(0, 1))
