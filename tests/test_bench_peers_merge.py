"""The peers suite's merge of passes: medians of figures, target ratios as the median of the
per-pass ratios (each pass compares two sides measured back to back)."""

from __future__ import annotations

from bench.suite_peers import _ratios, merge_passes


def _pass(l1_put: float, dram_put: float) -> dict:
    row = {"lmcache": {"gbps": {"l1_put": l1_put, "l1_get": 2.0}, "verified": True},
           "kvstore_dram": {"put": dram_put, "get": 4.0, "verified": True},
           "lmcache_aesgcm": {"error": "not installed"}}
    row["targets"] = _ratios(row)
    return row


def test_target_ratio_is_the_median_of_per_pass_ratios():
    # load drifts between passes: both sides slow down together in pass 2
    passes = [_pass(10.0, 9.5), _pass(2.0, 1.9), _pass(8.0, 6.0)]
    row = merge_passes(passes)
    t = row["targets"]["dram_put/lmcache_l1_put"]
    assert t["per_pass"] == [0.95, 0.95, 0.75]
    assert t["ratio"] == 0.95 and t["pass"] is True  # the ratio of medians would be 6/8 = 0.75
    assert row["lmcache"]["gbps"]["l1_put"] == 8.0 and row["kvstore_dram"]["put"] == 6.0
    assert row["kvstore_dram"]["verified"] is True
    assert row["targets"]["nvme_put/lmcache_fs_aesgcm_store"] is None  # a side is missing
    assert row["lmcache_aesgcm"] == {"error": "not installed"}


def test_a_failed_pass_of_a_side_is_left_out():
    ok = _pass(10.0, 9.0)
    bad = _pass(10.0, 9.0)
    bad["lmcache"] = {"error": "exit 1: keys stayed locked"}
    bad["targets"] = _ratios(bad)
    row = merge_passes([bad, ok, _pass(8.0, 8.0)])
    assert row["lmcache"]["gbps"]["l1_put"] == 9.0 and row["lmcache"]["failed_passes"] == 1
    assert row["targets"]["dram_put/lmcache_l1_put"]["per_pass"] == [0.9, 1.0]
    all_bad = merge_passes([bad, bad])
    assert "error" in all_bad["lmcache"] and all_bad["targets"]["dram_put/lmcache_l1_put"] is None
