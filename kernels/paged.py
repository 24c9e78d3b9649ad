"""Paged gather/scatter: move the blocks named by an engine's block table between a paged KV
cache and store blocks ``[n, 2, L, H, T, D]`` (``T`` = the store's block tokens).

Primitives (torch reference, device-agnostic: every op runs on the tensors' device)::

    gather_layer(cache, table, layout, out)      # one layer:  cache -> out   [n, 2, H, T, D]
    scatter_layer(src, cache, table, layout)     # one layer:  src   -> cache (in place)
    gather_blocks(layers, table, layout, out=None) -> Tensor   # all layers -> [n, 2, L, H, T, D]
    scatter_blocks(blocks, layers, table, layout)              # all layers, in place

Engine layouts (one tensor per layer, ``bs`` = engine block size in tokens):

* ``PagedLayout.BLOCKS_FIRST``: ``[num_blocks, 2, bs, heads, head_dim]``
* ``PagedLayout.KV_FIRST``:     ``[2, num_blocks, bs, heads, head_dim]``
* ``PagedLayout.CPU_FUSED``:    ``[num_blocks, heads, bs, 2 * head_dim]`` (K in the first
  ``head_dim`` of the last axis, V in the second: the CPU layout as older vLLM documented it).
* ``PagedLayout.CPU_SPLIT``:    vLLM 0.32's CPU cache. The tensor vLLM allocates is
  ``[num_blocks, heads, bs, 2 * head_dim]`` (same shape as ``CPU_FUSED``, other meaning); its
  kernels write it as ``[num_blocks, heads, 2, bs, head_dim]``: per (block, head) a K slab of
  ``bs * head_dim`` values, then a V slab, both read token-major ``[bs, head_dim]``. For ISAs
  whose K slab is not token-major this moves the engine's bytes unchanged (a bijection).
* ``PagedLayout.CPU_SPLIT_KDIM``: as ``CPU_SPLIT`` but the K slab is dim-major
  ``[head_dim, bs]`` (vLLM 0.32's ``vec`` CPU attention ISA); gathered K comes out canonical
  ``[T, head_dim]``, so no transposing pass is needed after a gather or before a scatter.

The store block size ``T`` must be a multiple ``k`` of ``bs``; store block ``i`` is made of the
engine blocks ``table[i*k : (i+1)*k]`` in token order, so ``len(table) == n * k``.

Contracts:

* Copies are exact (same dtype on both sides; no conversion; 1-byte float dtypes such as fp8
  are moved as their bytes) — gather then scatter into the same slots is the identity, and
  scatter then gather returns the source blocks.
* Each layer moves with one ``index_select`` into a scratch buffer (reused across layers by the
  ``*_blocks`` calls) plus one strided ``copy_`` (scatter: ``copy_`` then ``index_copy_``);
  ``out`` is filled in place.
* A table is checked before use: 1-D integers in ``[0, num_blocks)``, and, for scatter, no
  duplicates (two sources for one slot would make the result order-dependent). The check runs
  where the table lives: pass a list or CPU tensor to keep a CUDA stream free of syncs. The
  ``*_blocks`` calls check the table once for all layers, and everything before writing.
* Only the cache slots named by the table are written by a scatter.
* ``backend`` (:mod:`kernels.backend`): ``"auto"`` runs :mod:`kernels.triton_paged` on CUDA when
  triton imports (one kernel launch moves every layer, with no scratch buffer), the torch code
  otherwise. Both move the same bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kernels.backend import Backend, use_triton
from kernels.errors import DTypeMismatch, InvalidArgument, ShapeMismatch


class PagedLayout(str, enum.Enum):
    """Per-layer layout of an engine's paged KV cache."""

    BLOCKS_FIRST = "blocks_first"  # [num_blocks, 2, bs, heads, head_dim]
    KV_FIRST = "kv_first"  # [2, num_blocks, bs, heads, head_dim]
    CPU_FUSED = "cpu_fused"  # [num_blocks, heads, bs, 2 * head_dim]
    CPU_SPLIT = "cpu_split"  # [num_blocks, heads, bs, 2 * head_dim] as [nb, heads, 2, bs, head_dim]
    CPU_SPLIT_KDIM = "cpu_split_kdim"  # as CPU_SPLIT, K slab [head_dim, bs]

    @property
    def fused_shape(self) -> bool:
        """The cache tensor is ``[num_blocks, heads, bs, 2 * head_dim]``."""
        return self in (PagedLayout.CPU_FUSED, PagedLayout.CPU_SPLIT, PagedLayout.CPU_SPLIT_KDIM)

    @property
    def block_axis(self) -> int:
        return 1 if self is PagedLayout.KV_FIRST else 0


