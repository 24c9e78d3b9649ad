"""GPU check: run the CUDA tests, then measure HBM <-> pinned-DRAM copies through the tiers
against a raw torch copy of the same bytes, and check that what was copied reads back exact.

    python -m bench.gpu_check --out gpu_check.json [--skip-tests] [--reps N]

Writes one JSON document (``--out``, and stdout). Without CUDA it writes
``{"cuda": false, "reason": ...}`` and exits 0. With CUDA it exits 1 when a CUDA test or a
correctness check fails, else 0; the bandwidth target (tier >= 0.8 x raw, issue 5) is reported in
``meets_target``, not turned into an exit code. Budget: under 5 minutes (the pytest step is
capped at ``--test-timeout`` seconds, the measurements take well under a minute on a GPU).

Measured, for 2 MiB and 32 MiB blocks (median seconds per operation, each operation followed by
``torch.cuda.synchronize()`` inside the timed region; GB/s = bytes / median):

* ``raw.h2d`` / ``raw.d2h``  -- ``dev.copy_(pinned, non_blocking=True)`` and back.
* ``tier.promote`` (DRAM -> HBM, h2d) / ``tier.demote`` (HBM -> DRAM, d2h) -- the Store's move
  path: ``dst.reserve(ref)``, ``copy_bytes(dst.view(ref), src.view(ref))``, ``dst.delete(ref)``.
* ``tier.hbm_put`` (h2d from a caller's pinned buffer) / ``tier.hbm_get_into`` (d2h into one).
* ``store.resume`` (DRAM -> HBM) / ``store.pause`` (HBM -> DRAM) -- a Store with HBM and DRAM
  tiers moving a whole session; baseline ``raw.batch_h2d`` / ``raw.batch_d2h``: the same number
  of raw copies of the same size with one synchronize.

Correctness checks (``checks``), made the way a caller would, with no extra synchronize:

* ``tier_demote_then_host_read_exact`` -- HBM -> DRAM through the tier, then read the DRAM slot
  with numpy (what the NVMe spill does next).
* ``hbm_get_into_pinned_then_read_exact`` -- ``MemoryTier.get_into`` into a pinned host tensor.
* ``store_get_into_pinned_exact`` -- ``Store.get(out=pinned host tensor)``.
* ``store_pause_resume_get_exact`` -- put, pause (demote), resume (promote), get on the device.

A ``false`` in the first three means a non_blocking device-to-host copy was read before it
completed (``kernels.copy.copy_bytes`` must synchronize, or the caller must).

Kernels (``kernels``; skipped with ``--skip-kernels``): each Triton kernel against its torch
reference on the same inputs (``backend="triton"`` vs ``backend="torch"``), median seconds, GB/s
of the bytes the operation must move, ``speedup`` = torch / triton time, and ``exact`` = the
outputs are bitwise equal (a ``false`` fails the run). Without triton the section says so. Sizes
(:class:`KernelSizes`): 64 blocks of ``[2, 32, 8, 16, 128]`` fp16 (128 MiB) to quantize, shuffle
and gather from 32 cache layers of 2048 engine blocks (4 GiB of cache).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.output import emit_json
from kernels.copy import copy_bytes
from kvstore.block import Tier
from kvstore.spec import ModelSpec
from tiers.base import BlockRef
from tiers.memory import MemoryTier

MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
TARGET = 0.8
DEFAULT_SIZES = (2 * MIB, 32 * MIB)
CUDA_TEST_FILES = ("tests/test_kernels_*.py", "tests/test_codec_quant.py")


# -- plumbing -------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
        _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _figure(nbytes: int, seconds: float, reps: int) -> dict[str, float | int]:
    return {"median_s": seconds, "gbps": nbytes / seconds / 1e9, "reps": reps}


def _block_spec(nbytes: int) -> ModelSpec:
    """A float16 spec whose block is exactly ``nbytes`` (a multiple of 1 KiB)."""
    assert nbytes % 1024 == 0, nbytes
    return ModelSpec(model="gpu-check", revision=str(nbytes), num_layers=1, num_kv_heads=1,
                     head_dim=256, dtype="float16", block_tokens=nbytes // 1024)


def _host(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"gpu_check: {what}")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes viewed as fp16 hold NaNs, which never compare equal)."""
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _random_bytes(nbytes: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


# -- CUDA tests -----------------------------------------------------------------------------------
def run_cuda_tests(timeout_s: float) -> dict[str, Any]:
    """``pytest -k cuda`` over the kernel and codec tests; counts from a JUnit report."""
    files = sorted({str(p.relative_to(REPO)) for pat in CUDA_TEST_FILES for p in REPO.glob(pat)})
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-k", "cuda", "-p", "no:cacheprovider",
               f"--junitxml={junit}", *files]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
            rc, out, timed_out = proc.returncode, proc.stdout + proc.stderr, False
        except subprocess.TimeoutExpired as exc:
            rc, timed_out = -1, True
            out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
                else (exc.stdout or "")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if junit.exists():
            root = ET.parse(junit).getroot()
            for suite in root.iter("testsuite"):
                for k in counts:
                    counts[k] += int(suite.get(k, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {
        "command": " ".join(cmd[1:]),
        "rc": rc,
        "timed_out": timed_out,
        "seconds": round(time.perf_counter() - t0, 1),
        "passed": passed,
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        # rc 5 = nothing collected: a failure here, since the CUDA tests must exist and run
        "ok": rc == 0 and passed > 0,
        "tail": out[-3000:],
    }


# -- tier-level copies ----------------------------------------------------------------------------
def measure_tiers(nbytes: int, device: torch.device, reps: int) -> tuple[dict[str, Any], dict[str, bool]]:
    """Raw copies vs MemoryTier moves for one block size; plus the tier read-back checks."""
    spec = _block_spec(nbytes)
    ref = BlockRef("gpu-check", b"\x01" * 32, spec)
    pinned = device.type == "cuda"
    hbm = MemoryTier(Tier.HBM, 2 * nbytes, device)
    dram = MemoryTier(Tier.DRAM, 2 * nbytes, "cpu", pin=pinned)
    host = _host(nbytes, device)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src = _random_bytes(nbytes, device, seed=nbytes)
    figs: dict[str, Any] = {}
    try:
        figs["raw.h2d"] = _figure(nbytes, _median_s(
            lambda: dev.copy_(host, non_blocking=True), device, reps), reps)
        figs["raw.d2h"] = _figure(nbytes, _median_s(
            lambda: host.copy_(dev, non_blocking=True), device, reps), reps)

        _require(hbm.put(ref, src) and dram.put(ref, host), "tiers refused a block")
        _sync(device)
        other = BlockRef("gpu-check", b"\x02" * 32, spec)

        def move(dst: MemoryTier, src_tier: MemoryTier) -> None:
            _require(dst.reserve(other), "no room for a move")
            copy_bytes(dst.view(other), src_tier.view(ref))
            dst.delete(other)

        figs["tier.promote"] = _figure(nbytes, _median_s(lambda: move(hbm, dram), device, reps), reps)
        figs["tier.demote"] = _figure(nbytes, _median_s(lambda: move(dram, hbm), device, reps), reps)

        def put() -> None:
            _require(hbm.put(other, host), "hbm refused a put")
            hbm.delete(other)

        figs["tier.hbm_put"] = _figure(nbytes, _median_s(put, device, reps), reps)
        figs["tier.hbm_get_into"] = _figure(nbytes, _median_s(
            lambda: hbm.get_into(ref, host), device, reps), reps)

        # read-back checks, no synchronize between the copy and the host read
        checks: dict[str, bool] = {}
        want = src.cpu()
        hbm.delete(ref)
        dram.delete(ref)
        _require(hbm.put(ref, src), "hbm refused a put")
        _sync(device)
        _require(dram.reserve(ref), "dram refused a reserve")
        copy_bytes(dram.view(ref), hbm.view(ref))
        checks["tier_demote_then_host_read_exact"] = bool(
            (dram.view(ref).numpy() == want.numpy()).all())
        fresh = _host(nbytes, device)
        fresh.zero_()
        hbm.get_into(ref, fresh)
        checks["hbm_get_into_pinned_then_read_exact"] = bool((fresh.numpy() == want.numpy()).all())
    finally:
        hbm.close()
        dram.close()
    ratios = {
        "tier.promote": figs["tier.promote"]["gbps"] / figs["raw.h2d"]["gbps"],
        "tier.demote": figs["tier.demote"]["gbps"] / figs["raw.d2h"]["gbps"],
        "tier.hbm_put": figs["tier.hbm_put"]["gbps"] / figs["raw.h2d"]["gbps"],
        "tier.hbm_get_into": figs["tier.hbm_get_into"]["gbps"] / figs["raw.d2h"]["gbps"],
    }
    return {"figures": figs, "ratio_to_raw": ratios}, checks


# -- Store-level moves ----------------------------------------------------------------------------
def measure_store(nbytes: int, device: torch.device, reps: int, n_blocks: int,
                  workdir: Path) -> tuple[dict[str, Any], dict[str, bool]]:
    """A session of ``n_blocks`` blocks paused (HBM -> DRAM) and resumed (DRAM -> HBM)."""
    from kvstore.config import StoreConfig
    from kvstore.store import Store

    spec = _block_spec(nbytes)
    cap = (int(n_blocks / 0.8) + 2) * nbytes
    cfg = StoreConfig(path=workdir / f"store-{nbytes}", hbm_bytes=cap, dram_bytes=cap,
                      nvme_bytes=0, device=str(device), persist_on_close=False,
                      policy="lru")  # the mechanism alone: every eviction demotes
    blocks = _random_bytes(n_blocks * nbytes, device, seed=7).view(torch.float16).reshape(
        n_blocks, *spec.block_shape)
    checks: dict[str, bool] = {}
    with Store.open(cfg) as store:
        tokens = list(range(n_blocks * spec.block_tokens))
        keys = store.block_keys("t", spec, tokens)
        store.open_session("t", "s")
        store.put("t", spec, keys, blocks, session="s")
        _sync(device)
        pause, resume = [], []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            moved = store.pause_session("t", "s")
            _sync(device)
            t1 = time.perf_counter()
            t2 = time.perf_counter()
            back = store.resume_session("t", "s")
            _sync(device)
            t3 = time.perf_counter()
            _require(moved == n_blocks and back == n_blocks,
                     f"session moves: paused {moved}, resumed {back} of {n_blocks} blocks")
            if i:  # the first round is the warm-up
                pause.append(t1 - t0)
                resume.append(t3 - t2)
        # blocks are back in HBM: serve them into a caller's pinned host tensor (d2h)
        out = _host(n_blocks * nbytes, device).view(torch.float16).reshape(blocks.shape)
        got = store.get("t", spec, keys, out=out)
        checks["store_get_into_pinned_exact"] = got.shape[0] == n_blocks and _same_bytes(
            got, blocks.cpu())
        got = store.get("t", spec, keys, device=device)
        checks["store_pause_resume_get_exact"] = got.shape[0] == n_blocks and _same_bytes(
            got, blocks)
        store.close_session("t", "s")

    total = n_blocks * nbytes
    host = [_host(nbytes, device) for _ in range(n_blocks)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(n_blocks)]

    def batch(h2d: bool) -> None:
        for h, d in zip(host, dev):
            (d.copy_(h, non_blocking=True) if h2d else h.copy_(d, non_blocking=True))

    figs = {
        "raw.batch_h2d": _figure(total, _median_s(lambda: batch(True), device, reps), reps),
        "raw.batch_d2h": _figure(total, _median_s(lambda: batch(False), device, reps), reps),
        "store.resume": _figure(total, statistics.median(resume), reps),
        "store.pause": _figure(total, statistics.median(pause), reps),
    }
    ratios = {
        "store.resume": figs["store.resume"]["gbps"] / figs["raw.batch_h2d"]["gbps"],
        "store.pause": figs["store.pause"]["gbps"] / figs["raw.batch_d2h"]["gbps"],
    }
    return {"n_blocks": n_blocks, "figures": figs, "ratio_to_raw": ratios}, checks


# -- Triton kernels vs torch references -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KernelSizes:
    """Workload of :func:`measure_kernels` (store blocks ``[n, 2, L, H, T, D]``, engine caches of
    ``cache_blocks`` blocks of ``T`` tokens per layer)."""

    blocks: int = 64
    layers: int = 32
    heads: int = 8
    tokens: int = 16
    dim: int = 128
    cache_blocks: int = 2048


@dataclass(frozen=True, slots=True)
class _KernelCase:
    name: str
    nbytes: int  # bytes the operation must read and write
    run: Callable[[str], Any]  # run(backend): the timed operation
    check: Callable[[str], Any]  # check(backend) -> output compared between backends


def _kernel_cases(sizes: KernelSizes, device: torch.device) -> list[_KernelCase]:
    """One case per Triton kernel (and paged layout)."""
    from kernels.paged import PagedLayout, gather_blocks, scatter_blocks
    from kernels.quant import QuantScheme, dequantize, quantize
    from kernels.shuffle_tensor import shuffle_tensor, unshuffle_tensor

    n, layers, heads, tokens, dim = sizes.blocks, sizes.layers, sizes.heads, sizes.tokens, sizes.dim
    g = torch.Generator(device=device).manual_seed(11)
    blocks = torch.randn((n, 2, layers, heads, tokens, dim), generator=g, device=device).half()
    nbytes = blocks.numel() * 2
    cases: list[_KernelCase] = []

    def case(name: str, moved: int, run: Callable[[str], Any],
             check: Callable[[str], Any] | None = None) -> None:
        cases.append(_KernelCase(name, moved, run, run if check is None else check))

    for scheme, gran in ((QuantScheme.FP8_E4M3, "channel"), (QuantScheme.INT8, "head")):
        q = quantize(blocks, scheme, gran, backend="torch")
        case(f"quantize.{scheme.value}.{gran}", nbytes + nbytes // 2,
             lambda b, s=scheme, k=gran: quantize(blocks, s, k, backend=b))
        case(f"dequantize.{scheme.value}.{gran}", nbytes + nbytes // 2,
             lambda b, q=q: dequantize(q, backend=b))
    flat = blocks.view(-1)
    planes = shuffle_tensor(flat, 2, backend="torch")
    case("shuffle.fp16", 2 * nbytes, lambda b: shuffle_tensor(flat, 2, backend=b))
    case("unshuffle.fp16", 2 * nbytes, lambda b: unshuffle_tensor(planes, 2, backend=b))
    table = torch.randperm(sizes.cache_blocks, generator=torch.Generator().manual_seed(3))[:n].tolist()
    slots = torch.tensor(table, device=device)
    for layout in (PagedLayout.BLOCKS_FIRST, PagedLayout.KV_FIRST):
        shape = ((sizes.cache_blocks, 2, tokens, heads, dim) if layout is PagedLayout.BLOCKS_FIRST
                 else (2, sizes.cache_blocks, tokens, heads, dim))
        caches = [torch.randn(shape, generator=g, device=device).half() for _ in range(layers)]

        def gather(b: str, c: list[torch.Tensor] = caches, lay: PagedLayout = layout) -> torch.Tensor:
            return gather_blocks(c, table, lay, backend=b)

        def scatter(b: str, c: list[torch.Tensor] = caches, lay: PagedLayout = layout) -> None:
            scatter_blocks(blocks, c, table, lay, backend=b)

        def scattered(b: str, c: list[torch.Tensor] = caches, lay: PagedLayout = layout) -> list[torch.Tensor]:
            for x in c:  # clear the slots, scatter, read them back
                x.index_fill_(lay.block_axis, slots, 0)
            scatter(b, c, lay)
            return [x.index_select(lay.block_axis, slots) for x in c]

        case(f"paged.gather.{layout.value}", 2 * nbytes, gather)
        case(f"paged.scatter.{layout.value}", 2 * nbytes, scatter, scattered)
    return cases


def _outputs_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of kernel outputs (tensors, QuantizedKV, lists of tensors)."""
    if isinstance(a, torch.Tensor):
        return _same_bytes(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_outputs_equal(x, y) for x, y in zip(a, b))
    return all(_same_bytes(getattr(a, f), getattr(b, f)) for f in ("data", "k_scale", "v_scale"))


def measure_kernels(device: str | torch.device, reps: int = 20,
                    sizes: KernelSizes = KernelSizes()) -> dict[str, Any]:
    """Each Triton kernel vs its torch reference on ``device`` (CPU only under TRITON_INTERPRET)."""
    from kernels.backend import triton_available

    if not triton_available():
        return {"triton": None, "ok": True,
                "reason": "triton is not installed (pip install -e '.[triton]'): nothing measured"}
    import triton

    device = torch.device(device)
    figures: dict[str, Any] = {}
    for c in _kernel_cases(sizes, device):
        exact = _outputs_equal(c.check("triton"), c.check("torch"))  # also compiles before timing
        t_torch = _median_s(lambda r=c.run: r("torch"), device, reps)
        t_triton = _median_s(lambda r=c.run: r("triton"), device, reps)
        figures[c.name] = {"torch": _figure(c.nbytes, t_torch, reps),
                           "triton": _figure(c.nbytes, t_triton, reps),
                           "speedup": t_torch / t_triton, "exact": exact}
    return {"triton": triton.__version__, "sizes": {f: getattr(sizes, f) for f in sizes.__slots__},
            "figures": figures, "ok": all(f["exact"] for f in figures.values())}


# -- driver ---------------------------------------------------------------------------------------
def run_checks(device: str | torch.device, sizes: tuple[int, ...] = DEFAULT_SIZES,
               reps: int = 20, store_bytes: int = 128 * MIB) -> dict[str, Any]:
    """Bandwidth figures and read-back checks for each block size on ``device`` (``"cpu"``
    works too, as a dry run of the same code path: nothing is pinned then)."""
    device = torch.device(device)
    cases, checks = [], {}
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for nbytes in sizes:
            tiers, c1 = measure_tiers(nbytes, device, reps)
            store, c2 = measure_store(nbytes, device, max(3, reps // 4),
                                      max(2, store_bytes // nbytes), Path(tmp))
            cases.append({"block_bytes": nbytes, "block_mib": nbytes / MIB, "tiers": tiers,
                          "store": store})
            for name, ok in {**c1, **c2}.items():
                checks[f"{name}@{nbytes}"] = ok
    ratios = [r for c in cases for part in ("tiers", "store")
              for r in c[part]["ratio_to_raw"].values()]
    return {"cases": cases, "checks": checks, "min_ratio_to_raw": min(ratios),
            "meets_target": min(ratios) >= TARGET}


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "host": platform.node()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   gpu_count=torch.cuda.device_count())
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write the JSON result")
    ap.add_argument("--skip-tests", action="store_true", help="only measure")
    ap.add_argument("--skip-kernels", action="store_true", help="no Triton vs torch kernel timings")
    ap.add_argument("--test-timeout", type=float, default=200.0, help="seconds for pytest")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per figure")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "tool": "bench/gpu_check.py",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.gpu_check", *(argv if argv is not None else sys.argv[1:])]),
        "environment": _environment(),
        "cuda": torch.cuda.is_available(),
        "target_ratio": TARGET,
    }
    rc = 0
    if not result["cuda"]:
        result["reason"] = ("CUDA is not available (torch.cuda.is_available() is False): no CUDA "
                            "test was run and nothing was measured")
    else:
        if not args.skip_tests:
            result["tests"] = run_cuda_tests(args.test_timeout)
            rc |= not result["tests"]["ok"]
        result.update(run_checks("cuda", reps=args.reps))
        rc |= not all(result["checks"].values())
        if not args.skip_kernels:
            result["kernels"] = measure_kernels("cuda", reps=args.reps)
            rc |= not result["kernels"]["ok"]
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    result["ok"] = rc == 0
    emit_json(result, args.out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
