"""Keep freed large buffers in the process instead of handing them back to the OS (glibc).

glibc serves big allocations (past a threshold that starts at 128 KiB) with fresh ``mmap``
pages and returns them on free, and it trims the heap top once more than twice that threshold
is free. kvstore's data path allocates and frees buffers of a block's size all the time: LMDB
mallocs the dirty pages of every write transaction, grpc every message, Python every frame.
So each NVMe commit or streamed chunk faulted its pages in again. ``python -m bench.malloc_bench``
(durable AES-GCM NVMe put, each side in its own process, 3 passes, medians) on the development
machine: 0.71 -> 1.17 GB/s with 2 MiB blocks and 0.88 -> 1.45 GB/s with 32 MiB blocks (1.64x).

:func:`retain_freed_memory` raises both thresholds with ``mallopt``: allocations up to
``mmap_threshold`` come from the heap and are reused, and up to ``trim_threshold`` of free heap
top is kept. The price is resident memory that stays after a burst (bounded by the trim
threshold per malloc arena). It is process-wide: the Store applies it when
``StoreConfig.retain_freed_memory`` is on (the default; the sidecar is its own process), and an
engine that embeds a Store and tunes its own allocator turns that off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

MiB = 1 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied: tuple[int, int] | None = None


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()  # glibc only: mallopt's parameters are glibc's
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


def retain_freed_memory(mmap_threshold: int = 64 * MiB, trim_threshold: int = 256 * MiB) -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); True when applied
    (or already applied with these values), False where the C library is not glibc or refuses
    (glibc caps the mmap threshold; a refused value leaves both settings as they were)."""
    global _applied
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if not 0 < value < 1 << 31:  # mallopt takes a C int
            raise InvalidArgument(f"{name} must be in [1, 2**31), got {value}")
    if _applied == (mmap_threshold, trim_threshold):
        return True
    libc = _libc()
    if libc is None:
        return False
    if not libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold):
        log.info("mallopt refused an mmap threshold of %d bytes", mmap_threshold)
        return False
    if not libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold):
        log.info("mallopt refused a trim threshold of %d bytes", trim_threshold)
        return False
    _applied = (mmap_threshold, trim_threshold)
    return True
