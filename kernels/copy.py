"""Byte copies between flat uint8 buffers on any device.

CPU↔CPU copies go through numpy (one memcpy, no intra-op thread pool: LIMITS.md measured torch
CPU copies with two intra-op threads collapsing to 0.26 GB/s when the other core is busy).
Anything touching a GPU uses a synchronous ``Tensor.copy_`` (DMA from/to pinned DRAM).

:func:`host_copy` is the one host memcpy of the data path. It can steer around a trap of glibc's
streaming-store copy (``memcpy`` past ``x86_non_temporal_threshold``, which ``kvstore serve``
lowers to 1 MiB: see ``kvstore.memtune``): when the destination sits just *after* the source
modulo the 4 KiB page, 0 < (dst - src) mod 4096 < 384 bytes, the copy can run at half its speed
or less. Where a block lands in a caller's buffer is the caller's business, so such a copy may
be done in 768 KiB pieces instead (:func:`copy_in_pieces`): below the 1 MiB threshold (ordinary
stores) and above the 512 KiB where glibc stops using ``rep movsb`` on AMD EPYC (``rep movsb``
has the same trouble with a short distance there).

Whether the pieces pay off depends on the machine, so it is measured where it runs, not
assumed (:class:`AliasCopyCalibration`): the first copy that falls in the window times a
2 MiB copy in pieces against one copy, the destination 16, 64 and 256 bytes past the source in
turn, 9 tries of each (three per offset) with the order of the two alternating, and uses the
pieces only when their best times are below :data:`PIECES_WIN_RATIO` times one copy's
(10–20 ms, once per process; logged at debug level). Copies outside the window never look at it.
``KVSTORE_ALIAS_COPY=on|off|auto`` (:data:`ALIAS_COPY_ENV`) forces the pieces on or off, for
reproducible runs; ``auto`` (or unset) measures.

What was seen (``python -m bench.copy_bench --alias --mib 32``, GB/s one copy -> pieces at
deltas 16–320; each run in that module's docstring): on the development machine (AMD EPYC,
glibc 2.36) the pieces were faster, 3.1–4.6 -> 5.4–6.4; on an Intel Xeon (KVM guest, 2 vCPUs,
300 MiB L3, glibc 2.36) they were slower, 4.9–13.8 -> 3.7–8.0 over five runs, and the
calibration chose one copy there in each (over 60 calibrations the pieces took 1.16–1.72x
one copy's time).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from kernels.errors import InvalidArgument

_log = logging.getLogger(__name__)


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
#: the environment variable that forces the pieces ``on`` or ``off``, or measures (``auto``)
ALIAS_COPY_ENV = "KVSTORE_ALIAS_COPY"
AliasCopyMode = Literal["on", "off", "auto"]
#: the pieces are used when their time is below this fraction of one copy's
PIECES_WIN_RATIO = 0.9
#: what the calibration copies: bytes, deltas in the window, timed tries of each method
CALIBRATION_BYTES = 2 << 20
CALIBRATION_DELTAS = (16, 64, 256)
CALIBRATION_TRIES = 9


@dataclass(frozen=True, slots=True)
class AliasCopyChoice:
    """How :func:`host_copy` copies inside the alias window."""

    pieces: bool
    """True: in :data:`ALIAS_PIECE` pieces; False: as one ``np.copyto``."""
    source: Literal["env", "measured"]
    """Forced by :data:`ALIAS_COPY_ENV`, or measured on this machine."""
    ratio: float | None = None
    """Measured only: the time in pieces / the time as one copy (:func:`choose_alias_copy`)."""


def alias_copy_mode(environ: Mapping[str, str] | None = None) -> AliasCopyMode:
    """The :data:`ALIAS_COPY_ENV` setting (unset or empty: ``auto``). Raises
    :class:`InvalidArgument` naming the variable for any other value."""
    raw = (os.environ if environ is None else environ).get(ALIAS_COPY_ENV, "")
    mode = raw.strip().lower() or "auto"
    if mode == "on" or mode == "off" or mode == "auto":
        return mode
    raise InvalidArgument(f"{ALIAS_COPY_ENV}={raw!r}: expected on, off or auto")


def choose_alias_copy(one_copy_s: Mapping[int, Sequence[float]],
                      pieces_s: Mapping[int, Sequence[float]]) -> AliasCopyChoice:
    """The choice from timings (seconds) of each method, by delta: each method's best time at
    each delta, summed over the deltas; pieces when their sum is below :data:`PIECES_WIN_RATIO`
    times one copy's. A tie goes to one copy, the plain path.
    NOTE: best times, not medians: on a loaded machine a try is now and then preempted (8 ms for
    a 0.2 ms copy), which only ever adds time. On the Intel Xeon (2 vCPUs, load 5-9) the ratio
    of medians of 9 tries ranged 1.15-3.46 over 60 calibrations and fell to 0.88 and 0.96 (the
    pieces chosen once) in others; the ratio of best times ranged 1.16-1.72 over 60. Per delta,
    so one copy's fast deltas do not stand in for its slow ones."""
    if not one_copy_s or one_copy_s.keys() != pieces_s.keys():
        raise ValueError("choose_alias_copy: need timings of both methods at the same deltas")
    times = [*one_copy_s.values(), *pieces_s.values()]
    if not all(times) or min(min(t) for t in times) <= 0:
        raise ValueError("choose_alias_copy: need positive timings of both methods at every delta")
    ratio = sum(min(pieces_s[d]) for d in pieces_s) / sum(min(one_copy_s[d]) for d in one_copy_s)
    return AliasCopyChoice(pieces=ratio < PIECES_WIN_RATIO, source="measured", ratio=ratio)


