"""Encode-ahead for the NVMe tier: values encoded on a background thread, in order, while the
tier's owner thread stores (and commits) the previous ones.

LMDB's write transaction must stay on the thread that opened it, so the owner thread writes;
encoding (byte-shuffle, zstd, AES-GCM: all release the GIL) runs here, at most ``depth`` values
ahead, into a small pool of reused output buffers (a fresh 32 MiB buffer per value costs more in
page faults than the cipher does).

Guarantees:

* :meth:`EncodeAhead.take` returns a value only for the job announced for the same block
  (tenant, key), the same quantization and the same source buffer (address and length);
  anything else is ``None`` and the caller encodes inline. An encoding error is re-raised by
  ``take`` on the owner thread, never swallowed.
* :meth:`EncodeAhead.close` returns only when no job reads a source buffer any more: callers
  may free or reuse their buffers after it.

Unsafe unless one owner thread calls ``take``/``release``/``close`` (the Store's lock).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.quantization import Quantization
from tiers.base import BlockRef

#: ``encode(ref, data, quant, out) -> encoded length`` (the tier's codec, bound).
Encoder = Callable[[BlockRef, np.ndarray, "Quantization | None", np.ndarray], int]


@dataclass(frozen=True, slots=True)
class AheadJob:
    """One value to encode ahead: the block, its bytes (a host uint8 array) and its format."""

    ref: BlockRef
    data: np.ndarray
    quant: Quantization | None


def _source_id(data: Any) -> tuple[int, int] | None:
    if not isinstance(data, np.ndarray):
        return None
    return (data.__array_interface__["data"][0], data.nbytes)


class BufferPool:
    """Reused output buffers of at least ``nbytes`` (kept: at most ``keep``)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[np.ndarray] = []

    def acquire(self, nbytes: int) -> np.ndarray:
        while self._free:
            buf = self._free.pop()
            if buf.shape[0] >= nbytes:
                return buf
        return np.empty(nbytes, dtype=np.uint8)

    def release(self, buf: np.ndarray) -> None:
        if len(self._free) < self._keep:
            self._free.append(buf)


class EncodeAhead:
    """One pipelined call's jobs (see the module docstring)."""

    def __init__(self, executor: ThreadPoolExecutor, encode: Encoder, buffers: BufferPool,
                 max_nbytes: Callable[[BlockRef], int], jobs: Sequence[AheadJob],
                 depth: int = 2) -> None:
        self._executor = executor
        self._encode = encode
        self._buffers = buffers
        self._max_nbytes = max_nbytes
        self._jobs = list(jobs)
        self._depth = max(1, depth)
        self._next = 0
        self._pending: dict[tuple[str, bytes], tuple[AheadJob, Future[int], np.ndarray]] = {}
        self._closed = False
        self._fill()

    def _fill(self) -> None:
        while not self._closed and len(self._pending) < self._depth and self._next < len(self._jobs):
            job = self._jobs[self._next]
            self._next += 1
            if job.ref.ident in self._pending or _source_id(job.data) is None:
                continue
            buf = self._buffers.acquire(self._max_nbytes(job.ref))
            fut = self._executor.submit(self._encode, job.ref, job.data, job.quant, buf)
            self._pending[job.ref.ident] = (job, fut, buf)

    def take(self, ref: BlockRef, data: Any, quant: Quantization | None) -> tuple[np.ndarray, int] | None:
        """The encoded value of this block as (buffer, length), or None (encode inline).
        Hand the buffer back with :meth:`release` once it is stored."""
        entry = self._pending.pop(ref.ident, None)
        if entry is None:
            return None
        job, fut, buf = entry
        try:
            n = fut.result()
        except BaseException:
            self._buffers.release(buf)
            raise
        finally:
            self._fill()
        if job.quant != quant or _source_id(job.data) != _source_id(data):
            self._buffers.release(buf)
            return None
        return buf, n

    def release(self, buf: np.ndarray) -> None:
        self._buffers.release(buf)

    def close(self) -> None:
        """Drop the jobs not taken; returns once none of them runs any more."""
        self._closed = True
        # Cancel every queued job first, then wait (without raising: nobody took these) for the
        # one that is running, so none starts in between.
        running = [fut for _, fut, _ in self._pending.values() if not fut.cancel()]
        wait(running)
        for _, _, buf in self._pending.values():
            self._buffers.release(buf)
        self._pending.clear()
