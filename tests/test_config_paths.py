"""Config settings that were taken other than as meant.

* ``store.path = ""`` served out of the current directory, and ``"~/x"`` made a directory named
  ``~`` there (while ``$KVSTORE_HOME`` was expanded): an empty path is refused, naming the
  field, and a leading ``~`` is expanded in every path setting.
* ``store.master_key`` took text as its UTF-8 bytes: the hex or base64 form that
  ``$KVSTORE_MASTER_KEY`` takes was refused, a typed 32-character password became the key.
* A size whose number overflows a float (``"<400 nines>GiB"``) raised a bare OverflowError
  out of the config and the CLI.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstore import server_config
from kvstore.cli_serve import admin_app
from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument
from kvstore.keyring import load_master_key
from kvstore.sizes import MAX_SIZE, parse_size

KEY = bytes(range(100, 132))
HUGE = "9" * 400


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """$HOME in the test's own directory (what ``~`` expands to)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


# -- paths --------------------------------------------------------------------------------------
@pytest.mark.parametrize("empty", ["", "  "])
def test_an_empty_store_path_is_refused_naming_the_field(empty) -> None:
    with pytest.raises(InvalidArgument, match=r"bad StoreConfig: path: must not be empty"):
        StoreConfig.build(path=empty)
    with pytest.raises(InvalidArgument, match=r"bad server config: store\.path: must not be empty"):
        server_config.build({"store": {"path": empty}})


def test_an_empty_store_path_in_a_config_file_is_refused(tmp_path) -> None:
    """Before, the server took it and kept its lock, audit log, tokens and blocks in whatever
    directory it was started in."""
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text('listen = "127.0.0.1:0"\n[store]\npath = ""\n[metrics]\nenabled = false\n')
    with pytest.raises(InvalidArgument, match=r"store\.path: must not be empty"):
        server_config.load(cfg)


def test_a_leading_tilde_is_the_home_directory_in_every_path_setting(home) -> None:
    config = server_config.build({
        "store": {"path": "~/kvs", "master_key_file": "~/keys/master.key"},
        "tls": {"cert_file": "~/tls/server.pem", "key_file": "~/tls/server.key", "client_ca_file": "~/tls/ca.pem"},
    })
    assert config.store.path == home / "kvs"
    assert config.data_dir == home / "kvs" and config.audit_file == home / "kvs" / "audit.log"
    assert config.store.master_key_file == home / "keys" / "master.key"
    assert config.tls is not None
    assert (config.tls.cert_file, config.tls.key_file, config.tls.client_ca_file) == (
        home / "tls" / "server.pem", home / "tls" / "server.key", home / "tls" / "ca.pem")


def test_the_remote_tiers_tls_files_take_a_leading_tilde_too(home) -> None:
    """Before, ``tiers.remote_config`` kept a literal ``~`` in its TLS file fields (it could
    not import the expanding type from ``kvstore.config``, which imports it)."""
    config = server_config.build({"store": {"path": "/srv/kvstore", "remote": {
        "urls": ["rediss://127.0.0.1:6380"], "tls_ca_file": "~/tls/ca.pem",
        "tls_cert_file": "~/tls/client.pem", "tls_key_file": "~/tls/client.key"}}})
    remote = config.store.remote
    assert remote is not None
    assert (remote.tls_ca_file, remote.tls_cert_file, remote.tls_key_file) == (
        home / "tls" / "ca.pem", home / "tls" / "client.pem", home / "tls" / "client.key")
    with pytest.raises(InvalidArgument, match=r"tls_ca_file: must not be empty"):
        server_config.build({"store": {"path": "/srv/kvstore", "remote": {
            "urls": ["rediss://127.0.0.1:6380"], "tls_ca_file": ""}}})


def test_a_path_given_in_python_is_expanded_too_and_others_are_kept(home, tmp_path) -> None:
    assert StoreConfig(path=Path("~") / "x").path == home / "x"
    assert StoreConfig(path=tmp_path / "data").path == tmp_path / "data"
    assert StoreConfig(path="relative/dir").path == Path("relative/dir")
    assert StoreConfig(path="/srv/a~b").path == Path("/srv/a~b")


def test_the_config_files_tilde_store_is_made_under_home_not_in_the_cwd(home, tmp_path, monkeypatch) -> None:
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text('[store]\npath = "~/kvs"\n')
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    config = server_config.load(cfg)
    assert config.data_dir == home / "kvs"
    assert not (work / "~").exists()


def test_other_empty_paths_are_refused_too() -> None:
    with pytest.raises(InvalidArgument, match="master_key_file: must not be empty"):
        StoreConfig.build(path="/srv/kvstore", master_key_file="")
    with pytest.raises(InvalidArgument, match=r"tls\.key_file: must not be empty"):
        server_config.build({"store": {"path": "/srv/kvstore"}, "tls": {"cert_file": "c.pem", "key_file": ""}})


def test_an_unknown_users_tilde_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidArgument, match=r"path: cannot expand the ~ of '~no-such-user-kvstore/x'"):
        StoreConfig.build(path="~no-such-user-kvstore/x")


