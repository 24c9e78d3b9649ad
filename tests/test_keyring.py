"""Master key loading and the per-tenant envelope keyring."""

from __future__ import annotations

import base64
import os
import stat
import threading
from pathlib import Path

import pytest

from kvstore.errors import FailedPrecondition, InvalidArgument, KeyUnavailable
from kvstore.keyring import Keyring, load_master_key

K1, K2, K3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


def _write_key(path: Path, key: bytes, mode: int = 0o600) -> Path:
    path.write_text(key.hex())
    path.chmod(mode)
    return path


# -- load_master_key --------------------------------------------------------------------------
def test_master_key_priority_explicit_then_env_then_file(tmp_path: Path) -> None:
    f = _write_key(tmp_path / "master.key", K3)
    env = {"KVSTORE_MASTER_KEY": K2.hex()}
    assert load_master_key(K1, environ=env, key_file=f) == K1
    assert load_master_key(None, environ=env, key_file=f) == K2
    assert load_master_key(None, environ={}, key_file=f) == K3


def test_master_key_env_accepts_hex_and_base64() -> None:
    key = bytes(range(32))
    assert load_master_key(environ={"K": key.hex()}, env_var="K") == key
    assert load_master_key(environ={"K": base64.b64encode(key).decode()}, env_var="K") == key
    assert load_master_key(environ={"K": base64.urlsafe_b64encode(key).decode()}, env_var="K") == key


@pytest.mark.parametrize("bad", [b"short", b"x" * 33, b""])
def test_master_key_of_wrong_length_is_refused(bad: bytes) -> None:
    with pytest.raises(InvalidArgument, match="32 bytes"):
        load_master_key(bad, environ={})


def test_master_key_env_garbage_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="KVSTORE_MASTER_KEY"):
        load_master_key(environ={"KVSTORE_MASTER_KEY": "not a key!"})
    with pytest.raises(InvalidArgument, match="32 bytes"):
        load_master_key(environ={"KVSTORE_MASTER_KEY": base64.b64encode(b"x" * 16).decode()})


def test_master_key_file_generated_with_0600_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "master.key"
    old = os.umask(0)  # even with a permissive umask the file must come out 0600
    try:
        key = load_master_key(environ={}, key_file=path, create=True, random_bytes=lambda n: K1[:n])
    finally:
        os.umask(old)
    assert key == K1
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_master_key(environ={}, key_file=path, create=True, random_bytes=lambda n: K2[:n]) == K1
    assert [p.name for p in path.parent.iterdir()] == ["master.key"]  # no temp file left behind


def test_master_key_file_created_with_restrictive_mode_from_the_start(tmp_path: Path, monkeypatch) -> None:
    modes: list[int] = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *a, **kw):  # type: ignore[no-untyped-def]
        if flags & os.O_CREAT:
            modes.append(mode)
        return real_open(path, flags, mode, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    load_master_key(environ={}, key_file=tmp_path / "k", create=True)
    assert modes == [0o600]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_master_key_file_with_group_or_other_bits_is_refused(tmp_path: Path, mode: int) -> None:
    f = _write_key(tmp_path / "master.key", K1, mode)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        load_master_key(environ={}, key_file=f)


def test_master_key_file_raw_bytes_accepted(tmp_path: Path) -> None:
    f = tmp_path / "raw.key"
    f.write_bytes(K2)
    f.chmod(0o600)
    assert load_master_key(environ={}, key_file=f) == K2


def test_no_master_key_without_create_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="no master key"):
        load_master_key(environ={}, key_file=tmp_path / "missing.key")
    with pytest.raises(InvalidArgument, match="no master key"):
        load_master_key(environ={}, create=True)  # nowhere to write one
    assert not (tmp_path / "missing.key").exists()


# -- Keyring ----------------------------------------------------------------------------------
def test_data_keys_are_per_tenant_stable_and_stored_wrapped() -> None:
    backend: dict[str, bytes] = {}
    ring = Keyring(K1, backend)
    a, b = ring.data_key("tenant-a"), ring.data_key("tenant-b")
    assert len(a) == len(b) == 32 and a != b
    assert ring.data_key("tenant-a") == a
    assert ring.tenants() == ["tenant-a", "tenant-b"]
    assert a not in backend["tenant-a"] and backend["tenant-a"] != a  # wrapped, not plain
    assert Keyring(K1, backend).data_key("tenant-a") == a  # survives a restart


def test_missing_key_without_create_is_unavailable() -> None:
    ring = Keyring(K1, {})
    with pytest.raises(KeyUnavailable):
        ring.data_key("nobody", create=False)
    assert ring.tenants() == []


def test_destroy_shreds_the_key() -> None:
    backend: dict[str, bytes] = {}
    ring = Keyring(K1, backend)
    old = ring.data_key("t")
    assert ring.destroy("t") is True
    assert "t" not in backend and ring.tenants() == []
    with pytest.raises(KeyUnavailable):
        ring.data_key("t", create=False)
    with pytest.raises(KeyUnavailable):
        Keyring(K1, backend).data_key("t", create=False)
    assert ring.data_key("t") != old  # a re-created tenant gets a fresh key
    assert ring.destroy("never-existed") is False


def test_wrong_master_key_fails_clearly_at_open() -> None:
    backend: dict[str, bytes] = {}
    Keyring(K1, backend).data_key("t")
    with pytest.raises(FailedPrecondition, match="master key is wrong"):
        Keyring(K2, backend)


def test_wrapped_key_fails_clearly_when_unwrappable() -> None:
    backend: dict[str, bytes] = {}
    Keyring(K1, backend).data_key("t")
    other: dict[str, bytes] = {}
    Keyring(K2, other)
    other["t"] = backend["t"]  # a key wrapped under another master key
    with pytest.raises(FailedPrecondition, match="tenant 't'"):
        Keyring(K2, other).data_key("t")


def test_wrapped_key_cannot_be_moved_to_another_tenant() -> None:
    backend: dict[str, bytes] = {}
    ring = Keyring(K1, backend)
    ring.data_key("a")
    backend["b"] = backend["a"]
    with pytest.raises(FailedPrecondition):
        Keyring(K1, backend).data_key("b")


def test_keyring_rejects_bad_master_key_and_tenant() -> None:
    with pytest.raises(InvalidArgument):
        Keyring(b"short", {})
    with pytest.raises(InvalidArgument):
        Keyring(K1, {}).data_key("")


def test_concurrent_first_use_yields_one_key() -> None:
    ring = Keyring(K1, {})
    got: list[bytes] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        got.append(ring.data_key("shared"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1


def test_cached_keys_are_revalidated_after_the_cache_ttl() -> None:
    """Two keyrings over one backend (as two servers over one Redis): a key destroyed by one
    stops being served by the other once its cached copy is older than ``cache_ttl_s``."""
    now = [0.0]
    backend: dict[str, bytes] = {}
    a = Keyring(K1, backend)
    b = Keyring(K1, backend, cache_ttl_s=5.0, clock=lambda: now[0])
    key = a.data_key("t")
    assert b.data_key("t", create=False) == key
    a.destroy("t")
    now[0] = 4.9
    assert b.data_key("t", create=False) == key  # still inside the TTL
    now[0] = 5.0
    with pytest.raises(KeyUnavailable):
        b.data_key("t", create=False)
    fresh = a.data_key("t")  # re-created elsewhere: picked up on the next read
    assert b.data_key("t", create=False) == fresh != key
    with pytest.raises(InvalidArgument, match="cache_ttl_s"):
        Keyring(K1, {}, cache_ttl_s=0)
