"""The benchmark suite (``kvstore bench``): JSON shape and RESULTS.md, on tiny quick runs.

No timing assertions: figures are only checked to be positive numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from bench import suite_report
from bench.cli import bench


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("bench")(bench)

    @app.command("noop")
    def _noop() -> None:  # a second command keeps "bench" a subcommand
        pass

    return app


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out.json"
    res = CliRunner().invoke(_app(), ["bench", *args, "--json", str(out),
                                      "--results", str(tmp_path / "RESULTS.md")])
    assert res.exit_code == 0, res.output + repr(res.exception)
    return json.loads(out.read_text())


def _machine_ok(doc: dict) -> None:
    m = doc["machine"]
    assert len(m["loadavg_start"]) == 3 and len(m["loadavg_end"]) == 3
    assert m["torch_threads"] == 1
    assert doc["command"].startswith("kvstore bench ")


@pytest.mark.timeout(300)
def test_tiers_quick_writes_json_and_results(tmp_path: Path) -> None:
    doc = _run(tmp_path, "tiers", "--quick")
    assert doc["suite"] == "tiers" and doc["quick"] is True
    _machine_ok(doc)
    res = doc["results"]
    assert [c["block_mib"] for c in res["cases"]] == [2, 32]
    for case in res["cases"]:
        for stage in ("copy", "aesgcm_encrypt_into", "zstd1_compress", "lmdb_put_sync",
                      "disk_write_fsync"):
            assert case["limits"][stage] > 0
        paths = {p["path"] for p in case["paths"]}
        for v in res["codec_variants"]:
            assert {f"put.nvme[{v}]", f"get.nvme[{v}]", f"dram->nvme[{v}]",
                    f"nvme->dram[{v}]"} <= paths
        assert {"put.hbm", "get.hbm", "put.dram", "get.dram", "hbm->dram", "dram->hbm"} <= paths
        for p in case["paths"]:
            assert p["gbps"] > 0 and p["limit"] in case["limits"]
            # NOTE: the ratio is rounded to 3 decimals: a slow path's 0.014 is 1.2 % off 0.01384
            assert p["ratio"] == pytest.approx(p["gbps"] / p["limit_gbps"], rel=1e-2, abs=5e-4)
    md = (tmp_path / "RESULTS.md").read_text()
    assert "<!-- suite:tiers-quick -->" in md and "put.nvme[aes+zstd1]" in md
    assert "load average" in md


@pytest.mark.timeout(300)
def test_replay_quick_table_plot_and_sections(tmp_path: Path) -> None:
    plot = tmp_path / "replay.png"
    out = tmp_path / "out.json"
    res = CliRunner().invoke(_app(), ["bench", "replay", "--quick", "--json", str(out),
                                      "--plot", str(plot), "--results", str(tmp_path / "R.md")])
    assert res.exit_code == 0, res.output + repr(res.exception)
    doc = json.loads(out.read_text())
    _machine_ok(doc)
    summary = doc["results"]["summary"]
    caps = doc["results"]["capacities"]
    assert len(summary) == len(doc["results"]["traces"]) * len(caps)
    for entry in summary:
        for pol in doc["results"]["policies"]:
            assert 0 <= entry[pol]["net_saved_time_fraction"] <= 1
        # the offline reference is never beaten
        assert entry["belady"]["net_saved_time_fraction"] >= entry["lru"]["net_saved_time_fraction"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "R.md").read_text()
    assert "![replay](replay.png)" in md and "| trace | HBM blocks |" in md


def test_results_sections_replace_their_own_only(tmp_path: Path) -> None:
    md = tmp_path / "R.md"
    base = {"date": "d", "wall_s": 1, "command": "c", "quick": False,
            "machine": {"cpu": "x", "cpus_usable": 1, "mem_gib": 1, "kernel": "k", "python": "p",
                        "torch": "t", "torch_threads": 1, "git_commit": "g",
                        "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]}}
    suite_report.write_section(md, {**base, "suite": "service", "results": {"a": 1}}, None)
    suite_report.write_section(md, {**base, "suite": "peers", "results": {"b": 2}}, None)
    suite_report.write_section(md, {**base, "suite": "service", "results": {"a": 3}}, None)
    text = md.read_text()
    assert text.count("<!-- suite:service -->") == 1 and text.count("<!-- suite:peers -->") == 1
    assert "| a | 3 |" in text and "| a | 1 |" not in text and "| b | 2 |" in text


def test_unknown_suite_is_refused(tmp_path: Path) -> None:
    res = CliRunner().invoke(_app(), ["bench", "nope", "--json", str(tmp_path / "x.json")])
    assert res.exit_code != 0
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("same", ["plot", "results", "plot-link"])
def test_outputs_that_name_one_file_are_refused_before_the_suite_runs(tmp_path: Path, same: str) -> None:
    """``--json x --plot x`` (or the results markdown named as --json) wrote one output over
    another after a run of minutes; both not written yet, a samefile check could not see it."""
    out = tmp_path / "out.json"
    results = tmp_path / "RESULTS.md"
    args = ["bench", "tiers", "--quick", "--json", str(out), "--results", str(results)]
    if same == "plot":
        args += ["--plot", str(out)]
    elif same == "plot-link":
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "link").symlink_to(tmp_path)
        args += ["--plot", str(tmp_path / "sub" / "link" / "out.json")]
    else:
        args = ["bench", "tiers", "--quick", "--json", str(results), "--results", str(results)]
    res = CliRunner().invoke(_app(), args)
    assert res.exit_code == 2, res.output
    assert "the same file" in res.output
    assert not out.exists() and not results.exists()
