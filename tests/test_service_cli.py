"""The operators' CLI against a live sidecar, `serve` on embedded defaults, and the metrics."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from service_harness import SPEC, fresh_tokens, random_kv
from typer.testing import CliRunner

from kvstore.cli_serve import admin_app, parse_size

REPO = Path(__file__).resolve().parents[1]


def _run(sc, *args: str) -> str:
    result = CliRunner().invoke(admin_app, [*args, "--target", sc.target, "--token", sc.admin_token])
    assert result.exit_code == 0, result.output
    return result.output


def test_tenant_policy_stats_and_audit_commands(sidecar):
    token = _run(sidecar, "tenant", "add", "cli-t").strip()
    assert token.startswith("kvs_")
    assert sidecar.client(token).whoami()["principal"] == "cli-t"
    assert _run(sidecar, "tenant", "rotate", "cli-t").strip() != token
    policy = json.loads(_run(sidecar, "policy", "set", "cli-t", "--ttl", "30", "--quota", "hbm=1MiB", "--json"))
    assert policy["quota_bytes"] == {"hbm": 1 << 20} and policy["ttl_s"] == 30.0
    assert json.loads(_run(sidecar, "policy", "get", "cli-t", "--json"))["ttl_s"] == 30.0
    assert "tiers" in json.loads(_run(sidecar, "stats", "--json"))
    _run(sidecar, "tenant", "delete", "cli-t", "--yes")
    lines = [json.loads(x) for x in _run(sidecar, "audit", "--json").splitlines()]
    assert [(e["action"], e["result"]) for e in lines] == [
        ("tenant.create", "STARTED"), ("tenant.create", "OK"), ("tenant.rotate", "STARTED"), ("tenant.rotate", "OK"),
        ("policy.set", "STARTED"), ("policy.set", "OK"), ("policy.get", "OK"),
        ("tenant.delete", "STARTED"), ("tenant.delete", "OK")]


def test_cli_reports_errors_with_their_code(sidecar):
    result = CliRunner().invoke(admin_app, ["tenant", "rotate", "nobody", "--target", sidecar.target,
                                            "--token", sidecar.admin_token])
    assert result.exit_code == 1


@pytest.mark.parametrize("args, says", [
    (["policy", "set", "cli-x", "--quota", "hbm=99999999999t"], "the quota for hbm must be an integer in"),
    (["policy", "set", "cli-x", "--priority", "99999999999"], "priority must be an integer in"),
    (["tenant", "add", "cli-y", "--role", "superuser"], "role must be one of tenant, publisher, admin"),
    (["audit", "--limit", "-1"], "Invalid value for '--limit': Input should be greater than or equal to 1"),
    (["audit", "--since", "-5"], "Invalid value for '--since': Input should be greater than or equal to 0"),
    (["tenant", "add", "cli-x"], "principal 'cli-x' already exists"),
])
def test_bad_cli_values_are_one_line_errors_not_tracebacks(sidecar, args, says):
    """Each of these raised a bare ValueError (a traceback) while the request was built."""
    sidecar.admin().create_tenant("cli-x")
    result = CliRunner().invoke(admin_app, [*args, "--target", sidecar.target, "--token", sidecar.admin_token])
    assert result.exit_code == 1 and result.exception is None or isinstance(result.exception, SystemExit)
    out = " ".join(result.output.split())
    assert says in out and "Traceback" not in out
    assert "ALREADY_EXISTS: " not in out  # the code once, not twice


def test_errors_are_printed_as_text_not_console_markup(tmp_path):
    """A message naming a config table, "[tls]", reaches the operator whole."""
    cfg = tmp_path / "open.toml"
    cfg.write_text(f'listen = "0.0.0.0:0"\n[store]\npath = "{tmp_path / "data"}"\n')
    result = CliRunner().invoke(admin_app, ["serve", "--config", str(cfg)])
    assert result.exit_code == 1
    assert "configure [tls] or set allow_insecure_remote" in " ".join(result.output.split())


def test_metrics_on_a_non_loopback_address_need_allow_remote(tmp_path):
    cfg = tmp_path / "open.toml"
    cfg.write_text(f'listen = "127.0.0.1:0"\n[store]\npath = "{tmp_path / "data"}"\n'
                   '[metrics]\nlisten = "0.0.0.0:0"\n')
    result = CliRunner().invoke(admin_app, ["serve", "--config", str(cfg)])
    assert result.exit_code == 1
    assert "set [metrics] allow_remote = true" in " ".join(result.output.split())


def test_a_metrics_port_in_use_is_a_clear_error_and_nothing_is_left_serving(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = tmp_path / "m.toml"
        cfg.write_text(f'listen = "127.0.0.1:0"\n[store]\npath = "{tmp_path / "data"}"\n'
                       f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
        result = CliRunner().invoke(admin_app, ["serve", "--config", str(cfg)])
    assert result.exit_code == 1
    assert f"cannot serve metrics on '127.0.0.1:{port}'" in " ".join(result.output.split())
    # the Store it opened was closed again: its directory opens
    from kvstore import Store, StoreConfig

    Store.open(StoreConfig(path=tmp_path / "data", nvme_bytes=0)).close()


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30 and parse_size("512k") == 512 << 10 and parse_size("17") == 17


@pytest.mark.parametrize("text, n", [("1.5GiB", 3 << 29), ("2 gb", 2 << 30), ("0", 0), (" 7 KiB ", 7 << 10),
                                     ("1T", 1 << 40), ("3b", 3)])
def test_sizes_are_binary_whatever_the_spelling(text, n):
    from kvstore.sizes import parse_size as sizes_parse

    assert sizes_parse(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "-1", "1e9", "2 gallons", "1.5.2g"])
def test_a_bad_size_is_invalid_argument_saying_what_a_size_looks_like(text):
    from kvstore.errors import InvalidArgument
    from kvstore.sizes import parse_size as sizes_parse

    with pytest.raises(InvalidArgument, match="512MiB, 2GiB or a byte count"):
        sizes_parse(text)


def test_metrics_count_requests_and_read_store_stats(sidecar):
    c = sidecar.tenant("metered")
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, keys, random_kv(2))
    c.lookup(SPEC, keys)
    c.get(SPEC, keys)  # saved prefill tokens count what is served, not what a lookup finds
    text = generate_latest(sidecar.server.metrics_registry).decode()
    assert 'kvstore_requests_total{code="OK",rpc="Lookup"} 1.0' in text
    assert 'kvstore_lookup_hit_blocks_total{tenant="metered"} 2.0' in text
    assert 'kvstore_saved_prefill_tokens_total{tenant="metered"} 32.0' in text
    assert 'kvstore_store_tiers_used_bytes{tier="hbm"}' in text
    assert "kvstore_request_latency_seconds_bucket" in text
    sidecar.admin().delete_tenant("metered")  # a tenant created later under the name starts at 0
    text = generate_latest(sidecar.server.metrics_registry).decode()
    assert 'tenant="metered"' not in text


def test_serve_runs_on_embedded_defaults_and_prints_the_token_once(tmp_path):
    env = {**os.environ, "KVSTORE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    code = "from kvstore.cli import main; main()"  # as the console script runs it
    cmd = [sys.executable, "-c", code, "serve", "--listen", "127.0.0.1:0",
           "--config", str(_tiny_config(tmp_path))]
    outputs = []
    for _ in range(2):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("ready") or line == "":
                break
        if sys.platform == "linux" and "GLIBC_TUNABLES" not in env:
            # serve re-executed itself (same pid) with streaming copies on (memtune)
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            tunables = [e for e in environ if e.startswith(b"GLIBC_TUNABLES=")]
            if platform.libc_ver()[0] == "glibc" and platform.machine() == "x86_64":
                assert tunables == [b"GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=1048576"]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        outputs.append("".join(lines))
        assert proc.returncode == 0, outputs[-1]
    assert "serving on 127.0.0.1:" in outputs[0] and "admin token" in outputs[0]
    assert "admin token" not in outputs[1]
    assert (tmp_path / "home" / "auth.json").exists()


def test_serve_says_how_many_blocks_it_recovered_and_committed(tmp_path):
    """A restart with blocks on NVMe prints how many it recovered (the index rebuild takes tens
    of seconds for a million blocks; a progress bar shows it on a terminal), and a stop how many
    memory blocks it committed to NVMe."""
    from kvstore import Store, StoreConfig

    home = tmp_path / "home"
    store = Store.open(StoreConfig(path=home, hbm_bytes=0, dram_bytes=0, nvme_bytes=64 << 20))
    store.put("t", SPEC, store.block_keys("t", SPEC, fresh_tokens(3)), random_kv(3))
    store.close()
    env = {**os.environ, "KVSTORE_HOME": str(home), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", "from kvstore.cli import main; main()", "serve", "--listen", "127.0.0.1:0",
           "--config", str(_tiny_config(tmp_path))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines.append(proc.stdout.readline())
            if lines[-1].startswith("ready") or lines[-1] == "":
                break
        out = "".join(lines)
        assert "recovered 3 blocks from NVMe" in out, out
        # two blocks put now live in HBM: committed to NVMe at stop, and said so
        from kvstore.admin_client import AdminClient
        from kvstore.client import Client

        port = int(next(ln for ln in lines if "serving on" in ln).rsplit(":", 1)[1])
        admin_token = next(ln for ln in lines if "admin token" in ln).split()[-1]
        with AdminClient(f"127.0.0.1:{port}", admin_token) as admin:
            token = admin.create_tenant("late")
        with Client(f"127.0.0.1:{port}", token, local=False) as c:
            c.put(SPEC, c.block_keys(SPEC, fresh_tokens(2)), random_kv(2))
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert "stopped: 2 blocks of HBM and DRAM committed to NVMe" in rest, rest


def _tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(f'[store]\npath = "{tmp_path / "home"}"\nhbm_bytes = 8388608\ndram_bytes = 8388608\n'
                    'nvme_bytes = 67108864\n[metrics]\nenabled = false\n')
    return path


def test_format_size_is_binary_and_round_trips_through_parse_size():
    from kvstore.sizes import format_size

    assert [format_size(n) for n in (0, 512, 1024, 124 * 1024, 64 << 30, 3 << 40)] == [
        "0 B", "512 B", "1.0 KiB", "124.0 KiB", "64.0 GiB", "3.0 TiB"]
    assert parse_size(format_size(64 << 30).replace(" ", "")) == 64 << 30


def test_a_first_start_that_fails_leaves_the_admin_token_to_the_next_one(tmp_path):
    """The admin was created before the server started: a first start that then failed (here
    a metrics port in use) saved an admin whose token it never printed, and no later start
    printed one. The running server creates it now."""
    import socket

    from kvstore.auth import AuthRegistry, Role
    from kvstore.server import serve
    from kvstore.server_config import load

    home = tmp_path / "home"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = tmp_path / "busy.toml"
        cfg.write_text(f'listen = "127.0.0.1:0"\n[store]\npath = "{home}"\nhbm_bytes = 8388608\n'
                       f'dram_bytes = 8388608\nnvme_bytes = 67108864\n'
                       f'[metrics]\nlisten = "127.0.0.1:{taken.getsockname()[1]}"\n')
        with pytest.raises(Exception, match="cannot serve metrics"):
            serve(load(cfg), echo=lambda line: None)
    auth = home / "auth.json"
    assert not auth.exists() or not any(p.role is Role.ADMIN for p in AuthRegistry(auth, clock=time.time).list())
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("ready"):
            os.kill(os.getpid(), signal.SIGTERM)  # serve's handler stops it

    serve(load(_tiny_config(tmp_path), overrides={"listen": "127.0.0.1:0"}), echo=echo)
    token = next(line for line in lines if line.startswith("admin token")).rsplit(" ", 1)[1]
    assert AuthRegistry(auth, clock=time.time).authenticate(token).role is Role.ADMIN


def test_serve_warns_when_the_principals_file_is_gone_but_tenants_data_is_not(tmp_path):
    """A lost auth.json gave a fresh admin and silence, with every tenant's blocks still there."""
    from conftest import make_kv, tokens

    from kvstore import Store
    from kvstore.server import serve
    from kvstore.server_config import load

    config = load(_tiny_config(tmp_path), overrides={"listen": "127.0.0.1:0"})
    store = Store.open(config.store)
    store.put("acme", SPEC, store.block_keys("acme", SPEC, tokens(1, SPEC)), make_kv(SPEC, 1))
    store.close()
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("ready"):
            os.kill(os.getpid(), signal.SIGTERM)

    serve(config, echo=echo)
    assert any("no principals file" in line and "data of 1 tenants" in line for line in lines), lines


