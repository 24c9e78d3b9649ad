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
