"""Smoke test of bench/store_bench.py: the --quick run completes and writes well-formed JSON.

No timing assertions (the CI machine's speed is not ours to judge): only the shape of the result
and that every measurement produced a positive rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_store_bench_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "store_bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.store_bench", "--quick", "--rounds", "1",
         "--dir", str(tmp_path), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == printed
    assert {"date", "command", "machine", "setup", "cases", "pass"} <= printed.keys()
    assert printed["setup"]["hot_reads"] is True
    assert set(printed["pass"]) == {"dram_get", "nvme_spill", "nvme_restore"}
    assert {(c["block_mib"], c["dtype"]) for c in printed["cases"]} == {(2, "float16"),
                                                                         (32, "bfloat16")}
    for case in printed["cases"]:
        figs = case["figures"]
        for name in ("copy", "aesgcm_encrypt_into", "zstd1_compress", "lmdb_put_sync",
                     "hbm.put", "hbm.get_into", "dram.put", "dram.get_into", "nvme_sync.put",
                     "nvme_sync.get_into", "dram_nvme_sync.flush"):
            assert figs[name]["gbps"] > 0, name
            assert len(figs[name]["gbps_all"]) == 1
        assert case["block_nbytes"] == case["block_mib"] << 20
        names = {t["target"] for t in case["targets"]}
        assert names == {"dram_get", "nvme_spill", "nvme_restore"}
        for t in case["targets"]:
            assert isinstance(t["pass"], bool)
            assert t["pass"] == (t["measured"] >= t["threshold"])
            assert t["baseline"] in figs
    # the scratch store directory is removed after the run
    assert not list(tmp_path.glob("store_bench-*"))


def test_stream_breakdown_runs_and_reports_its_four_ways(tmp_path: Path) -> None:
    out = tmp_path / "breakdown.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.stream_breakdown", "--bytes-per-call", "4", "--rounds", "1",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == printed
    assert printed["blocks_per_call"] == 2 and printed["block_mib"] == 2
    assert set(printed["gbps"]) == {"put", "prebuilt", "bare_frames", "bare"}
    assert all(v > 0 for v in printed["gbps"].values())
    g = printed["gbps"]
    assert printed["ratios"]["put/bare"] == round(g["put"] / g["bare"], 3)


def test_service_bench_reports_both_ratios_of_every_pair(tmp_path: Path) -> None:
    """One repeat of 128 KiB blocks: every method has a rate, and with one repeat the median
    of the per-repeat ratios is the ratio of the medians (up to the rates' rounding)."""
    out = tmp_path / "service.json"
    proc = subprocess.run(
        [sys.executable, "bench/service_bench.py", "--sizes", "0.125", "--repeats", "1",
         "--bytes-per-call", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(proc.stdout)["sizes"]["0.125MiB"]
    for name in ("shm", "shm_staged", "stream", "memcpy", "grpc_raw"):
        assert row[name]["put"] > 0 and row[name]["get"] > 0, name
    assert row["ratios"].keys() == row["paired_ratios"].keys()
    assert {"shm_put/memcpy", "stream_get/grpc_raw"} <= row["ratios"].keys()
    for key, ratio in row["ratios"].items():
        assert abs(row["paired_ratios"][key] - ratio) <= 0.02 * max(1.0, ratio), key
    if sys.platform == "linux":  # CPU per MiB: this process and the server each method talks to
        cpu = row["cpu_ms_per_mib"]
        for name in ("shm", "stream", "memcpy", "grpc_raw"):
            assert cpu[name]["put"] > 0 and cpu[name]["get"] > 0, name
        # the stream's client and server both work on every byte; a copy alone costs less
        assert cpu["stream"]["get"] > cpu["memcpy"]["get"]


def test_copy_bench_compares_both_thresholds(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.copy_bench", "--mib", "4", "--block-kib", "1024", "--rounds", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout)
    assert set(printed["gbps"]) == {"glibc_default", "streaming"}
    assert all(v > 0 for side in printed["gbps"].values() for v in side.values())
    assert printed["blocks_speedup"] == round(
        printed["gbps"]["streaming"]["blocks"] / printed["gbps"]["glibc_default"]["blocks"], 2)
