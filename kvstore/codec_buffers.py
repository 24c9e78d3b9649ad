"""The buffers at the boundary of :class:`kvstore.codec.Codec` -- what encode stores for the
caller's block (:func:`block_source`), where encode writes a value (:func:`value_output`) and
where decode writes a block (:func:`block_output`), all as flat uint8 numpy arrays -- and the pool
of chunk-sized scratch buffers its threads share (:class:`ScratchPool`).

Contract: a lossless block is only *viewed* (no copy, except a torch tensor on a device, which
is copied to the host); a quantized one becomes its :mod:`kvstore.quantization` payload. The
output helpers allocate only when the caller passed no buffer. A buffer that does not fit raises
:class:`~kvstore.errors.InvalidArgument` (encode: non-contiguous, read-only, too short, not a
buffer) or :class:`~kvstore.errors.ShapeMismatch` (a block of the wrong size; decode's ``out``).
:class:`ScratchPool` is thread-safe; a buffer handed out is owned by the caller until released.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from kvstore.errors import InvalidArgument, ShapeMismatch
from kvstore.quantization import (
    QuantArg,
    Quantization,
    as_quantization,
    pack_payload,
    quantizable,
    tensor_bytes,
)
from kvstore.spec import ModelSpec


class ScratchPool:
    """Reusable chunk-sized uint8 buffers (one owner: this lock). Keeps at most ``keep``."""

    def __init__(self, nbytes: int, keep: int) -> None:
        self.nbytes = nbytes
        self._keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int = 0) -> np.ndarray:
        """A buffer of at least ``max(nbytes, self.nbytes)`` bytes (one larger than the pool's
        size is allocated for this call and not kept)."""
        if nbytes > self.nbytes:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            if self._free:
                return self._free.pop()
        return np.empty(self.nbytes, dtype=np.uint8)

    def release(self, buf: np.ndarray) -> None:
        if buf.shape[0] != self.nbytes:
            return
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)


def as_bytes_array(data: Any, what: str) -> np.ndarray:
    """``data`` (a C-contiguous numpy array or any contiguous buffer) as a flat uint8 view."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise InvalidArgument(f"{what} must be C-contiguous")
        return data.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(data)
    except TypeError:
        raise InvalidArgument(
            f"{what} must be a numpy array or a buffer, got {type(data).__name__} "
            "(torch: pass tensor.view(torch.uint8).numpy())"
        ) from None
    if not mv.contiguous:
        raise InvalidArgument(f"{what} must be contiguous")
    return np.frombuffer(mv.cast("B"), dtype=np.uint8)


def host_bytes(data: Any) -> Any:
    """A torch tensor's bytes as a host numpy array (a view on CPU, a copy from a device);
    anything else is returned as is."""
    if isinstance(data, torch.Tensor):
        t = tensor_bytes(data)
        return (t if t.device.type == "cpu" else t.cpu()).numpy()
    return data


def block_source(data: Any, spec: ModelSpec, quant: QuantArg) -> tuple[np.ndarray, int, Quantization | None]:
    """What encode stores for the block ``data``: (bytes, shuffle unit, quantization stored).
    Lossless: the block's own bytes, shuffled by itemsize. With ``quant``: the quantized payload,
    1-byte units, nothing to shuffle -- or the block lossless when quantizing it does not pay."""
    q = as_quantization(quant)
    if q is not None and not quantizable(spec):
        raise InvalidArgument(f"blocks of dtype {spec.dtype!r} cannot be quantized "
                              "(only float16, bfloat16 and float32)")
    payload = pack_payload(data, spec, q) if q is not None else None
    if payload is not None:
        return payload, 1, q
    nbytes, src = spec.block_nbytes, as_bytes_array(host_bytes(data), "data")
    if src.size != nbytes:
        raise ShapeMismatch(f"data has {src.size} bytes but the spec's block holds {nbytes}")
    return src, spec.itemsize, None


def block_output(out: np.ndarray | None, nbytes: int) -> np.ndarray:
    """Where decode writes a block of ``nbytes``: the caller's ``out``, or a new array."""
    if out is None:
        return np.empty(nbytes, dtype=np.uint8)
    if (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 1
            or out.size != nbytes or not out.flags.c_contiguous or not out.flags.writeable):
        raise ShapeMismatch(f"out must be a writable contiguous 1-D uint8 array of {nbytes} bytes")
    return out


def value_output(out: Any, total: int) -> tuple[Any, np.ndarray]:
    """(object to return, uint8 view to write): a new buffer, or the caller's ``out``."""
    if out is None:
        # NOTE: np.empty, not bytearray(total): bytearray zero-fills, and for 32 MiB that
        # measured 7x slower than numpy's allocation (which also asks for huge pages).
        arr = np.empty(total, dtype=np.uint8)
        return memoryview(arr), arr
    dst = as_bytes_array(out, "out")
    if not dst.flags.writeable:
        raise InvalidArgument("out must be writable")
    if dst.size < total:
        raise InvalidArgument(f"out holds {dst.size} bytes; this value needs {total}")
    return out, dst
