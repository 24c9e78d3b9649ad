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


def test_store_bench_judges_nvme_against_the_stages_its_store_runs(tmp_path: Path) -> None:
    """The NVMe targets' bound is a stage the configured Store runs: with StoreConfig defaults
    these KV blocks are stored raw (+ AES-GCM), so no zstd stage is the bound, and the setup
    text says what ran (it claimed 'shuffle + zstd 1 (top plane) + AES-256-GCM')."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.store_bench", "--quick", "--rounds", "1",
         "--dir", str(tmp_path), "--no-write"],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout)
    for case in printed["cases"]:
        codec = case["nvme_codec"]
        assert codec["min_compress_ratio"] == 1.5 and codec["compressed"] is False
        assert codec["stored_ratio"] <= 1.0 and codec["stages"] == "raw + AES-256-GCM"
        for t in case["targets"]:
            if t["target"] != "dram_get":
                assert "zstd" not in t["baseline"], t
                assert t["baseline"].startswith(("lmdb_", "aesgcm_")), t
    assert "zstd 1 (top plane)" not in printed["setup"]["codec"].split("stored as")[1]
    assert "raw + AES-256-GCM" in printed["setup"]["codec"]


def test_codec_bench_zstd_rows_compress_and_only_they_meet_zstd() -> None:
    """The zstd rows store compressed values (min_compress_ratio=1.0; the default 1.5 stored
    these blocks raw, yet they were divided by the zstd stages), and print their ratio."""
    proc = subprocess.run(
        [sys.executable, "bench/codec_bench.py", "--sizes-mib", "2", "--reps", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout)["results"]
    assert {r["dtype"] for r in rows} == {"float16", "bfloat16"}
    for row in rows:
        for name, c in row["codec"].items():
            zipped = name.startswith("zstd1")
            assert c["stored_compressed"] is zipped, name
            assert (c["ratio"] > 1.05) if zipped else (c["ratio"] <= 1.0), (name, c["ratio"])
            if not zipped:
                assert "zstd" not in c["encode_slowest_raw_stage"] + c["decode_slowest_raw_stage"]


def test_remote_bench_alternates_the_order_of_each_pair() -> None:
    """Each remote op and its baseline run back to back, the baseline first in even rounds
    only (it always ran first), and the paired ratio is baseline time / remote time per round."""
    from bench.remote_bench import Pair, paired_rounds

    ran: list[str] = []
    ops = {k: (lambda k=k: ran.append(k)) for k in ("set", "put", "get", "get_into")}
    pairs = [Pair("put_vs_set", "set", "put"), Pair("get_vs_get", "get", "get_into")]
    times, per_round, order = paired_rounds(ops, pairs, rounds=4)
    assert order == ran == ["set", "put", "get", "get_into", "put", "set", "get_into", "get"] * 2
    assert {k: len(v) for k, v in times.items()} == dict.fromkeys(ops, 4)
    for p in pairs:
        assert per_round[p.ratio] == [b / o for b, o in zip(times[p.base], times[p.other])]


class _SlowDeleteClient:
    """A stand-in for kvstore.client.Client: put/get copy at once, delete takes 1 s."""

    def __init__(self, *_a: object, **_k: object) -> None:
        self.held: dict = {}

    def block_keys(self, spec: object, tokens: list[int]) -> list[int]:
        return tokens[::16]

    def put(self, spec: object, keys: list[int], kv: object) -> None:
        self.held[keys[0]] = kv.clone()

    def get_into(self, spec: object, keys: list[int], sink: object) -> int:
        sink.copy_(self.held[keys[0]])
        return sink.shape[0]

    def delete(self, keys: list[int]) -> None:
        import time

        time.sleep(1.0)  # the cost of the delete RPC, which the put+get figure must not hold

    def close(self) -> None:
        pass


def test_service_suite_concurrency_times_put_get_only_next_to_memcpy(monkeypatch) -> None:
    """The concurrency rows time put+get alone (not thread start, verification or the delete
    RPC) and carry a memcpy baseline of the same threads and bytes, from the same rounds."""
    import kvstore.client
    from bench import suite_service

    monkeypatch.setattr(kvstore.client, "Client", _SlowDeleteClient)
    row = suite_service._concurrency(2, "unused", "unused", False, blocks=1, rounds=2)
    moved = 2 * row["bytes_per_client_round"] * row["clients"]
    # the 1 s delete is outside the timed span (NOTE: a 0.2 s delete against a 0.1 s bound
    # failed under load: a loaded machine's scheduling alone took that long)
    assert moved / (row["aggregate_put_get_gbps"] * 1e9) < 0.5
    assert row["memcpy_gbps"] > 0 and row["vs_memcpy"] > 0


def test_disk_limit_rewrites_one_preallocated_file_in_place(tmp_path: Path) -> None:
    """The durable-disk limit rewrites a file that exists (as LMDB does) instead of creating,
    truncating and unlinking one per op; the fresh-file write stays, as a labelled reference."""
    import numpy as np

    from bench.suite_tiers import disk_new_file_measure, disk_write_measure

    blocks = [np.full(1 << 16, i, np.uint8) for i in range(3)]
    m = disk_write_measure(blocks, tmp_path)
    (path,) = tmp_path.iterdir()  # written once, before any op
    before = path.stat()
    assert before.st_size == 3 << 16
    for _ in range(2):
        m.once(record=True)
    after = path.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert path.read_bytes() == b"".join(b.tobytes() for b in blocks)
    assert m.name == "disk_write_fsync" and m.teardown is None and len(m.times) == 2
    ref = disk_new_file_measure(blocks, tmp_path)
    assert ref.name == "disk_write_fsync_new_file"


def test_bar_plot_draws_gbps_only_and_the_concurrency_rows() -> None:
    """The service/peers bar plot has a GB/s axis: ratios and CPU ms per MiB stay off it (they
    were drawn there), and the concurrency rows (a list, which was dropped) are on it."""
    from bench import suite_report

    drawn: dict[str, float] = {}

    class Ax:
        def barh(self, ys: object, values: list[float]) -> None:
            self.values = values

        def set_yticks(self, ys: object, labels: list[str], **_k: object) -> None:
            drawn.update(zip(labels, self.values))

        def __getattr__(self, _name: str):
            return lambda *a, **k: None

    class Fig:
        def tight_layout(self) -> None:
            pass

    class Plt:
        def subplots(self, **_k: object) -> tuple[Fig, Ax]:
            return Fig(), Ax()

    res = {"service_bench": {"sizes": {"2MiB": {
        "shm": {"put": 6.0, "get": 7.0},
        "ratios": {"shm_put/memcpy": 0.7}, "paired_ratios": {"shm_get/memcpy": 0.8},
        "cpu_ms_per_mib": {"shm": {"put": 0.3, "get": 0.2}}}},
        "per_chunk": {"xxh3_gbps": 30.0}, "lookup": {"lookup_8192_blocks_p50_ms": 1.2}},
        "concurrency": [{"clients": 4, "plane": "shm", "bytes_per_client_round": 8,
                         "aggregate_put_get_gbps": 1.8, "memcpy_gbps": 7.5, "vs_memcpy": 0.24}]}
    suite_report._plot_bars(Plt(), res)
    assert drawn == {"service_bench.sizes.2MiB.shm.put": 6.0,
                     "service_bench.sizes.2MiB.shm.get": 7.0,
                     "service_bench.per_chunk.xxh3_gbps": 30.0,
                     "concurrency.shm x4.aggregate_put_get_gbps": 1.8,
                     "concurrency.shm x4.memcpy_gbps": 7.5}


def test_evict_bench_baseline_is_a_median_of_enough_warm_batches() -> None:
    """At --nvme 2000 the room baseline was the median of two batches, one of them cold: now
    the batch shrinks so that at least 5 timed batches follow an untimed warm-up one, and the
    row says its batch size and counts."""
    import torch

    from bench.evict_bench import MIN_ROOM_BATCHES, run

    torch.set_num_threads(1)
    row = run(2000, "lru")
    assert row["room_batches"] >= MIN_ROOM_BATCHES == 5
    assert row["full_batches"] >= MIN_ROOM_BATCHES
    assert 0 < row["puts_per_batch"] <= 100
    assert row["room_ms_per_put"] > 0 and row["full_ms_per_put"] > 0


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
