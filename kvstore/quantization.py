"""Lossy storage formats of block values: which one (:class:`Quantization`) and its payload.

A quantized value stores, instead of the block's bytes, the *payload*::

    scales   little-endian float32: k_scale then v_scale (QuantizedKV.scales_bytes())
    data     the quantized block, 1 byte per element (int8 or float8_e4m3fn), block order

It is built by :func:`pack_payload` with the torch reference in :mod:`kernels.quant`, and turned
back into the spec's dtype by :func:`unpack_payload_into`. The codec compresses and encrypts the
payload like any block, so the scales are authenticated *and* confidential (they are amax
statistics of the KV, which the header would leak); the header records only the format id.

Format ids (the header's quantization byte; stable, never reused)::

    0 none (lossless) | 1 int8, per-channel keys | 2 int8, per-head keys
                      | 3 fp8 e4m3, per-channel keys | 4 fp8 e4m3, per-head keys

Error bounds are those of :mod:`kernels.quant` (INT8: ``amax / 254`` of the element's group;
FP8: ``2**-4 |x| + 2**-10 scale``; plus half an ulp of the output dtype).

Contracts:
    * Only fp16, bf16 and fp32 specs can be quantized (:func:`quantizable`); 1-byte dtypes are
      already as small as these formats.
    * :func:`pack_payload` returns None -- the caller stores the block lossless -- when the block
      holds inf or NaN (no finite scale represents it) or when the payload would not be smaller
      than the block (tiny blocks: the scales outweigh the saving).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels.copy import read_only_tensor
from kernels.quant import KeyGranularity, QuantizedKV, QuantScheme, dequantize, quantize
from kvstore.errors import InvalidArgument, ShapeMismatch
from kvstore.spec import DTYPES, ModelSpec

QUANT_NONE = 0
_FORMAT_IDS: dict[tuple[QuantScheme, str], int] = {
    (QuantScheme.INT8, "channel"): 1,
    (QuantScheme.INT8, "head"): 2,
    (QuantScheme.FP8_E4M3, "channel"): 3,
    (QuantScheme.FP8_E4M3, "head"): 4,
}
_BY_ID = {v: k for k, v in _FORMAT_IDS.items()}
_QUANTIZABLE = ("float16", "bfloat16", "float32")


@dataclass(frozen=True, slots=True)
class Quantization:
    """A lossy storage format: the scheme and how key scales are grouped.

    Attributes:
        scheme: ``QuantScheme.INT8`` or ``QuantScheme.FP8_E4M3`` (a name string is accepted).
        key_granularity: ``"channel"`` (default: one key scale per channel, where outlier
            channels live; measured better on SmolLM2) or ``"head"``.
    """

    scheme: QuantScheme
    key_granularity: KeyGranularity = "channel"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "scheme", QuantScheme(self.scheme))
        except ValueError:
            raise InvalidArgument(
                f"unknown quantization scheme {self.scheme!r}; use one of "
                f"{[s.value for s in QuantScheme]}") from None
        if self.key_granularity not in ("channel", "head"):
            raise InvalidArgument(
                f"key_granularity must be 'channel' or 'head', got {self.key_granularity!r}")

    def __str__(self) -> str:
        return f"{self.scheme.value}/{self.key_granularity}"

    @property
    def format_id(self) -> int:
        """The id written in value headers (see the module docstring)."""
        return _FORMAT_IDS[(self.scheme, self.key_granularity)]

    @classmethod
    def from_format_id(cls, format_id: int) -> Quantization | None:
        """The format of a header id (None for 0); InvalidArgument for an unknown id."""
        if format_id == QUANT_NONE:
            return None
        try:
            scheme, gran = _BY_ID[format_id]
        except KeyError:
            raise InvalidArgument(f"unknown quantization format id {format_id}") from None
        return cls(scheme, gran)  # type: ignore[arg-type]

    @classmethod
    def parse(cls, text: str) -> Quantization | None:
        """Parse ``"none"``, ``"int8"``, ``"fp8_e4m3"``, optionally with ``"/channel"`` or
        ``"/head"`` (e.g. ``"int8/head"``); a bare scheme means per-channel keys."""
        if not isinstance(text, str):
            raise InvalidArgument(f"quantization must be a string, got {type(text).__name__}")
        name, _, gran = text.strip().lower().partition("/")
        if name in ("none", "") and not gran:
            return None
        return cls(name, gran or "channel")  # type: ignore[arg-type]

    def scales_nbytes(self, spec: ModelSpec) -> int:
        """Bytes of the float32 scales of one block of ``spec``."""
        layers, heads, dim = spec.num_layers, spec.num_kv_heads, spec.head_dim
        k = layers * heads * (dim if self.key_granularity == "channel" else 1)
        return 4 * (k + layers * heads)

    def payload_nbytes(self, spec: ModelSpec) -> int:
        """Bytes of the payload (scales + 1-byte data) of one block of ``spec``."""
        return self.scales_nbytes(spec) + spec.block_nbytes // spec.itemsize


QuantArg = QuantScheme | Quantization | None
"""What ``Codec.encode(..., quant=)`` accepts: a bare scheme means per-channel keys."""


def as_quantization(quant: Any) -> Quantization | None:
    """Normalise a :data:`QuantArg` (InvalidArgument for anything else)."""
    if quant is None or isinstance(quant, Quantization):
        return quant
    if isinstance(quant, QuantScheme):
        return Quantization(quant)
    raise InvalidArgument(f"quant must be a QuantScheme, a Quantization or None, got {quant!r}")


def quantizable(spec: ModelSpec) -> bool:
    """Whether blocks of ``spec`` can be stored quantized (fp16, bf16 or fp32 KV)."""
    return DTYPES[spec.dtype][0] in _QUANTIZABLE


def worth_it(spec: ModelSpec, q: Quantization) -> bool:
    """Whether the payload is smaller than the block (false for very short blocks)."""
    return quantizable(spec) and q.payload_nbytes(spec) < spec.block_nbytes


def tensor_bytes(data: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor on its device (a view, no copy);
    InvalidArgument when it is not contiguous."""
    t = data.detach()
    if not t.is_contiguous():
        raise InvalidArgument("data must be contiguous")
    t = t.reshape(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def block_tensor(data: Any, spec: ModelSpec) -> torch.Tensor:
    """``data`` as a ``spec.block_shape`` tensor of the spec's dtype, without a copy where it can.

    ``data``: a contiguous torch tensor on any device (any dtype: its bytes are reinterpreted),
    a numpy array or any buffer of ``spec.block_nbytes`` bytes.
    """
    if isinstance(data, torch.Tensor):
        flat = tensor_bytes(data)
    else:
        arr = np.asarray(data) if isinstance(data, np.ndarray) else None
        if arr is None:
            try:
                arr = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
            except TypeError:
                raise InvalidArgument(
                    f"data must be a tensor, a numpy array or a buffer, got {type(data).__name__}"
                ) from None
        if not arr.flags.c_contiguous:
            raise InvalidArgument("data must be C-contiguous")
        arr = arr.reshape(-1).view(np.uint8)
        flat = read_only_tensor(arr)  # only read: no copy of read-only memory
    if flat.numel() != spec.block_nbytes:
        raise ShapeMismatch(f"data has {flat.numel()} bytes but the spec's block holds "
                            f"{spec.block_nbytes}")
    return flat.view(spec.torch_dtype).reshape(spec.block_shape)


def pack_payload(data: Any, spec: ModelSpec, q: Quantization) -> np.ndarray | None:
    """Quantize one block (on the device ``data`` lives on) into a host uint8 payload, or None
    when it must be stored lossless (see the module docstring). Precondition: quantizable(spec)."""
    assert quantizable(spec)
    if not worth_it(spec, q):
        return None
    x = block_tensor(data, spec)
    if not bool(torch.isfinite(x).all()):
        return None
    qkv = quantize(x, q.scheme, q.key_granularity)
    scales = qkv.scales_bytes()
    body = qkv.data.reshape(-1).view(torch.uint8)
    payload = np.empty(len(scales) + body.numel(), dtype=np.uint8)
    payload[: len(scales)] = np.frombuffer(scales, dtype=np.uint8)
    torch.from_numpy(payload[len(scales):]).copy_(body)
    assert payload.size == q.payload_nbytes(spec)
    return payload


def unpack_payload_into(payload: np.ndarray, spec: ModelSpec, q: Quantization,
                        out: np.ndarray) -> None:
    """Dequantize a payload into ``out`` (1-D uint8 of ``spec.block_nbytes``) in spec's dtype."""
    s = q.scales_nbytes(spec)
    if payload.size != q.payload_nbytes(spec) or out.size != spec.block_nbytes:
        raise ShapeMismatch("payload or out does not match the spec")
    data = torch.from_numpy(payload[s:]).view(q.scheme.storage_dtype).reshape(spec.block_shape)
    qkv = QuantizedKV.from_parts(data, payload[:s].tobytes(), q.scheme, q.key_granularity,
                                 spec.torch_dtype)
    dst = torch.from_numpy(out).view(spec.torch_dtype).reshape(spec.block_shape)
    dequantize(qkv, out=dst)


__all__ = ["QUANT_NONE", "QuantArg", "QuantScheme", "Quantization", "as_quantization",
           "block_tensor", "pack_payload", "quantizable", "unpack_payload_into", "worth_it"]