def test_serve_says_how_many_memory_blocks_its_stop_could_not_commit(tmp_path):
    """A tenant at its NVMe quota: the stop commits the chain's ancestors and cannot commit
    the rest of its memory blocks; the Store logged it, and serve said nothing of it."""
    from kvstore.admin_client import AdminClient
    from kvstore.client import Client
    from kvstore.server import serve
    from kvstore.server_config import load

    config = load(_tiny_config(tmp_path), overrides={"listen": "127.0.0.1:0"})
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("ready") and (first := [x for x in lines if x.startswith("admin token")]):
            port = next(x for x in lines if x.startswith("kvstore serving on")).rsplit(":", 1)[1]
            admin_token = first[0].rsplit(" ", 1)[1]
            with AdminClient(f"127.0.0.1:{port}", admin_token) as admin:
                token = admin.create_tenant("q")
                b = SPEC.block_nbytes
                admin.set_policy("q", quota_bytes={"hbm": 2 * b, "dram": 2 * b, "nvme": 2 * b})
            with Client(f"127.0.0.1:{port}", token) as client:
                # NOTE: 4 blocks, all in memory: a block goes to NVMe only with copies of its
                # ancestors (tests/test_nvme_closure15.py), so 6 no longer fit this quota
                keys = client.block_keys(SPEC, fresh_tokens(4))
                client.put(SPEC, keys, random_kv(4))
                assert client.lookup(SPEC, keys).num_blocks == 4
        if line.startswith("ready"):
            os.kill(os.getpid(), signal.SIGTERM)

    serve(config, echo=echo)
    assert any(line.startswith("warning: 2 memory blocks could not be committed to NVMe") for line in lines), lines
    lines.clear()
    serve(config, echo=echo)  # the same again: what the first stop committed comes back
    assert any(line.startswith("recovered 2 blocks from NVMe") for line in lines), lines


