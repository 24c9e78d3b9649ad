"""KV quantization: FP8 (e4m3fn) and INT8, with per-block-per-head (and per-channel key) scales.

Primitives (torch reference, device-agnostic: they run wherever the input tensor lives)::

    quantize(x, scheme, key_granularity="channel", *, backend="auto") -> QuantizedKV
    dequantize(q, dtype=None, out=None, *, backend="auto") -> Tensor
    error_bound(x, q, dtype=None) -> Tensor          # elementwise bound on |dequantize(q) - x|
    QuantizedKV.scales_bytes() / QuantizedKV.from_parts(...)   # scales for the block header

Input is a KV block ``[2, L, H, T, D]`` (spec.block_shape) or a batch ``[..., 2, L, H, T, D]``;
index 0 of the ``2`` axis is K, index 1 is V.

Scales (float32, symmetric, no zero point), one per *group*, ``scale = amax(|group|) / QMAX``:

* V: one group per (block, layer, head) -> ``v_scale`` shape ``[..., L, H, 1, 1]``.
* K, ``key_granularity="channel"`` (default): one group per (block, layer, head, channel), i.e.
  amax over the block's T tokens -> ``k_scale`` shape ``[..., L, H, 1, D]``. Keys carry outlier
  channels (RoPE, massive activations); a per-head scale would spend the whole range on them.
* K, ``key_granularity="head"``: like V -> ``k_scale`` shape ``[..., L, H, 1, 1]``.

A group of zeros gets scale 1 (it quantizes to zeros). Scales are never below ``MIN_SCALE``.

Error bounds (``s`` = the element's group scale, ``x`` the original value, ``x̂`` the
dequantized value in float32, before the output cast):

* INT8 (``QMAX = 127``, round half to even, no clipping since ``|x| <= 127 s``):
  ``|x̂ - x| <= s / 2 = amax / 254``  (0.39 % of the group's amax).
* FP8 e4m3fn (``QMAX = 448``; 3 mantissa bits, subnormals below 2**-6):
  ``|x̂ - x| <= 2**-4 |x| + 2**-10 s``  (6.25 % relative, or 2**-10 s near zero).
* Casting ``x̂`` to the output dtype adds at most half an ulp of that dtype: relative
  ``2**-11`` (fp16), ``2**-8`` (bf16), ``2**-24`` (fp32), plus the dtype's subnormal half-step.
  ``x̂`` is clamped to the output dtype's largest finite value first (``QMAX * s`` can round
  past it: a float32 ``FLT_MAX`` came back ``inf``), so a finite block dequantizes finite.

``backend`` (:mod:`kernels.backend`): ``"auto"`` runs the Triton kernels of
:mod:`kernels.triton_quant` on CUDA tensors when triton imports (bit-identical to this reference:
same scales, same bytes), the torch code below otherwise.

:func:`error_bound` evaluates exactly these formulas (with a float32 slack of a few ulps) so tests
and benchmarks check against the documented bound, not an ad-hoc tolerance. Storage cost per
block: data is 1 byte per element; scales are ``4 * L * H * (D + 1)`` bytes with per-channel keys
(``8 * L * H`` per-head), i.e. about ``1/T`` of the fp16 block with per-channel keys (6.3 % at
T=16: a quantized block is ~56 % of its fp16 size, ~50 % with per-head keys).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

import torch

from kernels.backend import Backend, use_triton
from kernels.errors import DTypeMismatch, InvalidArgument, ShapeMismatch

KeyGranularity = Literal["channel", "head"]

#: Smallest scale used; a group whose amax/QMAX is below it uses MIN_SCALE instead.
MIN_SCALE = 1e-30

_SLACK = 1e-6  # relative float32 slack for the division/multiplication around the rounding


class QuantScheme(str, enum.Enum):
    """Quantized storage formats. The value is the stable name written in block headers."""

    FP8_E4M3 = "fp8_e4m3"
    INT8 = "int8"

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is QuantScheme.FP8_E4M3 else torch.int8

    @property
    def qmax(self) -> float:
        """Largest magnitude of the quantized grid (448 for e4m3fn, 127 for symmetric int8)."""
        return 448.0 if self is QuantScheme.FP8_E4M3 else 127.0


_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class QuantizedKV:
    """A quantized KV block (or batch of blocks) and its scales.

    Attributes:
        data: same shape as the input, dtype ``scheme.storage_dtype``.
        k_scale: float32 ``[..., L, H, 1, D]`` (channel) or ``[..., L, H, 1, 1]`` (head).
        v_scale: float32 ``[..., L, H, 1, 1]``.
        scheme: the storage format.
        key_granularity: how key scales are grouped.
        orig_dtype: dtype of the tensor that was quantized; :func:`dequantize`'s default.
    """

    data: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    scheme: QuantScheme
    key_granularity: KeyGranularity
    orig_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of data plus scales."""
        return (
            self.data.numel() * self.data.element_size()
            + 4 * (self.k_scale.numel() + self.v_scale.numel())
        )

    def scales_bytes(self) -> bytes:
        """Scales for a block header: little-endian float32 ``k_scale`` then ``v_scale``."""
        both = torch.cat([self.k_scale.reshape(-1), self.v_scale.reshape(-1)])
        return both.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()

    @classmethod
    def from_parts(
        cls,
        data: torch.Tensor,
        scales: bytes,
        scheme: QuantScheme,
        key_granularity: KeyGranularity,
        orig_dtype: torch.dtype,
    ) -> QuantizedKV:
        """Rebuild from stored data and :meth:`scales_bytes`; scales land on ``data.device``."""
        scheme = QuantScheme(scheme)
        _check_granularity(key_granularity)
        if data.dtype != scheme.storage_dtype:
            raise DTypeMismatch(f"{scheme.value} data must be {scheme.storage_dtype}, got {data.dtype}")
        _check_block_shape(data)
        k_shape, v_shape = _scale_shapes(tuple(data.shape), key_granularity)
        nk, nv = _numel(k_shape), _numel(v_shape)
        if len(scales) != 4 * (nk + nv):
            raise ShapeMismatch(f"scales are {len(scales)} bytes, expected {4 * (nk + nv)}")
        flat = torch.frombuffer(bytearray(scales), dtype=torch.float32).to(data.device)
        return cls(
            data=data,
            k_scale=flat[:nk].reshape(k_shape),
            v_scale=flat[nk:].reshape(v_shape),
            scheme=scheme,
            key_granularity=key_granularity,
            orig_dtype=orig_dtype,
        )