def cache_geometry(cache: torch.Tensor, layout: PagedLayout) -> tuple[int, int, int, int]:
    """``(num_blocks, block_size, heads, head_dim)`` of one layer's cache tensor."""
    layout = PagedLayout(layout)
    if cache.dim() != (4 if layout.fused_shape else 5):
        raise ShapeMismatch(f"{layout.value} cache has wrong rank: {tuple(cache.shape)}")
    if layout is PagedLayout.BLOCKS_FIRST:
        nb, two, bs, heads, dim = cache.shape
    elif layout is PagedLayout.KV_FIRST:
        two, nb, bs, heads, dim = cache.shape
    else:
        nb, heads, bs, dim2 = cache.shape
        two, dim = 2, dim2 // 2
        if dim2 % 2:
            raise ShapeMismatch(f"{layout.value} last axis must be 2*head_dim, got {dim2}")
    if two != 2:
        raise ShapeMismatch(f"{layout.value} cache must have a K/V axis of 2: {tuple(cache.shape)}")
    return nb, bs, heads, dim


def gather_layer(
    cache: torch.Tensor,
    table: torch.Tensor | Sequence[int],
    layout: PagedLayout,
    out: torch.Tensor,
    *,
    scratch: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Copy the blocks named by ``table`` from one layer's cache into ``out`` ``[n, 2, H, T, D]``.

    ``out`` may be a strided view (e.g. ``blocks[:, :, layer]``). ``scratch`` (optional, reused
    across layers; torch path only) receives the ``index_select``; it is resized as needed.
    Returns ``out``.
    """
    layout = PagedLayout(layout)
    nb, k = _check_layer(cache, layout, out)
    idx = _checked_table(table, cache.device, nb, out.shape[0] * k, unique=False)
    if _use_triton(backend, [cache], layout, out):
        from kernels import triton_paged

        triton_paged.move([cache], idx, layout, out.unsqueeze(2), k, gather=True)
    else:
        _gather(cache, idx, layout, out, k, scratch)
    return out


def scatter_layer(
    src: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor | Sequence[int],
    layout: PagedLayout,
    *,
    scratch: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Copy store blocks of one layer ``src`` ``[n, 2, H, T, D]`` into the cache slots in ``table``.

    ``scratch`` (optional, reused across layers; torch path only) is resized to the selection's
    shape.
    """
    layout = PagedLayout(layout)
    nb, k = _check_layer(cache, layout, src)
    idx = _checked_table(table, cache.device, nb, src.shape[0] * k, unique=True)
    if _use_triton(backend, [cache], layout, src):
        from kernels import triton_paged

        triton_paged.move([cache], idx, layout, src.unsqueeze(2), k, gather=False)
    else:
        _scatter(src, cache, idx, layout, k, scratch)


def gather_blocks(
    layers: Sequence[torch.Tensor],
    table: torch.Tensor | Sequence[int],
    layout: PagedLayout,
    *,
    block_tokens: int | None = None,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Gather every layer into store blocks ``[n, 2, L, H, T, D]``.

    ``T`` is ``out.shape[-2]`` when ``out`` is given, else ``block_tokens``, else the engine
    block size. Returns ``out`` (allocated on the cache's device if not given). The table is
    checked once for all layers.
    """
    layout = PagedLayout(layout)
    first = _check_layers(layers, layout)
    _, bs, heads, dim = cache_geometry(first, layout)
    if out is None:
        tokens = bs if block_tokens is None else block_tokens
        if tokens <= 0 or tokens % bs:
            raise ShapeMismatch(f"block_tokens {tokens} must be a positive multiple of {bs}")
        per = tokens // bs
        entries = _table_len(table)
        if entries % per:  # NOTE: it was floored, and the table check then named a length never asked for
            raise ShapeMismatch(f"block table has {entries} entries, not a whole number of store blocks "
                                f"of {per} engine blocks ({tokens} tokens of {bs})")
        n = entries // per
        out = torch.empty((n, 2, len(layers), heads, tokens, dim), dtype=first.dtype, device=first.device)
    elif out.dim() != 6 or out.shape[2] != len(layers):
        raise ShapeMismatch(f"out must be [n, 2, {len(layers)}, H, T, D], got {tuple(out.shape)}")
    nb, k = _check_layer(first, layout, out[:, :, 0])
    idx = _checked_table(table, first.device, nb, out.shape[0] * k, unique=False)
    if _use_triton(backend, layers, layout, out):
        from kernels import triton_paged

        triton_paged.move(layers, idx, layout, out, k, gather=True)
        return out
    scratch = _scratch(out.dtype, out.device)
    for layer, cache in enumerate(layers):
        _gather(cache, idx, layout, out[:, :, layer], k, scratch)
    return out


def scatter_blocks(
    blocks: torch.Tensor,
    layers: Sequence[torch.Tensor],
    table: torch.Tensor | Sequence[int],
    layout: PagedLayout,
    *,
    backend: Backend = "auto",
) -> None:
    """Scatter store blocks ``[n, 2, L, H, T, D]`` into every layer's cache, in place.

    All checks run before the first layer is written.
    """
    layout = PagedLayout(layout)
    first = _check_layers(layers, layout)
    if blocks.dim() != 6 or blocks.shape[2] != len(layers):
        raise ShapeMismatch(f"blocks must be [n, 2, {len(layers)}, H, T, D], got {tuple(blocks.shape)}")
    nb, k = _check_layer(first, layout, blocks[:, :, 0])
    idx = _checked_table(table, first.device, nb, blocks.shape[0] * k, unique=True)
    if _use_triton(backend, layers, layout, blocks):
        from kernels import triton_paged

        triton_paged.move(layers, idx, layout, blocks, k, gather=False)
        return
    scratch = _scratch(blocks.dtype, blocks.device)
    for layer, cache in enumerate(layers):
        _scatter(blocks[:, :, layer], cache, idx, layout, k, scratch)


# -- internals ----------------------------------------------------------------------------------


def _use_triton(backend: Backend, layers: Sequence[torch.Tensor], layout: PagedLayout,
                blocks: torch.Tensor) -> bool:
    """Resolve ``backend``; ``"auto"`` also keeps to torch for a split-slab cache whose last two
    axes are not contiguous (the Triton kernel addresses K|V slabs through that view; it raises
    ShapeMismatch on such a cache when ``backend="triton"`` forces it)."""
    if not use_triton(backend, layers[0], blocks):
        return False
    if backend == "auto" and layout in (PagedLayout.CPU_SPLIT, PagedLayout.CPU_SPLIT_KDIM):
        return all(c.shape[2] < 2 or c.stride(2) == c.shape[3] * c.stride(3) for c in layers)
    return True


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Same bytes, viewed as uint8 for 1-byte float dtypes (fp8 has no CPU index kernels)."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def _scratch(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _raw(torch.empty(0, dtype=dtype, device=device))


def _gather(cache: torch.Tensor, idx: torch.Tensor, layout: PagedLayout, out: torch.Tensor,
            k: int, scratch: torch.Tensor | None) -> None:
    cache, out = _raw(cache), _raw(out)
    scratch = None if scratch is None else _raw(scratch)
    if scratch is None:
        scratch = torch.index_select(cache, layout.block_axis, idx)
    else:
        torch.index_select(cache, layout.block_axis, idx, out=scratch)
    for sel, view in _canonical_views(scratch, layout, out.shape[0], k):
        out[:, sel].unflatten(-2, (k, view.shape[-2])).copy_(view)


def _scatter(src: torch.Tensor, cache: torch.Tensor, idx: torch.Tensor, layout: PagedLayout,
             k: int, scratch: torch.Tensor | None) -> None:
    src, cache = _raw(src), _raw(cache)
    scratch = None if scratch is None else _raw(scratch)
    shape = list(cache.shape)
    shape[layout.block_axis] = idx.numel()
    if scratch is None:
        scratch = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    else:
        scratch.resize_(shape)
    for sel, view in _canonical_views(scratch, layout, src.shape[0], k):
        view.copy_(src[:, sel].unflatten(-2, (k, view.shape[-2])))
    cache.index_copy_(layout.block_axis, idx, scratch)


def _check_layers(layers: Sequence[torch.Tensor], layout: PagedLayout) -> torch.Tensor:
    """All layers share one shape, dtype and device; returns the first."""
    if not layers:
        raise InvalidArgument("a paged KV cache needs at least one layer")
    first = layers[0]
    cache_geometry(first, layout)
    for cache in layers[1:]:
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ShapeMismatch(
                f"cache layers differ: {tuple(cache.shape)} {cache.dtype} {cache.device} vs "
                f"{tuple(first.shape)} {first.dtype} {first.device}"
            )
    return first


def _check_layer(cache: torch.Tensor, layout: PagedLayout, blocks: torch.Tensor) -> tuple[int, int]:
    """Check one layer's store blocks against its cache; return (num_blocks, engine blocks per store block)."""
    nb, bs, heads, dim = cache_geometry(cache, layout)
    if blocks.dim() != 5 or blocks.shape[1] != 2:
        raise ShapeMismatch(f"store layer blocks must be [n, 2, H, T, D], got {tuple(blocks.shape)}")
    _, _, b_heads, tokens, b_dim = blocks.shape
    if (b_heads, b_dim) != (heads, dim) or tokens % bs:
        raise ShapeMismatch(
            f"store blocks [n, 2, {b_heads}, {tokens}, {b_dim}] do not fit cache blocks of "
            f"{bs} tokens x {heads} heads x {dim} dims (T must be a multiple of the block size)"
        )
    if blocks.dtype != cache.dtype:
        raise DTypeMismatch(f"store blocks are {blocks.dtype}, cache is {cache.dtype}")
    if blocks.device != cache.device:
        raise InvalidArgument(f"store blocks on {blocks.device}, cache on {cache.device}")
    return nb, tokens // bs


def _table_len(table: Any) -> int:
    """How many entries a block table has, or InvalidArgument for one that is no 1-D sequence.
    NOTE: ``len(table)`` raised TypeError on a 0-d tensor or array, or a bare int."""
    if isinstance(table, torch.Tensor):
        if table.dim() != 1:
            raise InvalidArgument(f"block table must be a 1-D integer tensor, got {table.dtype} {tuple(table.shape)}")
        return table.shape[0]
    try:
        return len(table)
    except TypeError:
        raise InvalidArgument(f"block table must be a 1-D sequence of integers, got {type(table).__name__} "
                              f"{table!r:.40}") from None


def _checked_table(table: torch.Tensor | Sequence[int], device: torch.device, num_blocks: int,
                   expected: int, *, unique: bool) -> torch.Tensor:
    """Validate the table where it lives (host for lists and CPU tensors) and return it as
    int64 on ``device``."""
    if isinstance(table, torch.Tensor):
        if table.dim() != 1 or table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
            raise InvalidArgument(
                f"block table must be a 1-D integer tensor, got {table.dtype} {tuple(table.shape)}"
            )
        idx = table.to(torch.int64)
    else:
        idx = torch.from_numpy(_host_table(table))
    if idx.numel() != expected:
        raise ShapeMismatch(f"block table has {idx.numel()} entries, expected {expected}")
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= num_blocks:
            raise InvalidArgument(f"block table entries must be in [0, {num_blocks}), got [{lo}, {hi}]")
        if unique and torch.unique(idx).numel() != idx.numel():
            raise InvalidArgument("scatter block table names a cache slot twice")
    return idx.to(device, non_blocking=True)


def _host_table(table: Any) -> np.ndarray:
    """A list / numpy table as int64, checked as a tensor table is: 1-D integers (bool refused).
    NOTE: it was converted with ``torch.as_tensor(..., int64)`` unchecked: float entries were
    truncated to other slots (a scatter wrote the wrong cache blocks), bools became 1/0, and a
    nested list escaped as torch's IndexError."""
    try:
        arr = np.asarray(table if isinstance(table, np.ndarray) else list(table))
    except (TypeError, ValueError, OverflowError) as exc:  # not iterable; ragged; past int64
        raise InvalidArgument(f"block table must be a 1-D sequence of integers ({exc})") from None
    if arr.ndim == 1 and arr.size == 0:
        return np.zeros(0, dtype=np.int64)  # NOTE: numpy makes [] float64
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgument(f"block table must be a 1-D sequence of integers, got {arr.dtype} "
                              f"{tuple(arr.shape)}")
    return arr.astype(np.int64)


def _canonical_views(sel: torch.Tensor, layout: PagedLayout, n: int,
                     k: int) -> list[tuple[slice | int, torch.Tensor]]:
    """Views (no copy) of a contiguous selection of ``n*k`` engine blocks matching the store side
    ``out[:, s]`` with its T axis unflattened to ``(k, bs)``: one ``[n, 2, H, k, bs, D]`` view
    (``s = :``), or for ``CPU_SPLIT_KDIM`` one ``[n, H, k, bs, D]`` view each for K and V.

    NOTE: (k, bs) are not adjacent in memory after the permute, so merging them into T would
    copy; callers unflatten the store side's T axis into (k, bs) instead, which is always a view.
    """
    everything = slice(None)
    if layout is PagedLayout.BLOCKS_FIRST:
        _, _, bs, heads, dim = sel.shape
        return [(everything, sel.view(n, k, 2, bs, heads, dim).permute(0, 2, 4, 1, 3, 5))]
    if layout is PagedLayout.KV_FIRST:
        _, _, bs, heads, dim = sel.shape
        return [(everything, sel.view(2, n, k, bs, heads, dim).permute(1, 0, 4, 2, 3, 5))]
    _, heads, bs, dim2 = sel.shape
    dim = dim2 // 2
    if layout is PagedLayout.CPU_FUSED:
        return [(everything, sel.view(n, k, heads, bs, 2, dim).permute(0, 4, 2, 1, 3, 5))]
    if layout is PagedLayout.CPU_SPLIT:
        return [(everything, sel.view(n, k, heads, 2, bs, dim).permute(0, 3, 2, 1, 4, 5))]
    slabs = sel.view(n, k, heads, 2, bs * dim)
    k_view = slabs[:, :, :, 0].unflatten(-1, (dim, bs)).permute(0, 2, 1, 4, 3)
    v_view = slabs[:, :, :, 1].unflatten(-1, (bs, dim)).permute(0, 2, 1, 3, 4)
    return [(0, k_view), (1, v_view)]
