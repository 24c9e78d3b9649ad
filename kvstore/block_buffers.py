"""Caller buffers given one per block (``put_bytes`` and ``get_into`` of the Store and of the
Client): checked once, here, and seen as flat byte views without a copy; and the KV tensor a
``put`` of either takes (:func:`kv_blocks`), checked here for both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvstore.errors import DTypeMismatch, InvalidArgument, ShapeMismatch
from kvstore.spec import ModelSpec
from tiers.memory import holding_data


def block_views(spec: ModelSpec, bufs: Sequence[Any], n_keys: int, what: str, *,
                writable: bool = False) -> list[Any]:
    """Flat uint8 views (no copy) of one caller buffer per key, each a whole block: a torch
    tensor view for a tensor (on any device), a numpy view for anything else that exposes its
    bytes. ``writable``: the buffers are to be written (a read-only one is refused, not
    failed on halfway)."""
    if isinstance(bufs, (str, bytes, bytearray, memoryview)) or not isinstance(bufs, Sequence):
        raise InvalidArgument(f"{what}s must be a sequence of one buffer per key, got {type(bufs).__name__}")
    if len(bufs) != n_keys:
        raise ShapeMismatch(f"{len(bufs)} {what}s for {n_keys} keys")
    views = []
    for i, b in enumerate(bufs):
        # NOTE: a non-contiguous tensor reshapes into a copy: written to, the caller's buffer
        # would stay as it was (and numpy refuses one outright), so neither is taken
        if isinstance(b, torch.Tensor):
            b = holding_data(b, f"{what} {i}", writable=writable)
            if not b.is_contiguous():
                raise InvalidArgument(f"{what} {i} is not contiguous")
            v = b.reshape(-1).view(torch.uint8)
        else:
            if isinstance(b, np.ndarray) and not b.flags.c_contiguous:
                raise InvalidArgument(f"{what} {i} is not contiguous")
            try:
                v = np.frombuffer(b, dtype=np.uint8)
            except (TypeError, ValueError, BufferError) as exc:
                raise InvalidArgument(f"{what} {i} is not a buffer of bytes ({type(b).__name__}): {exc}") from None
            if writable and not v.flags.writeable:
                raise InvalidArgument(f"{what} {i} is read-only ({type(b).__name__})")
        if v.shape[0] != spec.block_nbytes:
            raise ShapeMismatch(f"{what} {i} has {v.shape[0]} bytes, a block of this spec has "
                                f"{spec.block_nbytes}")
        views.append(v)
    return views


def kv_blocks(spec: ModelSpec, kv: Any, n_keys: int) -> torch.Tensor:
    """``kv`` as the tensor of ``n_keys`` blocks a put stores: a dense tensor of shape
    ``[n_keys, 2, L, H, T, D]`` and the spec's dtype (ShapeMismatch, DTypeMismatch), a lazily
    negated or conjugated view resolved to the values it shows."""
    if not isinstance(kv, torch.Tensor):
        raise InvalidArgument(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    holding_data(kv, "kv")
    if kv.layout != torch.strided:
        raise InvalidArgument(f"kv must be a dense tensor, got layout {kv.layout}")
    kv = kv.resolve_neg().resolve_conj()  # NOTE: lazy views show values their bytes do not hold
    want = (n_keys, *spec.block_shape)
    if tuple(kv.shape) != want:
        raise ShapeMismatch(f"kv has shape {tuple(kv.shape)}, expected {want} "
                            f"([num_keys, 2, layers, kv_heads, block_tokens, head_dim])")
    if kv.dtype != spec.torch_dtype:
        raise DTypeMismatch(f"kv has dtype {kv.dtype}, spec says {spec.torch_dtype}")
    return kv