def test_a_second_signal_during_the_stop_says_so_and_a_third_abandons_with_a_count(tmp_path):
    """The handlers were restored before the stop: a second Ctrl-C or SIGTERM during the commit
    of memory blocks killed the process at once, silently, most of the blocks lost."""
    from kvstore.admin_client import AdminClient
    from kvstore.client import Client
    from kvstore.server import serve
    from kvstore.server_config import load

    config = load(_tiny_config(tmp_path), overrides={"listen": "127.0.0.1:0"})
    lines: list[str] = []
    signals = 0

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith("ready"):
            port = next(x for x in lines if x.startswith("kvstore serving on")).rsplit(":", 1)[1]
            admin_token = next(x for x in lines if x.startswith("admin token")).rsplit(" ", 1)[1]
            with AdminClient(f"127.0.0.1:{port}", admin_token) as admin:
                token = admin.create_tenant("t")
            with Client(f"127.0.0.1:{port}", token) as client:
                client.put(SPEC, client.block_keys(SPEC, fresh_tokens(6)), random_kv(6))
            os.kill(os.getpid(), signal.SIGTERM)

    def progress(what: str, done: int, total: int) -> None:
        nonlocal signals
        while what.startswith("committing") and total and signals < 2:
            signals += 1
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, in this thread
            time.sleep(0.05)

    with pytest.raises(SystemExit) as stopped:
        serve(config, echo=echo, progress=progress)
    assert stopped.value.code == 130
    assert any(x.startswith("stopping: committing memory blocks to NVMe") for x in lines), lines
    assert any(x.startswith("abandoned: ") and "memory blocks were committed" in x for x in lines), lines
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
