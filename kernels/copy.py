"""Byte copies between flat uint8 buffers on any device.

CPU↔CPU copies go through numpy (one memcpy, no intra-op thread pool: LIMITS.md measured torch
CPU copies with two intra-op threads collapsing to 0.26 GB/s when the other core is busy).
Anything touching a GPU uses a synchronous ``Tensor.copy_`` (DMA from/to pinned DRAM).

:func:`host_copy` is the one host memcpy of the data path. It steers around a trap of glibc's
streaming-store copy (``memcpy`` past ``x86_non_temporal_threshold``, which ``kvstore serve``
lowers to 1 MiB: see ``kvstore.memtune``): when the destination sits just *after* the source
modulo the 4 KiB page, 0 < (dst - src) mod 4096 < 384 bytes, the copy runs at half its speed
or less. Where a block lands in a caller's buffer is the caller's business, so such a copy is
done in 768 KiB pieces instead: below the 1 MiB threshold (ordinary stores) and above the
512 KiB where glibc stops using ``rep movsb`` on these AMD parts (``rep movsb`` has the same
trouble with a short distance). Measured on the development machine (AMD EPYC, glibc 2.36,
threshold 1 MiB; ``python -m bench.copy_bench --alias``): see that module's docstring.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch


def _host_view(buf: Any) -> np.ndarray | None:
    """A flat uint8 numpy view of a CPU buffer, or None for a device tensor."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            return None
        t = buf.reshape(-1)
        return (t if t.dtype == torch.uint8 else t.view(torch.uint8)).numpy()
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


PAGE_BYTES = 4096
#: destination offsets past the source (mod a page) that slow streaming copies down
ALIAS_WINDOW = 384
#: the piece size for such copies (module docstring)
ALIAS_PIECE = 768 << 10


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` for flat, contiguous uint8 arrays of equal length, in pieces when
    the two sit in the slow window (module docstring)."""
    n = dst.shape[0]
    if n > ALIAS_PIECE:
        delta = dst.ctypes.data - src.ctypes.data  # NOTE: half the cost of __array_interface__
        if 0 < delta % PAGE_BYTES < ALIAS_WINDOW:
            for lo in range(0, n, ALIAS_PIECE):
                np.copyto(dst[lo : lo + ALIAS_PIECE], src[lo : lo + ALIAS_PIECE])
            return
    np.copyto(dst, src)


def copy_blocks(pairs: Sequence[tuple[Any, Any]], pool: Executor | None = None,
                threads: int = 1, *, part: Callable[[Sequence[tuple[Any, Any]]], None] | None = None) -> None:
    """Copy every ``(dst, src)`` pair. With a ``pool`` and ``threads`` > 1, the pairs are cut
    into ``threads`` contiguous parts: ``threads - 1`` on the pool, one on the caller's thread
    (numpy and system calls let go of the GIL while they copy, so they run in parallel).
    ``part`` copies one part (default: :func:`copy_bytes` of each pair; neighbouring pairs stay
    in one part, so a ``part`` may batch them, e.g. in one system call). Returns when every
    part is done; the first error is raised then."""
    run = part if part is not None else _copy_each
    parts = min(threads, len(pairs)) if pool is not None else 1
    if parts <= 1:
        run(pairs)
        return
    assert pool is not None
    size = -(-len(pairs) // parts)
    chunks = [pairs[k : k + size] for k in range(0, len(pairs), size)]
    futures = [pool.submit(run, c) for c in chunks[1:]]
    try:
        run(chunks[0])
    finally:
        errors = [f.exception() for f in futures]  # waits for every part
    for err in errors:
        if err is not None:
            raise err


def _copy_each(pairs: Sequence[tuple[Any, Any]]) -> None:
    for dst, src in pairs:
        copy_bytes(dst, src)


def copy_bytes(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst``: flat buffers of equal byte length (numpy, tensor, bytes-like)."""
    d, s = _host_view(dst), _host_view(src)
    if d is not None and s is not None:
        if d.shape != s.shape:
            raise ValueError(f"copy_bytes: length mismatch {d.shape[0]} != {s.shape[0]}")
        host_copy(d, s)
        return
    dt = dst.reshape(-1).view(torch.uint8) if d is None else torch.from_numpy(d)
    if s is None:
        st = src.reshape(-1).view(torch.uint8)
    else:
        st = read_only_tensor(s)
    if dt.numel() != st.numel():
        raise ValueError(f"copy_bytes: length mismatch {dt.numel()} != {st.numel()}")
    # NOTE: synchronous on purpose: a source slot may be freed and reused, or a destination read
    # by numpy, right after this returns (an async D2H copy would race with both).
    dt.copy_(st)


def read_only_tensor(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``a``'s memory, writable or not, never a copy of it, for a caller that
    only reads it (e.g. an in-band Put frame, a read-only ``bytes``, copied into an HBM slot).
    NOTE: torch warns that it does not support read-only arrays, meaning writes; copying the
    array to quiet it would be one more pass over every block."""
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(a)
