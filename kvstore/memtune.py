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

:func:`reexec_with_streaming_copies` is the second knob, for block copies. glibc's ``memcpy``
switches to non-temporal (streaming) stores only past ``x86_non_temporal_threshold``, which it
sets from the cache size (48 MiB on the development machine). Below it, copying a 2 MiB block
into a tier first reads every destination line into the cache and later writes it back; the
stored block is not read again soon, so that traffic is wasted. Measured here (``python -m
bench.copy_bench``: numpy ``copyto``, 32 copies of 2 MiB): 5.6–5.8 GB/s at glibc's default,
8.8–9.2 GB/s with the threshold at 1 MiB, about the speed of one 64 MiB copy. The threshold is
a glibc *tunable*, read only when a process starts, so ``kvstore serve`` and ``kvstore bench`` re-execute themselves once with it
set in ``GLIBC_TUNABLES`` (same pid, same arguments). An engine that embeds a Store sets it in
its own environment (README, "Tuning").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
from collections.abc import Mapping

from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

MiB = 1 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied: tuple[int, int] | None = None
_entry = False  # set by process_entry(): this process may re-execute itself

NONTEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
#: glibc refuses a threshold below this (its tunable's minimum)
NONTEMPORAL_MIN = 0x4040


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


def streaming_copy_env(env: Mapping[str, str], threshold: int) -> dict[str, str] | None:
    """``env`` with glibc's non-temporal threshold set to ``threshold`` bytes in
    ``GLIBC_TUNABLES``, or None when there is nothing to change: ``threshold`` 0 (keep glibc's
    own), the threshold already set there (by the operator or an earlier re-exec: theirs wins),
    or a platform where the tunable does not exist (not glibc on x86-64)."""
    if threshold == 0:
        return None
    if not NONTEMPORAL_MIN <= threshold < 1 << 62:
        raise InvalidArgument(f"non-temporal threshold must be 0 or in [{NONTEMPORAL_MIN}, 2**62), "
                              f"got {threshold}")
    if platform.libc_ver()[0] != "glibc" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    current = env.get("GLIBC_TUNABLES", "")
    if any(item.split("=", 1)[0] == NONTEMPORAL_TUNABLE for item in current.split(":") if item):
        return None
    item = f"{NONTEMPORAL_TUNABLE}={threshold}"
    return {**env, "GLIBC_TUNABLES": f"{current}:{item}" if current else item}


def process_entry() -> None:
    """Mark this process as started by a kvstore command line (the ``kvstore`` console
    script, a benchmark run as a script): only such a process may re-execute itself."""
    global _entry
    _entry = True


def reexec_with_streaming_copies(threshold: int = 1 * MiB) -> None:
    """Re-execute this process (``sys.orig_argv``: same interpreter, flags and arguments) with
    :func:`streaming_copy_env`'s environment; returns when that has nothing to change, and
    always when :func:`process_entry` was not called (a command invoked from a library, a
    test or an engine never replaces the caller's process). Call it first thing in a command,
    before threads, open files or printed output that matter."""
    if not _entry:
        return
    env = streaming_copy_env(os.environ, threshold)
    if env is None or not sys.executable:  # an embedded interpreter has nothing to re-execute
        return
    argv = list(getattr(sys, "orig_argv", [])) or [sys.executable, *sys.argv]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:  # run on without it: it is a speed-up, not a requirement
        log.warning("could not re-execute with %s set: %s", NONTEMPORAL_TUNABLE, exc)
