"""Triton kernels for :mod:`kernels.shuffle_tensor`: byte-shuffle and its inverse on a device.

Imports triton: import this module only after :func:`kernels.backend.use_triton` said so.

Both kernels move a ``[BLOCK, ITEMSIZE]`` tile of bytes per program: the item side is read
(shuffle) or written (unshuffle) as one contiguous run of ``BLOCK * itemsize`` bytes, each plane
side as ``itemsize`` contiguous runs of ``BLOCK`` bytes, so both sides are coalesced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # items per program


@triton.jit
def _shuffle_kernel(src_ptr, out_ptr, n, ITEMSIZE: tl.constexpr, ITEM_PAD: tl.constexpr,
                    BLOCK: tl.constexpr, UNSHUFFLE: tl.constexpr):
    items = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    byte = tl.arange(0, ITEM_PAD)
    mask = (items < n)[:, None] & (byte < ITEMSIZE)[None, :]
    interleaved = items[:, None] * ITEMSIZE + byte[None, :]  # byte j of item i
    planar = byte[None, :] * n + items[:, None]  # item i of plane j
    if UNSHUFFLE:
        tl.store(out_ptr + interleaved, tl.load(src_ptr + planar, mask=mask), mask=mask)
    else:
        tl.store(out_ptr + planar, tl.load(src_ptr + interleaved, mask=mask), mask=mask)


def run(src: torch.Tensor, itemsize: int, out: torch.Tensor, *, unshuffle: bool) -> None:
    """Shuffle (or unshuffle) flat contiguous uint8 ``src`` into ``out`` (checked by the caller)."""
    n = src.numel() // itemsize
    if n == 0:
        return
    _shuffle_kernel[(triton.cdiv(n, _BLOCK),)](
        src, out, n, ITEMSIZE=itemsize, ITEM_PAD=triton.next_power_of_2(itemsize), BLOCK=_BLOCK,
        UNSHUFFLE=unshuffle, enable_fp_fusion=False)


__all__ = ["run"]