def measure_alias_copy(nbytes: int = CALIBRATION_BYTES, tries: int = CALIBRATION_TRIES,
                       clock: Callable[[], float] = time.perf_counter) -> AliasCopyChoice:
    """Time ``nbytes`` copied as one ``np.copyto`` and by :func:`copy_in_pieces`, the
    destination at :data:`CALIBRATION_DELTAS` past the source (mod a page) in turn, ``tries``
    times each after one untimed round (it faults the pages in), the order of the two
    alternating; :func:`choose_alias_copy` decides. Makes ``2 * tries + 2`` copies of ``nbytes``."""
    raw_src = np.empty(nbytes + 2 * PAGE_BYTES, np.uint8)
    raw_dst = np.empty_like(raw_src)
    raw_src.fill(0x5A)  # NOTE: untouched pages all map the one zero page, which reads from cache
    s0 = -raw_src.ctypes.data % PAGE_BYTES
    d0 = -raw_dst.ctypes.data % PAGE_BYTES
    src = raw_src[s0 : s0 + nbytes]
    methods: tuple[Callable[[np.ndarray, np.ndarray], None], ...] = (np.copyto, copy_in_pieces)
    times: tuple[dict[int, list[float]], ...] = ({}, {})
    for i in range(tries + 1):
        delta = CALIBRATION_DELTAS[i % len(CALIBRATION_DELTAS)]
        dst = raw_dst[d0 + delta : d0 + delta + nbytes]
        for m in ((0, 1) if i % 2 else (1, 0)):
            t0 = clock()
            methods[m](dst, src)
            t1 = clock()
            if i:
                times[m].setdefault(delta, []).append(t1 - t0)
    return choose_alias_copy(times[0], times[1])


class AliasCopyCalibration:
    """The per-process choice behind :func:`host_copy`: :data:`ALIAS_COPY_ENV` when it says
    ``on`` or ``off`` (read on each call, so it can change), else ``measure()``, run once, on
    the first call that needs it, by one thread while any others wait; its result is kept."""

    def __init__(self, measure: Callable[[], AliasCopyChoice] = measure_alias_copy) -> None:
        self._measure = measure
        self._lock = threading.Lock()
        self._measured: AliasCopyChoice | None = None
        # NOTE: a fork while another thread measured left the child's lock held for good (the
        # measuring thread is not in the child): the child starts with a fresh lock
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def choice(self, environ: Mapping[str, str] | None = None) -> AliasCopyChoice:
        mode = alias_copy_mode(environ)
        if mode != "auto":
            return _FORCED[mode]
        measured = self._measured
        if measured is None:
            with self._lock:
                measured = self._measured
                if measured is None:
                    measured = self._measured = self._measure()
                    _log.debug("host_copy: copies %d-%d bytes past their source (mod %d) go %s: "
                               "in pieces they took %.2fx the time of one copy (measured)",
                               1, ALIAS_WINDOW - 1, PAGE_BYTES,
                               "in pieces" if measured.pieces else "as one copy", measured.ratio or 0.0)
        return measured


_FORCED = {"on": AliasCopyChoice(pieces=True, source="env"), "off": AliasCopyChoice(pieces=False, source="env")}
#: NOTE: one per process on purpose: the choice is a property of the machine and the C library's
#: settings, which are fixed when the process starts; measuring once costs 10-20 ms.
ALIAS_CALIBRATION = AliasCopyCalibration()


def alias_copy_choice() -> AliasCopyChoice:
    """How this process's :func:`host_copy` copies inside the alias window (measuring it now if
    nobody has yet); for benches and logs."""
    return ALIAS_CALIBRATION.choice()


def copy_in_pieces(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` in :data:`ALIAS_PIECE` pieces, whatever the offsets."""
    for lo in range(0, dst.shape[0], ALIAS_PIECE):
        np.copyto(dst[lo : lo + ALIAS_PIECE], src[lo : lo + ALIAS_PIECE])


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` for flat, contiguous uint8 arrays of equal length; in pieces when
    the two sit in the slow window and this machine copies those faster in pieces (module
    docstring).
    NOTE: the pieces were used in the window on every machine, from a measurement on AMD EPYC;
    on an Intel Xeon they ran at 0.48-0.80x one copy, so the choice is now measured per process."""
    n = dst.shape[0]
    if n > ALIAS_PIECE:
        delta = dst.ctypes.data - src.ctypes.data  # NOTE: half the cost of __array_interface__
        if 0 < delta % PAGE_BYTES < ALIAS_WINDOW and ALIAS_CALIBRATION.choice().pieces:
            copy_in_pieces(dst, src)
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
