"""The full replay suite finds the Mooncake trace through $KVSTORE_TRACE, and says when it has
none (it dropped the trace silently unless the checkout sat next to ``shared/``)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_trace_path_comes_from_the_environment(tmp_path):
    trace = tmp_path / "t.jsonl"
    code = "from bench.replay_bench import SHARED_TRACE; print(SHARED_TRACE)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "KVSTORE_TRACE": str(trace)}).stdout
    assert out.strip() == str(trace)


def test_a_missing_trace_is_reported_not_dropped_silently(monkeypatch, capsys):
    suite = importlib.import_module("bench.suite_replay")
    from bench.suite_report import _replay_md

    missing = Path("/nonexistent/mooncake.jsonl")
    monkeypatch.setattr(suite, "SHARED_TRACE", missing)
    monkeypatch.setattr(suite, "FULL", {"traces": [("mooncake", str(missing), 0), ("chat", "", 1)],
                                         "requests": 20, "capacities": [5]})
    res = suite.run_replay_suite(False, lambda what, n: (lambda: None))
    assert res["traces"] == ["chat#1"]
    assert len(res["skipped"]) == 1 and str(missing) in res["skipped"][0]
    assert "skipped" in capsys.readouterr().err
    assert _replay_md(res).startswith("skipped: mooncake")
