"""Triton kernels (kernels.triton_*) against their torch references, byte for byte.

Where CUDA is absent the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set per
test; the ``kernels.triton_*`` modules are first imported under it, so their kernels are
interpreted for the rest of the process). Where CUDA is present they are compiled and run on the
GPU, and the interpreter cases skip (one process cannot hold both versions of a kernel). The
``[cuda]`` cases are what ``bench/gpu_check.py`` runs (``pytest -k cuda``).

Shapes are tiny and example counts low: the interpreter runs each program in Python.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.backend import triton_available, use_triton
from kernels.paged import (
    PagedLayout,
    gather_blocks,
    gather_layer,
    scatter_blocks,
    scatter_layer,
)
from kernels.quant import QuantScheme, dequantize, error_bound, quantize
from kernels.shuffle import shuffle_into
from kernels.shuffle_tensor import shuffle_tensor, unshuffle_tensor
from kvstore.errors import InvalidArgument, ShapeMismatch

REPO = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
NO_TRITON = "triton is not installed (pip install -e '.[triton]')"
requires_triton = pytest.mark.skipif(not triton_available(), reason=NO_TRITON)

DEVICES = [
    pytest.param("cpu", id="interpreter", marks=pytest.mark.skipif(
        CUDA, reason="CUDA present: the kernels run compiled on the GPU ([cuda] cases), and one "
                     "process cannot also hold their interpreted versions")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA not available")),
]  # fmt: skip
FLOATS = [torch.float16, torch.bfloat16, torch.float32]
# the device fixture only sets an env var, the same for every example
HYPO = settings(max_examples=8, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """The device the Triton kernels run on (CPU = Triton's interpreter)."""
    if not triton_available():
        pytest.skip(NO_TRITON)
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor, for bitwise comparison (NaN-safe, fp8-safe)."""
    # NOTE: a fresh dense copy: .contiguous() keeps a size-1 tensor's stride
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t).view(torch.uint8).cpu()


def kv_block(shape, dtype, seed, device, magnitude=1.0):
    """Gaussian KV values with one outlier key channel and a few tiny values (fp8 subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * magnitude
    x[..., 0, :, :, :, 0] *= 40.0
    x.view(-1)[:: 7] *= 1e-4
    return x.to(dtype).to(device)


def assert_same_quant(a, b):
    assert raw(a.data).equal(raw(b.data)), "quantized bytes differ"
    assert raw(a.k_scale).equal(raw(b.k_scale)) and raw(a.v_scale).equal(raw(b.v_scale))
    assert a.k_scale.shape == b.k_scale.shape and a.v_scale.shape == b.v_scale.shape
    assert (a.scheme, a.key_granularity, a.orig_dtype) == (b.scheme, b.key_granularity, b.orig_dtype)


# -- quantization ---------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", list(QuantScheme))
@pytest.mark.parametrize("granularity", ["channel", "head"])
def test_triton_quant_matches_reference_bytes(device, scheme, granularity):
    x = kv_block((2, 2, 2, 3, 5), torch.bfloat16, seed=1, device=device)
    ref = quantize(x, scheme, granularity, backend="torch")
    got = quantize(x, scheme, granularity, backend="triton")
    assert got.data.dtype == scheme.storage_dtype and got.data.device.type == device
    assert_same_quant(got, ref)
    for dtype in FLOATS:  # dequantize to every output dtype, same bytes as the reference
        want = dequantize(ref, dtype, backend="torch")
        assert raw(dequantize(ref, dtype, backend="triton")).equal(raw(want))


@HYPO
@given(lead=st.integers(0, 1), layers=st.integers(1, 2), heads=st.integers(1, 2),
       tokens=st.integers(1, 9), dim=st.integers(1, 9), dtype=st.sampled_from(FLOATS),
       scheme=st.sampled_from(list(QuantScheme)), granularity=st.sampled_from(["channel", "head"]),
       magnitude=st.sampled_from([1e-3, 1.0, 100.0]), seed=st.integers(0, 2**16))
def test_triton_quant_property(device, lead, layers, heads, tokens, dim, dtype, scheme,
                               granularity, magnitude, seed):
    shape = (2,) * lead + (2, layers, heads, tokens, dim)
    x = kv_block(shape, dtype, seed, device, magnitude)
    got = quantize(x, scheme, granularity, backend="triton")
    assert_same_quant(got, quantize(x, scheme, granularity, backend="torch"))
    out = dequantize(got, backend="triton")
    assert raw(out).equal(raw(dequantize(got, backend="torch")))
    assert bool(((out.float() - x.float()).abs() <= error_bound(x, got)).all())


def test_triton_fp8_rounding_on_every_e4m3_boundary(device):
    """Scale 1 (amax 448): every e4m3fn value, every midpoint and its neighbours one fp32 ulp
    away, both signs, subnormals included, quantize exactly as torch's cast does."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    vals = torch.cat([grid, mids, up, down])
    vals = torch.cat([vals, -vals])
    n = vals.numel()
    x = torch.full((2, 1, 1, n, 1), 448.0)
    x[0, 0, 0, :, 0] = vals  # K (per channel: one channel, amax 448 from the grid's top)
    x[1, 0, 0, :, 0] = vals.flip(0)  # V
    x = x.to(device)
    ref = quantize(x, QuantScheme.FP8_E4M3, backend="torch")
    assert bool((ref.k_scale == 1).all()) and bool((ref.v_scale == 1).all())
    got = quantize(x, QuantScheme.FP8_E4M3, backend="triton")
    assert_same_quant(got, ref)
    assert raw(got.data).equal(raw(x.cpu().to(torch.float8_e4m3fn)))  # torch's own cast, RNE
    every_code = torch.cat([torch.arange(0, 127), torch.arange(128, 255)]).to(torch.uint8)
    q = quantize(torch.zeros(2, 1, 1, 254, 1, device=device), QuantScheme.FP8_E4M3)
    q.data.view(torch.uint8).view(-1)[:254] = every_code.to(device)  # decode every finite code
    assert raw(dequantize(q, torch.float32, backend="triton")).equal(
        raw(dequantize(q, torch.float32, backend="torch")))


def test_triton_int8_rounds_half_to_even(device):
    ties = torch.arange(-127, 127, dtype=torch.float32) + 0.5  # every x.5 in range
    n = ties.numel()
    x = torch.full((2, 1, 1, n + 1, 1), 127.0)  # the last token sets amax 127: scale 1
    x[:, 0, 0, :n, 0] = ties
    x = x.to(device)
    got = quantize(x, QuantScheme.INT8, "head", backend="triton")
    assert float(got.v_scale.max()) == 1.0
    assert raw(got.data).equal(raw(quantize(x, QuantScheme.INT8, "head", backend="torch").data))
    assert torch.equal(got.data[1, 0, 0, :n, 0].cpu(), torch.round(ties).to(torch.int8))


def test_triton_quant_zero_block_and_nonfinite(device):
    zeros = torch.zeros(2, 1, 2, 4, 3, dtype=torch.float16, device=device)
    for scheme in QuantScheme:
        q = quantize(zeros, scheme, backend="triton")
        assert bool((q.k_scale == 1).all()) and bool((q.v_scale == 1).all())
        assert raw(dequantize(q, backend="triton")).equal(raw(zeros))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.ones(2, 1, 2, 4, 3, device=device)
        x[1, 0, 1, 2, 0] = bad
        with pytest.raises(InvalidArgument):
            quantize(x, QuantScheme.FP8_E4M3, backend="triton")


def test_triton_dequantize_into_strided_out_and_other_dtypes(device):
    x = kv_block((2, 2, 1, 4, 3), torch.float32, seed=3, device=device)
    q = quantize(x, QuantScheme.INT8, backend="triton")
    big = torch.zeros(2, 2, 1, 4, 6, dtype=torch.float16, device=device)
    out = big[..., ::2]  # not contiguous
    assert dequantize(q, torch.float16, out=out, backend="triton") is out
    assert raw(out).equal(raw(dequantize(q, torch.float16, backend="torch")))
    assert bool((big[..., 1::2] == 0).all())
    f64 = dequantize(q, torch.float64, backend="triton")  # not a kernel dtype: torch path
    assert f64.dtype == torch.float64 and torch.equal(f64, dequantize(q, torch.float64, backend="torch"))


# -- byte-shuffle ---------------------------------------------------------------------------------
@HYPO
@given(itemsize=st.integers(1, 5), items=st.integers(0, 2100), seed=st.integers(0, 2**16))
def test_triton_shuffle_matches_numpy_and_inverts(device, itemsize, items, seed):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (items * itemsize,), dtype=torch.uint8, generator=gen)
    want = np.empty(src.numel(), dtype=np.uint8)
    shuffle_into(src.numpy(), itemsize, want)
    dev = src.to(device)
    planes = shuffle_tensor(dev, itemsize, backend="triton")
    assert planes.device.type == device and planes.cpu().numpy().tobytes() == want.tobytes()
    assert torch.equal(shuffle_tensor(dev, itemsize, backend="torch").cpu(), planes.cpu())
    back = torch.full_like(dev, 7)
    assert unshuffle_tensor(planes, itemsize, back, backend="triton") is back
    assert torch.equal(back.cpu(), src)


def test_triton_shuffle_of_half_tensors_splits_low_and_high_bytes(device):
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(3, 700).to(dtype).to(device)
        planes = shuffle_tensor(x, 2, backend="triton").cpu()
        bits = x.cpu().view(torch.int16).reshape(-1).numpy().view(np.uint16)
        n = bits.size
        assert planes[:n].numpy().tobytes() == (bits & 0xFF).astype(np.uint8).tobytes()
        assert planes[n:].numpy().tobytes() == (bits >> 8).astype(np.uint8).tobytes()
        back = unshuffle_tensor(planes.to(device), 2, backend="triton").view(dtype).view(x.shape)
        assert raw(back).equal(raw(x))


# -- paged gather / scatter -----------------------------------------------------------------------
def layer_shape(layout, num_blocks, bs, heads, dim):
    if layout is PagedLayout.BLOCKS_FIRST:
        return (num_blocks, 2, bs, heads, dim)
    if layout is PagedLayout.KV_FIRST:
        return (2, num_blocks, bs, heads, dim)
    return (num_blocks, heads, bs, 2 * dim)


@HYPO
@given(layout=st.sampled_from(list(PagedLayout)), num_layers=st.integers(1, 3),
       num_blocks=st.integers(1, 7), bs=st.integers(1, 4), k=st.integers(1, 2),
       heads=st.integers(1, 2), dim=st.integers(1, 5),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                              torch.int8]),
       data=st.data())
def test_triton_paged_matches_reference(device, layout, num_layers, num_blocks, bs, k, heads, dim,
                                        dtype, data):
    n = data.draw(st.integers(0, num_blocks // k))
    table = data.draw(st.permutations(range(num_blocks)))[: n * k]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    shape = layer_shape(layout, num_blocks, bs, heads, dim)
    layers = [torch.randint(-100, 100, shape, generator=gen).to(dtype).to(device)
              for _ in range(num_layers)]
    got = gather_blocks(layers, table, layout, block_tokens=bs * k, backend="triton")
    want = gather_blocks(layers, table, layout, block_tokens=bs * k, backend="torch")
    assert got.shape == want.shape and raw(got).equal(raw(want))
    # scatter fresh blocks into copies of the caches: same caches as the reference's
    blocks = torch.randint(-100, 100, got.shape, generator=gen).to(dtype).to(device)
    mine, theirs = [c.clone() for c in layers], [c.clone() for c in layers]
    scatter_blocks(blocks, mine, table, layout, backend="triton")
    scatter_blocks(blocks, theirs, table, layout, backend="torch")
    assert all(raw(a).equal(raw(b)) for a, b in zip(mine, theirs))


@pytest.mark.parametrize("layout", list(PagedLayout))
def test_triton_paged_layer_calls_strided_views_and_mixed_strides(device, layout):
    bs, heads, dim, nb = 2, 2, 3, 6
    shape = layer_shape(layout, nb, bs, heads, dim)
    gen = torch.Generator().manual_seed(5)
    layers = [torch.randn(shape, generator=gen).to(device) for _ in range(2)]
    # a third layer with other strides (every other block of a bigger cache): one launch per layer
    layers.append(torch.randn((2 * shape[0], *shape[1:]), generator=gen).to(device)[::2])
    table = torch.tensor([3, 0, 5, 2], dtype=torch.int32)  # a CPU int32 table
    want = gather_blocks(layers, table, layout, block_tokens=2 * bs, backend="torch")
    assert torch.equal(gather_blocks(layers, table, layout, block_tokens=2 * bs, backend="triton"),
                       want)
    out = torch.full((2, 2, heads, 2 * bs, dim), float("nan"), device=device)
    for layer, cache in enumerate(layers):  # into a strided view of a bigger buffer, layer by layer
        view = torch.zeros(2, 2, heads + 1, 2 * bs, dim, device=device)[:, :, 1:]
        gather_layer(cache, table, layout, view, backend="triton")
        assert torch.equal(view, want[:, :, layer])
        fresh = torch.zeros_like(cache)
        scatter_layer(view, fresh, table, layout, backend="triton")
        gather_layer(fresh, table, layout, out, backend="torch")
        assert torch.equal(out, want[:, :, layer])


@pytest.mark.parametrize("layout", [PagedLayout.CPU_SPLIT, PagedLayout.CPU_SPLIT_KDIM])
def test_triton_paged_split_cache_not_contiguous_falls_back_on_auto(device, layout):
    """The kernel reads K|V slabs through a [nb, H, 2, bs, D] view: a cache whose last two axes
    are not contiguous is refused by backend="triton" and moved by torch under "auto"."""
    nb, heads, bs, dim = 5, 2, 3, 4
    cache = torch.randn(nb, heads, bs, 2 * dim + 2).to(device)[..., : 2 * dim]
    table = [3, 1]
    want = gather_blocks([cache], table, layout, backend="torch")
    with pytest.raises(ShapeMismatch):
        gather_blocks([cache], table, layout, backend="triton")
    assert torch.equal(gather_blocks([cache], table, layout, backend="auto"), want)
    fresh = torch.zeros(nb, heads, bs, 2 * dim + 2, device=device)[..., : 2 * dim]
    scatter_blocks(want, [fresh], table, layout, backend="auto")
    assert torch.equal(gather_blocks([fresh], table, layout, backend="torch"), want)


# -- dispatch -------------------------------------------------------------------------------------
def test_triton_auto_dispatch_uses_torch_on_cpu_and_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from kernels.quant import quantize, dequantize\n"
        "from kernels.paged import gather_blocks, PagedLayout\n"
        "from kernels.shuffle_tensor import shuffle_tensor\n"
        "q = quantize(torch.randn(2, 1, 1, 4, 4), 'fp8_e4m3'); dequantize(q)\n"
        "gather_blocks([torch.zeros(3, 2, 2, 1, 4)], [2, 0], PagedLayout.BLOCKS_FIRST)\n"
        "shuffle_tensor(torch.zeros(8, dtype=torch.float16), 2)\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_triton_backend_argument_is_checked(monkeypatch):
    x = torch.zeros(2)
    assert use_triton("torch", x) is False and use_triton("auto", x) is False
    with pytest.raises(InvalidArgument):
        use_triton("cupy", x)  # type: ignore[arg-type]
    if not triton_available():
        with pytest.raises(InvalidArgument, match="does not import"):
            use_triton("triton", x)
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidArgument, match="CUDA"):
        quantize(torch.ones(2, 1, 1, 2, 2), QuantScheme.INT8, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton("triton", x) is True


@requires_triton
@pytest.mark.skipif(not CUDA, reason="CUDA not available")
def test_triton_auto_dispatch_picks_triton_on_cuda(monkeypatch):
    from kernels import triton_paged, triton_quant

    calls = []
    for mod, name in ((triton_quant, "quantize"), (triton_quant, "dequantize_into"), (triton_paged, "move")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **kw: calls.append(_n) or _real(*a, **kw))
    x = kv_block((2, 1, 2, 4, 8), torch.float16, seed=9, device="cuda")
    dequantize(quantize(x, QuantScheme.FP8_E4M3))
    gather_blocks([torch.zeros(3, 2, 2, 1, 4, device="cuda")], [2, 0], PagedLayout.BLOCKS_FIRST)
    assert calls == ["quantize", "dequantize_into", "move"]


# -- ahead-of-time compilation for the GPU (no GPU needed) ----------------------------------------
def _compile_for_sm90(fn, signature: dict, constexprs: dict) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                    constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"enable_fp_fusion": False})  # as the launches ask
    assert compiled.asm["cubin"], "no cubin"
    return compiled.asm["ptx"]


@requires_triton
@pytest.mark.skipif(CUDA, reason="CUDA present: the [cuda] cases compile and run these kernels")
def test_triton_kernels_compile_for_hopper_without_a_gpu(monkeypatch):
    """Compile every kernel (the variants CI cannot run) to sm_90 PTX and cubin with triton's own
    ptxas, and check the PTX keeps the IEEE division the byte-exact contract needs."""
    import importlib

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    quant_sig = {"x_ptr": "*i16", "q_ptr": "*u8", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                 "G": "i32", "T": "i32", "D": "i32"}
    deq_sig = {"q_ptr": "*u8", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "out_ptr": "*i16",
               "N": "i64", "G": "i32", "T": "i32", "D": "i32"}
    names = ["K", "H", "BS", "D", "s_block", "s_kv", "s_head", "s_tok_k", "s_dim_k", "s_tok_v",
             "s_dim_v", "o_block", "o_kv", "o_layer", "o_head", "o_tok", "o_dim"]
    paged_sig = {"layer_ptrs": "*i64", "store_ptr": "*i16", "table_ptr": "*i64",
                 **dict.fromkeys(names, "i32"), "s_block": "i64"}
    # the modules may already be imported under the interpreter: compile fresh copies
    tq = importlib.reload(importlib.import_module("kernels.triton_quant"))
    ts = importlib.reload(importlib.import_module("kernels.triton_shuffle"))
    tp = importlib.reload(importlib.import_module("kernels.triton_paged"))
    try:
        for fp8, channel, kind in ((True, True, 2), (False, False, 1)):
            ptx = _compile_for_sm90(tq._quantize_kernel, {**quant_sig, "q_ptr": "*u8" if fp8 else "*i8"},
                                    {"QMAX": 448.0 if fp8 else 127.0, "FP8": fp8, "CHANNEL": channel,
                                     "KIND": kind, "BLOCK_T": 16, "D_PAD": 128})
            assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx" not in ptx
            _compile_for_sm90(tq._dequantize_kernel, {**deq_sig, "q_ptr": "*u8" if fp8 else "*i8"},
                              {"FP8": fp8, "CHANNEL": channel, "KIND": kind, "BLOCK": 1024})
        for unshuffle in (False, True):
            _compile_for_sm90(ts._shuffle_kernel, {"src_ptr": "*u8", "out_ptr": "*u8", "n": "i64"},
                              {"ITEMSIZE": 2, "ITEM_PAD": 2, "BLOCK": 1024, "UNSHUFFLE": unshuffle})
        for gather in (True, False):
            _compile_for_sm90(tp._paged_kernel, paged_sig, {"GATHER": gather, "BLOCK_S": 16, "D_PAD": 128})
    finally:  # leave the interpreted kernels in place for whatever runs next in this process
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        for mod in (tq, ts, tp):
            importlib.reload(mod)
