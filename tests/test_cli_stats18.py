"""``kvstore stats`` lists the counters that moved: the Store reports every counter from the
start, at 0 (68fc5ca), and the table's ~60 rows of zeros buried the few that counted something;
``--json`` keeps them all."""

from __future__ import annotations

import json

from rich.console import Console
from typer.testing import CliRunner

from kvstore.cli_serve import admin_app
from kvstore.cli_views import stats_view


def _render(stats: dict) -> str:
    console = Console(width=120, record=True)
    console.print(stats_view(stats, str))
    return console.export_text()


def test_zero_counters_are_summed_up_not_listed():
    out = _render({"blocks": 3, "counters": {"expired": 0, "evictions": 7, "quota_rejections": 0}})
    assert "evictions" in out and "7" in out
    assert "expired" not in out and "quota_rejections" not in out
    assert "2 more at 0 (--json lists them)" in out


def test_all_counters_moved_no_caption():
    out = _render({"counters": {"evictions": 1, "hits": 2}})
    assert "more at 0" not in out and "evictions" in out and "hits" in out


def test_cli_table_and_json(sidecar):
    args = ["--target", sidecar.target, "--token", sidecar.admin_token]
    table = CliRunner().invoke(admin_app, ["stats", *args], terminal_width=160)
    assert table.exit_code == 0, table.output
    raw = CliRunner().invoke(admin_app, ["stats", "--json", *args])
    counters = json.loads(raw.output)["counters"]
    zeros = [k for k, v in counters.items() if v == 0]
    assert zeros  # a fresh server: most counters at 0
    assert f"{len(zeros)} more at 0" in table.output
    listed = table.output.split("counters", 1)[1]  # the counters table (totals repeat some names)
    assert not any(f" {k} " in listed for k in zeros)
