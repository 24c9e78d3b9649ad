"""Byte-shuffle of torch tensors on any device (the codec's :mod:`kernels.shuffle` is numpy, host
only). Same contract: plane ``j`` (byte ``j`` of every ``itemsize``-byte item, in item order) goes
to ``out[j*n:(j+1)*n]``, ``n = numel // itemsize``; ``unshuffle_tensor`` is the exact inverse.

Primitives::

    shuffle_tensor(src, itemsize, out=None, *, backend="auto") -> Tensor     # 1-D uint8
    unshuffle_tensor(src, itemsize, out=None, *, backend="auto") -> Tensor

``src`` is any contiguous tensor (its bytes are shuffled: pass an fp16/bf16 tensor with
``itemsize=2`` for high/low byte planes); ``out`` (optional) is a contiguous uint8 tensor of the
same byte length on the same device, not overlapping ``src``. Returns ``out`` (allocated if not
given). ``backend`` (:mod:`kernels.backend`): ``"auto"`` runs :mod:`kernels.triton_shuffle` on
CUDA when triton imports, else the torch reference (one strided ``copy_``).

Use: shuffling on the GPU before a device-to-host copy moves the shuffle off the host CPU that
then runs zstd over the planes (the bytes are identical to :func:`kernels.shuffle.shuffle_into`).
"""

from __future__ import annotations

import torch

from kernels.backend import Backend, use_triton
from kernels.errors import InvalidArgument


def _flat_bytes(src: torch.Tensor, itemsize: int, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(itemsize, int) or isinstance(itemsize, bool) or itemsize < 1:
        raise InvalidArgument(f"itemsize must be a positive int, got {itemsize!r}")
    if not src.is_contiguous():
        raise InvalidArgument("src must be contiguous")
    flat = src.reshape(-1).view(torch.uint8)
    if flat.numel() % itemsize:
        raise InvalidArgument(f"length {flat.numel()} is not a multiple of itemsize {itemsize}")
    if out is None:
        out = torch.empty_like(flat)
    elif out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise InvalidArgument("out must be a 1-D contiguous uint8 tensor")
    elif out.numel() != flat.numel() or out.device != flat.device:
        raise InvalidArgument(f"out must hold {flat.numel()} bytes on {flat.device}")
    elif out.numel() and abs(out.data_ptr() - flat.data_ptr()) < out.numel():
        raise InvalidArgument("out must not overlap src")
    return flat, out


def shuffle_tensor(src: torch.Tensor, itemsize: int, out: torch.Tensor | None = None, *,
                   backend: Backend = "auto") -> torch.Tensor:
    """Split ``src``'s bytes into ``itemsize`` planes (see the module docstring)."""
    return _move(src, itemsize, out, backend, unshuffle=False)


def unshuffle_tensor(src: torch.Tensor, itemsize: int, out: torch.Tensor | None = None, *,
                     backend: Backend = "auto") -> torch.Tensor:
    """Interleave ``itemsize`` consecutive byte planes of ``src`` back into items."""
    return _move(src, itemsize, out, backend, unshuffle=True)


def _move(src: torch.Tensor, itemsize: int, out: torch.Tensor | None, backend: Backend,
          unshuffle: bool) -> torch.Tensor:
    flat, out = _flat_bytes(src, itemsize, out)
    if use_triton(backend, flat, out):
        from kernels import triton_shuffle

        triton_shuffle.run(flat, itemsize, out, unshuffle=unshuffle)
        return out
    n = flat.numel() // itemsize  # items viewed [n, itemsize] = planes viewed [itemsize, n].T
    if unshuffle:
        out.view(n, itemsize).copy_(flat.view(itemsize, n).t())
    else:
        out.view(itemsize, n).copy_(flat.view(n, itemsize).t())
    return out


__all__ = ["shuffle_tensor", "unshuffle_tensor"]
