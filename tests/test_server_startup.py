"""A second server started where one runs is refused before it touches anything: the data
directory (its audit log) or the unix socket; and the metrics address printed is the bound one."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request

import pytest
from service_harness import config, start

from kvstore.admin_client import AdminClient
from kvstore.audit import AuditLog
from kvstore.errors import FailedPrecondition
from kvstore.server import bootstrap, create_server


def test_a_second_server_on_a_live_directory_leaves_its_audit_log_alone(tmp_path):
    """Its audit log opened before its Store's lock refused it: the live server's action in
    flight was closed as UNKNOWN and both wrote the same seq (verify: chain broken)."""
    sc = start(tmp_path)
    try:
        admin = sc.admin()
        admin.create_tenant("a")
        log = sc.server.config.audit_file
        before = log.read_bytes()
        # an action in flight: a STARTED entry without its outcome yet
        sc.server.audit.append("admin", "tenant.create", "b", "STARTED")
        during = log.read_bytes()
        with pytest.raises(FailedPrecondition, match="in use by another kvstore Store"):
            create_server(config(tmp_path))
        with pytest.raises(FailedPrecondition, match="in use by another kvstore Store"):
            bootstrap(config(tmp_path))
        assert log.read_bytes() == during and during.startswith(before)
        admin.create_tenant("c")  # the live server goes on, its log whole
        assert sc.server.audit.verify() > 0
    finally:
        sc.stop()
    assert AuditLog(log, clock=time.time).verify() > 0


def test_a_second_server_on_a_live_unix_socket_is_refused(tmp_path):
    """grpc unlinks the socket's path before it binds: the second server took the socket and
    the first went on running where no client could reach it."""
    sock = tmp_path / "kv.sock"
    listen = f"unix:{sock}"
    first = start(tmp_path / "a", listen=listen)
    try:
        with pytest.raises(FailedPrecondition, match="another server is listening"):
            create_server(config(tmp_path / "b", listen=listen))
        with AdminClient(listen, first.admin_token) as admin:
            assert admin.create_tenant("still-reachable")
    finally:
        first.stop()


def test_a_stale_socket_is_replaced_and_a_plain_file_is_not(tmp_path):
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, never listened: nothing answers
    sc = start(tmp_path / "a", listen=f"unix:{stale}")
    try:
        with AdminClient(f"unix:{stale}", sc.admin_token) as admin:
            assert admin.create_tenant("x")
    finally:
        sc.stop()
    plain = tmp_path / "notes.txt"
    plain.write_text("keep me")
    with pytest.raises(FailedPrecondition, match="not a socket"):
        create_server(config(tmp_path / "b", listen=f"unix:{plain}"))
    assert plain.read_text() == "keep me"


def test_the_metrics_address_is_the_bound_port(tmp_path):
    sc = start(tmp_path, metrics={"enabled": True, "listen": "127.0.0.1:0"})
    try:
        addr = sc.server.metrics_address
        assert addr is not None and not addr.endswith(":0")
        token = (tmp_path / "metrics.token").read_text().strip()
        request = urllib.request.Request(f"http://{addr}/metrics", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            assert b"kvstore" in r.read()
    finally:
        sc.stop()


def test_serve_prints_its_stop_records_the_first_admin_and_shows_the_metrics_port(tmp_path):
    """``kvstore serve`` printed nothing at a stop with nothing to commit, the first admin's
    creation was the one change not in the audit log, and ``metrics: ...:0`` named no port."""
    import os
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    cfg = tmp_path / "kvstore.toml"
    cfg.write_text(f'listen = "127.0.0.1:0"\naudit_fsync = false\nexpire_interval_s = 0\n'
                   f'[metrics]\nenabled = true\nlisten = "127.0.0.1:0"\n'
                   f'[store]\npath = "{tmp_path / "data"}"\nhbm_bytes = {8 << 20}\ndram_bytes = {8 << 20}\n'
                   f'nvme_bytes = {64 << 20}\ndurable = false\n')
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", "from kvstore.cli import main; main()", "serve", "--config",
                             str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo)}, cwd=tmp_path)
    lines = []
    try:
        while (line := proc.stdout.readline()) and not line.startswith("ready"):
            lines.append(line)
        metrics = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics \(bearer token in (\S+)\)", "".join(lines))
        assert metrics is not None and int(metrics.group(1)) > 0, "".join(lines)
        assert metrics.group(2) == str(tmp_path / "data" / "metrics.token")
        token = Path(metrics.group(2)).read_text().strip()
        request = urllib.request.Request(f"http://127.0.0.1:{metrics.group(1)}/metrics",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert out.strip().splitlines()[-1] == "stopped"
    first = AuditLog(tmp_path / "data" / "audit.log", clock=time.time).read(0, 1)[0]
    assert (first.principal, first.action, first.target, first.result) == ("kvstore serve", "tenant.create",
                                                                           "admin", "OK")


def test_a_first_start_that_fails_after_the_key_is_made_still_says_to_back_it_up(tmp_path):
    """The master key notice was printed only once the server was ready: a first start that
    failed after the Store had made the key (here: the metrics port busy, as for a second
    ``kvstore serve`` on defaults) never said it, and no later start did, the file existing by
    then. That start also said "stopped", over its error, though it never served."""
    import threading as _threading

    from kvstore.server import serve

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        cfg = config(tmp_path, metrics={"enabled": True, "listen": f"127.0.0.1:{busy.getsockname()[1]}"})
        lines: list[str] = []
        with pytest.raises(Exception):  # noqa: B017 - whatever the bind raises
            serve(cfg, echo=lines.append)
    finally:
        busy.close()
    key = tmp_path / "master.key"
    assert key.exists()
    assert f"generated master key: {key} (back it up: without it NVMe blocks are unreadable)" in lines
    assert "stopped" not in lines and "ready (Ctrl-C or SIGTERM to stop)" not in lines

    # the next start (the port free again) has nothing new to say about the key
    cfg = config(tmp_path, metrics={"enabled": False})
    lines = []

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("ready"):  # serve's own SIGINT handler is in place: stop it
            _threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    serve(cfg, echo=echo)
    assert not any("master key" in line for line in lines) and lines[-1] == "stopped"