# -- master key ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [KEY.hex(), KEY.hex().upper(), base64.b64encode(KEY).decode(),
                                  base64.urlsafe_b64encode(KEY).decode(), f"  {KEY.hex()}\n"])
def test_master_key_text_takes_the_forms_the_environment_variable_takes(text) -> None:
    config = StoreConfig.build(path="/srv/kvstore", master_key=text)
    assert config.master_key == KEY
    assert config.master_key == load_master_key(environ={"KVSTORE_MASTER_KEY": text})


def test_master_key_in_a_config_file_is_hex(tmp_path) -> None:
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text(f'[store]\npath = "{tmp_path / "data"}"\nmaster_key = "{KEY.hex()}"\n')
    assert server_config.load(cfg).store.master_key == KEY


@pytest.mark.parametrize("text", ["passwordpasswordpasswordpassword", "short", "", KEY.hex()[:-2],
                                  base64.b64encode(KEY[:24]).decode()])
def test_master_key_text_that_is_not_a_key_is_refused_without_echoing_it(text) -> None:
    with pytest.raises(InvalidArgument) as err:
        StoreConfig.build(path="/srv/kvstore", master_key=text)
    message = str(err.value)
    assert message.startswith("bad StoreConfig: master_key: as text, the key is 32 bytes in hex")
    assert not text or text not in message


def test_master_key_bytes_in_python_are_the_key_itself() -> None:
    assert StoreConfig(path="/srv/kvstore", master_key=KEY).master_key == KEY
    raw = b"passwordpasswordpasswordpassword"  # 32 bytes given as bytes: raw, as before
    assert StoreConfig(path="/srv/kvstore", master_key=raw).master_key == raw
    with pytest.raises(InvalidArgument, match="master_key must be 32 bytes, got 5"):
        StoreConfig.build(path="/srv/kvstore", master_key=b"short")
    config = server_config.build({"store": StoreConfig(path="/srv/kvstore", master_key=raw)})
    assert config.store.master_key == raw  # through model_dump and back


# -- sizes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [f"{HUGE}GiB", HUGE, f"{HUGE}.5", "1" + "0" * 20, "0" * 30 + "1" + "0" * 20 + "t"])
def test_a_size_too_large_is_an_invalid_argument_saying_so(text) -> None:
    with pytest.raises(InvalidArgument, match="too large; a size is at most 18446744073709551615 bytes"):
        parse_size(text)


def test_a_size_below_that_is_exact_and_left_to_the_callers_bound() -> None:
    """A capacity's own bound (1 PiB) names the field; the admin client bounds a quota."""
    assert parse_size(str(MAX_SIZE + 1)) == MAX_SIZE + 1
    assert parse_size("99999999999TiB") == 99999999999 << 40
    with pytest.raises(InvalidArgument, match=r"hbm_bytes: Input should be less than or equal to 1125899906842624"):
        StoreConfig.build(path="/srv/kvstore", hbm_bytes="99999999999TiB")


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "1e400", "Infinity", "0x10"])
def test_not_a_size_is_still_a_bad_size(text) -> None:
    with pytest.raises(InvalidArgument, match="bad size"):
        parse_size(text)


def test_sizes_are_exact() -> None:
    """Through a float, 2**53 + 1 came back as 2**53, and 2**64 - 1 as 2**64."""
    assert parse_size(str((1 << 53) + 1)) == (1 << 53) + 1
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("0.0000000000009094947017729282379150390625TiB") == 1  # 2**-40 TiB
    assert parse_size("1." + "5" * 5000 + "k") == 1592  # digits past any byte are dropped
    assert parse_size("0.9b") == 0 and parse_size(" 2 g ") == 2 << 30


def test_a_config_size_too_large_names_its_field() -> None:
    with pytest.raises(InvalidArgument, match=r"bad StoreConfig: hbm_bytes: bad size .*too large"):
        StoreConfig.build(path="/srv/kvstore", hbm_bytes=f"{HUGE}GiB")


def test_serve_with_a_size_too_large_is_an_error_not_a_traceback(tmp_path) -> None:
    cfg = tmp_path / "kvstore.toml"
    cfg.write_text(f'[store]\npath = "{tmp_path / "data"}"\nhbm_bytes = "{HUGE}GiB"\n[metrics]\nenabled = false\n')
    result = CliRunner().invoke(admin_app, ["serve", "--config", str(cfg)])
    assert result.exit_code == 1
    assert "store.hbm_bytes: bad size" in result.output and "too large" in result.output
    assert not isinstance(result.exception, OverflowError)


def test_policy_set_with_a_quota_too_large_is_a_bad_parameter() -> None:
    result = CliRunner().invoke(admin_app, ["policy", "set", "acme", "--token", "x", "--target", "127.0.0.1:1",
                                            "--quota", f"hbm={HUGE}"])
    assert result.exit_code == 2, result.output
    assert "too large" in " ".join(result.output.split())
    assert not isinstance(result.exception, OverflowError)

