"""bench/gpu_check.py: exits cleanly with a JSON saying so when CUDA is absent, and its
measurement and read-back code runs end to end (on CPU here, as a dry run of the same path).

No timing assertions: only the shape of the result and that every figure is a positive rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import run_checks, run_cuda_tests

REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_without_cuda_writes_json_and_exits_zero(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "gpu_check.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA even on a GPU machine
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    assert result["cuda"] is False and result["ok"] is True
    assert "CUDA is not available" in result["reason"]
    assert "tests" not in result and "cases" not in result
    assert result["environment"]["torch"] == torch.__version__


def test_gpu_check_measurements_run_as_a_cpu_dry_run() -> None:
    sizes = (64 << 10, 256 << 10)
    result = run_checks("cpu", sizes=sizes, reps=3, store_bytes=512 << 10)
    assert [c["block_bytes"] for c in result["cases"]] == list(sizes)
    for case in result["cases"]:
        tiers, store = case["tiers"], case["store"]
        assert set(tiers["figures"]) == {"raw.h2d", "raw.d2h", "tier.promote", "tier.demote",
                                         "tier.hbm_put", "tier.hbm_get_into"}
        assert set(store["figures"]) == {"raw.batch_h2d", "raw.batch_d2h", "store.resume",
                                         "store.pause"}
        assert store["n_blocks"] == (512 << 10) // case["block_bytes"]
        for fig in [*tiers["figures"].values(), *store["figures"].values()]:
            assert fig["gbps"] > 0 and fig["median_s"] > 0
        assert all(r > 0 for r in [*tiers["ratio_to_raw"].values(), *store["ratio_to_raw"].values()])
    assert len(result["checks"]) == 4 * len(sizes)
    assert all(result["checks"].values()), result["checks"]
    assert result["meets_target"] == (result["min_ratio_to_raw"] >= 0.8)


def test_gpu_check_cuda_test_step_counts_from_junit() -> None:
    res = run_cuda_tests(timeout_s=240)
    assert res["failed"] == 0 and res["errors"] == 0, res["tail"]
    assert "-k cuda" in res["command"] and "tests/test_codec_quant.py" in res["command"]
    if torch.cuda.is_available():
        assert res["ok"] and res["passed"] > 0
    else:  # every CUDA test skips: nothing passed, which the check reports as not ok
        assert res["skipped"] > 0 and res["passed"] == 0 and res["ok"] is False


def test_gpu_check_kernel_timings_run_as_a_cpu_dry_run(monkeypatch) -> None:
    """The Triton-vs-torch section on tiny sizes, in Triton's interpreter (or, without triton,
    the section says so and measures nothing)."""
    from bench.gpu_check import KernelSizes, measure_kernels
    from kernels.backend import triton_available

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernels are compiled for it, not interpreted (gpu_check runs them)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = measure_kernels("cpu", reps=1, sizes=KernelSizes(blocks=2, layers=2, heads=1, tokens=4,
                                                           dim=8, cache_blocks=5))
    if not triton_available():
        assert res["triton"] is None and res["ok"] and "not installed" in res["reason"]
        return
    names = set(res["figures"])
    assert {"quantize.fp8_e4m3.channel", "dequantize.int8.head", "shuffle.fp16", "unshuffle.fp16",
            "paged.gather.blocks_first", "paged.scatter.kv_first"} <= names and len(names) == 10
    for fig in res["figures"].values():
        assert fig["exact"] is True, res["figures"]
        assert fig["torch"]["median_s"] > 0 and fig["triton"]["median_s"] > 0 and fig["speedup"] > 0
    assert res["ok"] is True
