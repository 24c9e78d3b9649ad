"""The operators' CLI: a long tenant deletion, serve's progress off a terminal, readable sizes.

* ``tenant delete`` ran under the AdminClient's fixed 30 s deadline: after 30 s of silence it
  said ``error (DEADLINE_EXCEEDED)`` while the server went on and deleted the tenant (a retry
  failed the same way), and a success printed only ``deleted NAME``. It now waits with no
  deadline (``--timeout`` gives one, whose expiry is worded as an unknown outcome), shows the
  wait, and prints how many blocks went (DeleteTenantResponse.blocks).
* ``serve`` showed its recovery from NVMe and its commit at stop only as rich's transient bar,
  which draws nothing off a terminal: under systemd or docker nothing was printed for as long
  as either took.
* ``stats`` and ``policy get`` printed raw byte counts; ``--json`` keeps the raw document.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from service_harness import SPEC, fresh_tokens, random_kv
from typer.testing import CliRunner

from kvstore.admin_client import AdminClient
from kvstore.cli_serve import _progress_bars, admin_app

REPO = Path(__file__).resolve().parents[1]


def _cli(sc, *args: str):
    return CliRunner().invoke(admin_app, [*args, "--target", sc.target, "--token", sc.admin_token],
                              env={"COLUMNS": "200"})


def _tenant_with_blocks(sc, name: str, n: int) -> None:
    c = sc.tenant(name, local=False)
    c.put(SPEC, c.block_keys(SPEC, fresh_tokens(n)), random_kv(n))


def _slow_drop(sc, monkeypatch, seconds: float) -> threading.Event:
    """The server's drop_tenant takes ``seconds`` more (a tenant of millions of blocks); the
    event is set once it has returned."""
    store = sc.server.store
    real, dropped = store.drop_tenant, threading.Event()

    def slow(*a, **kw):
        time.sleep(seconds)
        try:
            return real(*a, **kw)
        finally:
            dropped.set()
    monkeypatch.setattr(store, "drop_tenant", slow)
    return dropped


# -- 1. tenant delete ------------------------------------------------------------------------------
def test_delete_tenant_answers_how_many_blocks_went_and_audits_it(sidecar):
    _tenant_with_blocks(sidecar, "counted", 4)
    assert sidecar.admin().delete_tenant("counted") == 4
    outcome = [e for e in sidecar.admin().audit() if e["action"] == "tenant.delete" and e["result"] == "OK"]
    assert outcome[-1]["target"] == "counted" and outcome[-1]["detail"] == "blocks=4"


def test_cli_tenant_delete_waits_past_the_clients_deadline_and_prints_the_count(sidecar, monkeypatch):
    """The deletion outlasts the AdminClient's default deadline (30 s; 1 s here): the CLI
    waited under it and failed with DEADLINE_EXCEEDED while the server deleted on."""
    _tenant_with_blocks(sidecar, "big", 3)
    _slow_drop(sidecar, monkeypatch, 2.0)
    monkeypatch.setitem(AdminClient.__init__.__kwdefaults__, "timeout", 1.0)
    result = _cli(sidecar, "tenant", "delete", "big", "--yes")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("deleted big: 3 blocks removed (")
    assert "deleting tenant big ..." in result.stderr  # off a terminal: one plain line while it waits
    assert "big" not in [t["name"] for t in sidecar.admin().list_tenants()]


def test_cli_tenant_delete_past_its_timeout_says_the_outcome_is_unknown(sidecar, monkeypatch):
    _tenant_with_blocks(sidecar, "slow", 2)
    dropped = _slow_drop(sidecar, monkeypatch, 2.0)
    result = _cli(sidecar, "tenant", "delete", "slow", "--yes", "--timeout", "0.3")
    assert result.exit_code == 1, result.output
    said = " ".join(result.stderr.split())
    assert ("error (DEADLINE_EXCEEDED): outcome unknown: the server may still be deleting; check "
            "`kvstore tenant list` / `kvstore audit` (no answer within --timeout 0.3 s)") in said, said
    assert dropped.wait(30)  # the server went on: the tenant is gone all the same
    deadline = time.monotonic() + 10
    while "slow" in [t["name"] for t in sidecar.admin().list_tenants()] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "slow" not in [t["name"] for t in sidecar.admin().list_tenants()]


def test_cli_tenant_delete_refuses_a_timeout_of_zero(sidecar):
    result = _cli(sidecar, "tenant", "delete", "x", "--yes", "--timeout", "0")
    assert result.exit_code == 2 and "--timeout must be more than 0 seconds" in result.output


def test_waiting_shows_a_spinner_with_the_time_elapsed_on_a_terminal():
    from kvstore.cli_views import waiting

    out = io.StringIO()
    with waiting("deleting tenant acme", Console(file=out, force_terminal=True, width=100)):
        time.sleep(0.3)
    text = out.getvalue()
    assert "deleting tenant acme" in text and "0:00:00" in text


# -- 2. serve's progress off a terminal ------------------------------------------------------------
def test_progress_off_a_terminal_is_plain_lines_at_the_start_every_tenth_and_the_end(capsys):
    with _progress_bars() as progress:  # stderr is captured: not a terminal
        for done in range(8192, 100_000, 8192):
            progress("recovering blocks from NVMe", done, 100_000)
        progress("recovering blocks from NVMe", 100_000, 100_000)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "recovering blocks from NVMe: 8192/100000 blocks (8%)"
    assert lines[-1] == "recovering blocks from NVMe: 100000/100000 blocks (100%)"
    assert 10 <= len(lines) <= 12, lines  # one per tenth, not one per report


def test_plain_progress_also_writes_every_few_seconds_of_a_slow_phase():
    from kvstore.cli_views import PlainProgress

    now = [0.0]
    lines: list[str] = []
    progress = PlainProgress(lines.append, every_s=5.0, clock=lambda: now[0])
    for done in range(1, 6):  # 1% each 6 s: no tenth crossed after the first line
        progress("committing memory blocks to NVMe", done, 100)
        now[0] += 6.0
    assert lines == [f"committing memory blocks to NVMe: {d}/100 blocks ({d}%)" for d in range(1, 6)]


def test_serve_off_a_terminal_prints_its_recovery_and_commit_as_lines(tmp_path):
    from kvstore import Store, StoreConfig

    home = tmp_path / "home"
    store = Store.open(StoreConfig(path=home, hbm_bytes=0, dram_bytes=0, nvme_bytes=64 << 20))
    store.put("t", SPEC, store.block_keys("t", SPEC, fresh_tokens(3)), random_kv(3))
    store.close()
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(f'[store]\npath = "{home}"\nhbm_bytes = 8388608\ndram_bytes = 8388608\n'
                   'nvme_bytes = 67108864\n[metrics]\nenabled = false\n')
    env = {**os.environ, "KVSTORE_HOME": str(home), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", "from kvstore.cli import main; main()", "serve", "--listen", "127.0.0.1:0",
           "--config", str(cfg)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines.append(proc.stdout.readline())
            if lines[-1].startswith("ready") or lines[-1] == "":
                break
        from kvstore.client import Client

        port = int(next(ln for ln in lines if "serving on" in ln).rsplit(":", 1)[1])
        admin_token = next(ln for ln in lines if "admin token" in ln).split()[-1]
        with AdminClient(f"127.0.0.1:{port}", admin_token) as admin:
            token = admin.create_tenant("late")
        with Client(f"127.0.0.1:{port}", token, local=False) as c:  # in HBM: committed to NVMe at stop
            c.put(SPEC, c.block_keys(SPEC, fresh_tokens(2)), random_kv(2))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert "recovering blocks from NVMe: 3/3 blocks (100%)" in err, (lines, err)
    assert "committing memory blocks to NVMe: 2/2 blocks (100%)" in err, (lines, err)


# -- 3. readable sizes -----------------------------------------------------------------------------
def test_stats_shows_sizes_and_json_gives_the_raw_document(sidecar):
    _tenant_with_blocks(sidecar, "sized", 8)
    raw = sidecar.admin().stats()
    shown = _cli(sidecar, "stats")
    assert shown.exit_code == 0, shown.output
    assert "32.0 MiB" in shown.stdout and str(raw["tiers"]["hbm"]["capacity_bytes"]) not in shown.stdout
    assert "32.0 KiB" in shown.stdout  # the tenant's bytes in HBM: 8 blocks of 4 KiB
    as_json = _cli(sidecar, "stats", "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["tiers"] == raw["tiers"]


def test_policy_get_and_set_show_quotas_as_sizes_and_json_gives_the_raw_document(sidecar):
    sidecar.admin().create_tenant("quoted")
    result = _cli(sidecar, "policy", "set", "quoted", "--quota", "hbm=3GiB", "--quota", "nvme=64GiB", "--ttl", "600")
    assert result.exit_code == 0, result.output
    got = _cli(sidecar, "policy", "get", "quoted")
    for out in (result.stdout, got.stdout):
        assert "3.0 GiB" in out and "64.0 GiB" in out and "600 s" in out, out
        assert str(3 << 30) not in out
    raw = json.loads(_cli(sidecar, "policy", "get", "quoted", "--json").stdout)
    assert raw["quota_bytes"] == {"hbm": 3 << 30, "nvme": 64 << 30} and raw["ttl_s"] == 600.0
