"""Triton kernels for :mod:`kernels.quant`: FP8 (e4m3fn) / INT8 quantize and dequantize.

Imports triton: import this module only after :func:`kernels.backend.use_triton` said so
(:func:`kernels.quant.quantize` and :func:`kernels.quant.dequantize` do, with ``backend``).

Same layout, scales and semantics as the torch reference, and bit-identical results (the tests
compare bytes): ``scale = max(amax / QMAX, MIN_SCALE)`` (1 for an all-zero group) with an IEEE
division, ``y = x / scale`` with an IEEE division (``tl.math.div_rn``; Triton's default ``/`` is
approximate on CUDA), ``y`` clamped to ``±QMAX`` then rounded half to even.

NOTE: reductions use ``tl.reduce`` with combine functions defined here, not ``tl.max`` /
``tl.sum`` (jit functions of triton's standard library, which are interpreted only if
``TRITON_INTERPRET`` was set before triton itself was imported): only this module then needs to
be imported under ``TRITON_INTERPRET=1`` for its kernels to run in the interpreter.

NOTE: the float conversions are done with integer bit arithmetic instead of ``.to()`` casts:
Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs these kernels) converts fp32 to fp8
and bf16 without a correct round-to-nearest-even (its fp8 rounding can even carry into the
wrong exponent bit), so a cast would pass on a GPU and fail in CI, or the reverse. The bit
arithmetic is exact on both, and the kernels are memory-bound, so it costs nothing measurable.
Launches pass ``enable_fp_fusion=False``: no multiply-add is contracted into an FMA, so every
operation rounds as torch's does.

Kernels:

* ``_quantize_kernel``: one program per (block, K|V, layer*head) group slab ``[T, D]``; pass 1
  reduces amax per channel (and counts non-finite values), pass 2 divides, rounds, stores.
* ``_dequantize_kernel``: elementwise; each element reads its group's scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.errors import InvalidArgument
from kernels.quant import MIN_SCALE, QuantizedKV, QuantScheme, finite_limit

_FLT_MAX = tl.constexpr(3.4028234663852886e38)
# the largest finite fp16 / bf16 values: kernels.quant.finite_limit of those dtypes
_FP16_MAX = tl.constexpr(finite_limit(torch.float16))
_BF16_MAX = tl.constexpr(finite_limit(torch.bfloat16))
_MIN_SCALE = tl.constexpr(MIN_SCALE)
_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # how a kernel reads/writes values
_TILE = 4096  # elements per tile of the quantize loop (BLOCK_T * D_PAD)
_BLOCK = 1024  # elements per program of the dequantize kernel


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _load_f32(ptr, offs, mask, KIND: tl.constexpr):
    """Load fp32/fp16 values, or bf16 stored as int16 bits, widened exactly to fp32."""
    if KIND == 2:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _f32_to_e4m3(y):
    """fp32 in [-448, 448] -> e4m3fn byte (as int32), round half to even, subnormals exact."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal range (|y| >= 2**-6): round the 23-bit mantissa to 3 bits; a carry bumps the exponent
    rounded = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)  # rebias the exponent: 127 -> 7
    # subnormal range: multiples of 2**-9, rounded half to even by the 2**23 trick (exact)
    af = a.to(tl.float32, bitcast=True)
    sub = ((af * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= (121 << 23), normal, sub)
    return tl.minimum(code, 0x7E) | sign


@triton.jit
def _e4m3_to_f32(c):
    """e4m3fn byte (int32 0..255) -> fp32, exact (0x7F / 0xFF are NaN)."""
    e = (c >> 3) & 0xF
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, k_scale_ptr, v_scale_ptr, G, T, D,
                     QMAX: tl.constexpr, FP8: tl.constexpr, CHANNEL: tl.constexpr,
                     KIND: tl.constexpr, BLOCK_T: tl.constexpr, D_PAD: tl.constexpr):
    pid = tl.program_id(0)
    kv = (pid // G) % 2
    bg = (pid // (2 * G)) * G + pid % G  # (block, layer*head) index into the scales
    base = pid.to(tl.int64) * T * D
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    # pass 1: amax per channel over the T tokens, and a count of inf/NaN values
    amax_c = tl.full([D_PAD], 0.0, tl.float32)
    bad = tl.full([D_PAD], 0, tl.int32)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + offs_t
        mask = (rows < T)[:, None] & dmask[None, :]
        offs = base + rows[:, None] * D + offs_d[None, :]
        a = tl.abs(_load_f32(x_ptr, offs, mask, KIND))
        amax_c = tl.maximum(amax_c, tl.reduce(a, 0, _max))
        bad += tl.reduce(tl.where(a <= _FLT_MAX, 0, 1), 0, _add)
    if CHANNEL:
        amax = tl.where(kv == 0, amax_c, tl.reduce(amax_c, 0, _max))
    else:
        amax = tl.full([D_PAD], 0.0, tl.float32) + tl.reduce(amax_c, 0, _max)
    scale = tl.maximum(tl.math.div_rn(amax, QMAX), _MIN_SCALE)
    scale = tl.where(amax > 0, scale, 1.0)
    scale = tl.where(tl.reduce(bad, 0, _add) > 0, float("nan"), scale)  # the caller raises on NaN scales
    kv_d = offs_d * 0 + kv  # NOTE: vector masks only (the interpreter rejects scalar & vector)
    if CHANNEL:
        tl.store(k_scale_ptr + bg * D + offs_d, scale, mask=dmask & (kv_d == 0))
    else:
        tl.store(k_scale_ptr + bg + offs_d, scale, mask=(offs_d < 1) & (kv_d == 0))
    tl.store(v_scale_ptr + bg + offs_d, scale, mask=(offs_d < 1) & (kv_d == 1))
    # pass 2: divide, clamp, round half to even, store
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + offs_t
        mask = (rows < T)[:, None] & dmask[None, :]
        offs = base + rows[:, None] * D + offs_d[None, :]
        y = tl.math.div_rn(_load_f32(x_ptr, offs, mask, KIND), scale[None, :])
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if FP8:
            tl.store(q_ptr + offs, _f32_to_e4m3(y).to(tl.uint8), mask=mask)
        else:
            r = (y + 12582912.0) - 12582912.0  # round half to even (|y| <= 127 < 2**22)
            tl.store(q_ptr + offs, r.to(tl.int8), mask=mask)


@triton.jit
def _dequantize_kernel(q_ptr, k_scale_ptr, v_scale_ptr, out_ptr, N, G, T, D,
                       FP8: tl.constexpr, CHANNEL: tl.constexpr, KIND: tl.constexpr,
                       BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < N
    d = idx % D
    grp = idx // (T * D)  # (block, K|V, layer*head) in memory order
    g = grp % G
    kv = (grp // G) % 2
    bg = (grp // (2 * G)) * G + g
    if CHANNEL:
        k_idx = bg * D + d
    else:
        k_idx = bg
    s_k = tl.load(k_scale_ptr + k_idx, mask=mask & (kv == 0), other=0.0)
    s_v = tl.load(v_scale_ptr + bg, mask=mask & (kv == 1), other=0.0)
    s = tl.where(kv == 0, s_k, s_v)
    if FP8:
        val = _e4m3_to_f32(tl.load(q_ptr + idx, mask=mask, other=0).to(tl.int32))
    else:
        val = tl.load(q_ptr + idx, mask=mask, other=0).to(tl.float32)
    val = val * s
    # clamp to the output's largest finite value as the reference does (kernels.quant.
    # finite_limit); compares, not minimum/maximum: a NaN stays NaN, as in torch.clamp
    if KIND == 2:
        val = tl.where(val > _BF16_MAX, _BF16_MAX, tl.where(val < -_BF16_MAX, -_BF16_MAX, val))
    elif KIND == 1:
        val = tl.where(val > _FP16_MAX, _FP16_MAX, tl.where(val < -_FP16_MAX, -_FP16_MAX, val))
    else:
        val = tl.where(val > _FLT_MAX, _FLT_MAX, tl.where(val < -_FLT_MAX, -_FLT_MAX, val))
    if KIND == 2:  # fp32 -> bf16 bits, round half to even (NaN -> canonical quiet NaN)
        bits = val.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        tl.store(out_ptr + idx, r.to(tl.int16), mask=mask)
    elif KIND == 1:
        tl.store(out_ptr + idx, val.to(tl.float16), mask=mask)
    else:
        tl.store(out_ptr + idx, val, mask=mask)


def _as_kernel_values(t: torch.Tensor) -> torch.Tensor:
    """bf16 is passed as its int16 bits (see the module NOTE)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _storage(data: torch.Tensor) -> torch.Tensor:
    return data.view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data


def quantize(x: torch.Tensor, scheme: QuantScheme, key_granularity: str) -> QuantizedKV:
    """:func:`kernels.quant.quantize` (arguments already checked by it)."""
    lead, (_, layers, heads, tokens, dim) = x.shape[:-5], x.shape[-5:]
    groups = layers * heads
    xc = x.contiguous()
    channel = key_granularity == "channel"
    data = torch.empty(x.shape, dtype=scheme.storage_dtype, device=x.device)
    k_scale = torch.empty((*lead, layers, heads, 1, dim if channel else 1), dtype=torch.float32,
                          device=x.device)
    v_scale = torch.empty((*lead, layers, heads, 1, 1), dtype=torch.float32, device=x.device)
    programs = xc.numel() // max(1, tokens * dim)
    if programs and tokens and dim:
        d_pad = triton.next_power_of_2(dim)
        block_t = min(triton.next_power_of_2(tokens), max(1, _TILE // d_pad))
        _quantize_kernel[(programs,)](
            _as_kernel_values(xc), _storage(data), k_scale, v_scale, groups, tokens, dim,
            QMAX=scheme.qmax, FP8=scheme is QuantScheme.FP8_E4M3, CHANNEL=channel,
            KIND=_KIND[x.dtype], BLOCK_T=block_t, D_PAD=d_pad, enable_fp_fusion=False)
        if not bool(torch.isfinite(k_scale).all() & torch.isfinite(v_scale).all()):
            raise InvalidArgument("cannot quantize a KV block holding inf or NaN")
    elif data.numel() == 0:
        k_scale.fill_(1.0)
        v_scale.fill_(1.0)
    return QuantizedKV(data, k_scale, v_scale, scheme, key_granularity, x.dtype)  # type: ignore[arg-type]


def dequantize_into(q: QuantizedKV, out: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.quant.dequantize` into ``out`` (shape and dtype already checked by it)."""
    _, layers, heads, tokens, dim = q.data.shape[-5:]
    n = q.data.numel()
    if n == 0:
        return out
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    _dequantize_kernel[(triton.cdiv(n, _BLOCK),)](
        _storage(q.data.contiguous()), q.k_scale.contiguous(), q.v_scale.contiguous(),
        _as_kernel_values(target), n, layers * heads, tokens, dim,
        FP8=q.scheme is QuantScheme.FP8_E4M3, CHANNEL=q.key_granularity == "channel",
        KIND=_KIND[out.dtype], BLOCK=_BLOCK, enable_fp_fusion=False)
    if target is not out:
        out.copy_(target)
    return out


__all__ = ["dequantize_into", "quantize"]