def quantize(
    x: torch.Tensor,
    scheme: QuantScheme | str,
    key_granularity: KeyGranularity = "channel",
    *,
    backend: Backend = "auto",
) -> QuantizedKV:
    """Quantize a KV block tensor ``[..., 2, L, H, T, D]`` (fp16, bf16 or fp32).

    Raises:
        DTypeMismatch: ``x`` is not fp16/bf16/fp32.
        ShapeMismatch: ``x`` is not ``[..., 2, L, H, T, D]``.
        InvalidArgument: ``x`` holds inf or NaN (its group amax is not finite).
    """
    scheme = QuantScheme(scheme)
    _check_granularity(key_granularity)
    if x.dtype not in _FLOAT_INPUTS:
        raise DTypeMismatch(f"quantize expects fp16/bf16/fp32, got {x.dtype}")
    _check_block_shape(x)
    if use_triton(backend, x):
        from kernels import triton_quant

        return triton_quant.quantize(x, scheme, key_granularity)
    xf = x.to(torch.float32)
    k, v = xf.select(-5, 0), xf.select(-5, 1)
    k_dims = (-2,) if key_granularity == "channel" else (-2, -1)
    k_scale = _scale(k, k_dims, scheme)
    v_scale = _scale(v, (-2, -1), scheme)
    data = torch.empty(x.shape, dtype=scheme.storage_dtype, device=x.device)
    data.select(-5, 0).copy_(_to_grid(k / k_scale, scheme))
    data.select(-5, 1).copy_(_to_grid(v / v_scale, scheme))
    return QuantizedKV(data, k_scale, v_scale, scheme, key_granularity, x.dtype)


