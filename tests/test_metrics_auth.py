"""The metrics endpoint asks for a bearer token by default.

Its labels name every tenant with its usage and activity; served open on loopback, any local
process (a tenant's own among them, whose Stats is scoped to itself) read them all."""

from __future__ import annotations

import os
import stat
import urllib.error
import urllib.request

import pytest

from kvstore import server_config
from kvstore.errors import FailedPrecondition
from kvstore.metrics_http import scrape_token
from tests.service_harness import start


def _scrape(address: str, authorization: str | None = None) -> tuple[int, bytes]:
    headers = {} if authorization is None else {"Authorization": authorization}
    request = urllib.request.Request(f"http://{address}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_scrape_without_the_token_is_refused_and_with_it_served(tmp_path) -> None:
    sc = start(tmp_path, metrics={"enabled": True, "listen": "127.0.0.1:0"})
    try:
        address = sc.server.metrics_address
        token_file = tmp_path / "metrics.token"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        for refused in (None, "Bearer", f"Bearer {token}x", f"Basic {token}", token, f"Bearer {token[:-1]}"):
            code, body = _scrape(address, refused)
            assert code == 401, refused
            assert b"kvstore_" not in body
        for accepted in (f"Bearer {token}", f"bearer  {token} "):
            code, body = _scrape(address, accepted)
            assert code == 200 and b"kvstore_store_" in body
    finally:
        sc.stop()


def test_the_token_survives_a_restart_and_auth_none_serves_anyone(tmp_path) -> None:
    sc = start(tmp_path, metrics={"enabled": True, "listen": "127.0.0.1:0"})
    token = (tmp_path / "metrics.token").read_text().strip()
    sc.stop()
    sc = start(tmp_path, admin_token=sc.admin_token, metrics={"enabled": True, "listen": "127.0.0.1:0"})
    try:
        assert (tmp_path / "metrics.token").read_text().strip() == token
        assert _scrape(sc.server.metrics_address, f"Bearer {token}")[0] == 200
    finally:
        sc.stop()
    sc = start(tmp_path / "open", metrics={"enabled": True, "listen": "127.0.0.1:0", "auth": "none"})
    try:
        assert _scrape(sc.server.metrics_address)[0] == 200
        assert not (tmp_path / "open" / "metrics.token").exists()
    finally:
        sc.stop()


def test_a_given_token_file_is_used_and_a_readable_one_refused(tmp_path) -> None:
    given = tmp_path / "scrape.token"
    given.write_text("operator-chosen-token-0123456789\n")
    given.chmod(0o600)
    sc = start(tmp_path / "a", metrics={"enabled": True, "listen": "127.0.0.1:0", "token_file": str(given)})
    try:
        assert _scrape(sc.server.metrics_address, "Bearer operator-chosen-token-0123456789")[0] == 200
    finally:
        sc.stop()
    given.chmod(0o644)
    with pytest.raises(FailedPrecondition, match=r"scrape\.token has permissions 0644"):
        start(tmp_path / "b", metrics={"enabled": True, "listen": "127.0.0.1:0", "token_file": str(given)})
    # the refused start closed its store: the directory can be served again
    given.chmod(0o600)
    start(tmp_path / "b", admin_token="bootstrapped-above", metrics={"enabled": True, "listen": "127.0.0.1:0", "token_file": str(given)}).stop()


@pytest.mark.parametrize("content", [b"", b"  \n", b"two words\n", "t\u00f6ken\n".encode()])
def test_a_token_file_without_a_token_is_refused(tmp_path, content) -> None:
    path = tmp_path / "t"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(FailedPrecondition, match="holds no token"):
        scrape_token(path)


def test_the_token_file_defaults_to_the_data_directory_and_takes_a_tilde(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config = server_config.build({"store": {"path": str(tmp_path / "d")}})
    assert config.metrics.auth == "token"
    assert config.metrics_token_file == tmp_path / "d" / "metrics.token"
    config = server_config.build({"store": {"path": str(tmp_path / "d")}, "metrics": {"token_file": "~/m.token"}})
    assert config.metrics_token_file == tmp_path / "m.token"


def test_replacing_the_token_file_rotates_the_token(tmp_path) -> None:
    """The token was read once at start: a new one in the file was refused, and the old
    (leaked) one kept working after the file was replaced or deleted."""
    sc = start(tmp_path, metrics={"enabled": True, "listen": "127.0.0.1:0"})
    try:
        address, path = sc.server.metrics_address, tmp_path / "metrics.token"
        old = path.read_text().strip()
        new = tmp_path / "new.token"
        new.write_text("rotated-token-0123456789abcdef\n")
        new.chmod(0o600)
        os.replace(new, path)
        assert _scrape(address, f"Bearer {old}")[0] == 401
        assert _scrape(address, "Bearer rotated-token-0123456789abcdef")[0] == 200
        path.chmod(0o644)  # loose: nothing is accepted until it is fixed
        os.utime(path, ns=(1, 1))
        assert _scrape(address, "Bearer rotated-token-0123456789abcdef")[0] == 401
        path.unlink()
        assert _scrape(address, "Bearer rotated-token-0123456789abcdef")[0] == 401
        assert _scrape(address, f"Bearer {old}")[0] == 401
    finally:
        sc.stop()


def test_a_chmod_that_loosens_the_token_file_refuses_scrapes_at_once(tmp_path) -> None:
    """The file was read again only when its inode, size or mtime changed, and chmod changes
    none of them: a token file made world-readable kept its token accepted."""
    sc = start(tmp_path, metrics={"enabled": True, "listen": "127.0.0.1:0"})
    try:
        address, path = sc.server.metrics_address, tmp_path / "metrics.token"
        token = path.read_text().strip()
        assert _scrape(address, f"Bearer {token}")[0] == 200
        path.chmod(0o644)
        assert _scrape(address, f"Bearer {token}")[0] == 401
        path.chmod(0o640)
        assert _scrape(address, f"Bearer {token}")[0] == 401
        path.chmod(0o600)  # fixed: served again
        assert _scrape(address, f"Bearer {token}")[0] == 200
    finally:
        sc.stop()


def test_idle_connections_to_the_metrics_port_hold_no_thread_for_long(tmp_path, monkeypatch) -> None:
    """One thread per connection, without a timeout: ~1,000 idle connections (no token
    needed) took every file descriptor of the sidecar, and its gRPC service failed too."""
    import socket
    import threading
    import time

    from kvstore import metrics_http
    from kvstore.client import Client

    monkeypatch.setattr(metrics_http, "HANDLER_TIMEOUT_S", 1.0)
    sc = start(tmp_path, metrics={"enabled": True, "listen": "127.0.0.1:0"})
    idle: list[socket.socket] = []
    try:
        host, port = sc.server.metrics_address.rsplit(":", 1)
        before = threading.active_count()
        for _ in range(3 * metrics_http.MAX_CONNECTIONS):
            s = socket.create_connection((host, int(port)))
            s.sendall(b"GET /metr")  # half a request line, then silence
            idle.append(s)
        time.sleep(0.3)
        assert threading.active_count() - before <= metrics_http.MAX_CONNECTIONS
        with Client(sc.target, sc.admin_token, local=False) as c:  # the service still answers
            assert "tiers" in c.stats()
        time.sleep(1.5)  # the idle ones time out
        token = (tmp_path / "metrics.token").read_text().strip()
        assert _scrape(sc.server.metrics_address, f"Bearer {token}")[0] == 200
    finally:
        for s in idle:
            s.close()
        sc.stop()