def dequantize(
    q: QuantizedKV,
    dtype: torch.dtype | None = None,
    *,
    out: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Dequantize to ``dtype`` (default ``q.orig_dtype``, e.g. the spec's ``torch_dtype``).

    With ``out`` (same shape as ``q.data``, dtype ``dtype``), writes there and returns it.
    The Triton path covers fp16/bf16/fp32 outputs; other dtypes always run the torch code.
    """
    dtype = q.orig_dtype if dtype is None else dtype
    if out is None:
        out = torch.empty(q.data.shape, dtype=dtype, device=q.data.device)
    elif out.shape != q.data.shape or out.dtype != dtype:
        raise ShapeMismatch(
            f"out is {tuple(out.shape)} {out.dtype}, expected {tuple(q.data.shape)} {dtype}"
        )
    if dtype in _FLOAT_INPUTS and use_triton(backend, q.data, out):
        from kernels import triton_quant

        return triton_quant.dequantize_into(q, out)
    limit = finite_limit(dtype)
    for idx, scale in ((0, q.k_scale), (1, q.v_scale)):
        val = q.data.select(-5, idx).to(torch.float32) * scale
        if limit is not None:
            val.clamp_(-limit, limit)
        out.select(-5, idx).copy_(val)
    return out


def finite_limit(dtype: torch.dtype) -> float | None:
    """The magnitude :func:`dequantize` clamps its float32 products to before the cast to
    ``dtype``: the largest finite value of ``dtype`` (and of float32); None for a non-float
    ``dtype``. NOTE: ``QMAX * scale`` may round past it (a float32 group holding ``FLT_MAX``
    has ``127 * scale = inf``), so a finite block came back holding ``±inf``. Clamping only
    moves a value towards the original (``|x| <= max``): the error bounds still hold."""
    if not dtype.is_floating_point:
        return None
    return min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)


def error_bound(x: torch.Tensor, q: QuantizedKV, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Elementwise float32 bound on ``|dequantize(q, dtype) - x|`` (see the module docstring)."""
    dtype = q.orig_dtype if dtype is None else dtype
    ax = x.to(torch.float32).abs()
    s = torch.empty_like(ax)
    s.select(-5, 0).copy_(q.k_scale.expand_as(s.select(-5, 0)))
    s.select(-5, 1).copy_(q.v_scale.expand_as(s.select(-5, 1)))
    if q.scheme is QuantScheme.INT8:
        quant = 0.5 * s
    else:
        quant = 2.0**-4 * ax + 2.0**-10 * s
    quant = quant * (1 + _SLACK) + _SLACK * ax
    finfo = torch.finfo(dtype)
    out_rel = finfo.eps / 2  # half an ulp, relative
    out_abs = finfo.smallest_normal * finfo.eps / 2  # half a subnormal step
    # NOTE: not out_rel * (ax + quant): ax + quant overflowed to inf for |x| near FLT_MAX, and
    # an infinite bound held for any output
    return quant + out_rel * ax + out_rel * quant + out_abs


# -- internals ----------------------------------------------------------------------------------


def _check_granularity(key_granularity: str) -> None:
    if key_granularity not in ("channel", "head"):
        raise InvalidArgument(f"key_granularity must be 'channel' or 'head', got {key_granularity!r}")


def _check_block_shape(x: torch.Tensor) -> None:
    if x.dim() < 5 or x.shape[-5] != 2:
        raise ShapeMismatch(f"expected a KV block [..., 2, L, H, T, D], got {tuple(x.shape)}")


def _scale_shapes(
    shape: tuple[int, ...], key_granularity: KeyGranularity
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lead, (layers, heads, _tokens, dim) = shape[:-5], shape[-4:]
    v_shape = (*lead, layers, heads, 1, 1)
    k_shape = (*lead, layers, heads, 1, dim) if key_granularity == "channel" else v_shape
    return k_shape, v_shape


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _scale(t: torch.Tensor, dims: tuple[int, ...], scheme: QuantScheme) -> torch.Tensor:
    amax = t.abs().amax(dim=dims, keepdim=True)
    if not bool(torch.isfinite(amax).all()):
        raise InvalidArgument("cannot quantize a KV block holding inf or NaN")
    scale = (amax / scheme.qmax).clamp_min(MIN_SCALE)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _to_grid(y: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    # NOTE: clamp before the fp8 cast: e4m3fn has no inf, and an out-of-range cast is NaN on
    # some backends; |y| <= qmax holds up to float32 rounding of amax/scale.
    y = y.clamp(-scheme.qmax, scheme.qmax)
    if scheme is QuantScheme.INT8:
        return torch.round(y).to(torch.int8)
    return y.to(torch.float8_e4m3fn)
