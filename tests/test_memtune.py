"""retain_freed_memory: applied through the C library's mallopt on glibc, at Store open and
Client creation when configured (and only then), and a refusal leaves it unapplied."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from conftest import MASTER

from kvstore import memtune
from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument
from kvstore.store import Store


def test_the_store_applies_it_only_when_configured(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("kvstore.store.retain_freed_memory", lambda: calls.append(1) or True)
    for flag, want in ((False, 0), (True, 1)):
        cfg = StoreConfig(path=tmp_path / str(flag), hbm_bytes=1 << 20, dram_bytes=0, nvme_bytes=0,
                          master_key=MASTER, retain_freed_memory=flag)
        Store.open(cfg).close()
        assert len(calls) == want


def test_the_client_applies_it_unless_told_not_to(monkeypatch):
    from kvstore.client import Client

    calls = []
    monkeypatch.setattr(memtune, "retain_freed_memory", lambda: calls.append(1) or True)
    for flag, want in ((False, 0), (True, 1)):
        Client("127.0.0.1:1", "token", local=False, retain_freed_memory=flag).close()
        assert len(calls) == want


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's")
def test_mallopt_takes_the_thresholds_in_a_fresh_process():
    code = "import kvstore.memtune as m; print(m.retain_freed_memory(), m.retain_freed_memory(), m._applied)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    assert out[:2] == ["True", "True"]  # applied, then idempotent
    assert out[2:] == [f"({64 << 20},", f"{256 << 20})"]


def test_a_refusal_or_no_glibc_leaves_it_unapplied(monkeypatch):
    class Refusing:
        def mallopt(self, param: int, value: int) -> int:
            return 0

    monkeypatch.setattr(memtune, "_applied", None)
    monkeypatch.setattr(memtune, "_libc", lambda: Refusing())
    assert memtune.retain_freed_memory() is False and memtune._applied is None
    monkeypatch.setattr(memtune, "_libc", lambda: None)
    assert memtune.retain_freed_memory() is False and memtune._applied is None


def test_thresholds_out_of_a_c_int_are_refused():
    with pytest.raises(InvalidArgument):
        memtune.retain_freed_memory(mmap_threshold=1 << 31)
    with pytest.raises(InvalidArgument):
        memtune.retain_freed_memory(trim_threshold=0)


# -- glibc's non-temporal threshold (streaming stores for block copies) ---------------------------
_GLIBC_X86 = platform.libc_ver()[0] == "glibc" and platform.machine() == "x86_64"
_ITEM = f"{memtune.NONTEMPORAL_TUNABLE}={1 << 20}"


@pytest.fixture
def glibc_x86(monkeypatch):
    monkeypatch.setattr(memtune.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(memtune.platform, "machine", lambda: "x86_64")


def test_streaming_copy_env_sets_the_tunable_and_keeps_the_rest(glibc_x86):
    env = memtune.streaming_copy_env({"A": "1"}, 1 << 20)
    assert env == {"A": "1", "GLIBC_TUNABLES": _ITEM}
    other = "glibc.malloc.arena_max=2"
    env = memtune.streaming_copy_env({"GLIBC_TUNABLES": other}, 1 << 20)
    assert env == {"GLIBC_TUNABLES": f"{other}:{_ITEM}"}


def test_streaming_copy_env_changes_nothing_when_off_already_set_or_elsewhere(glibc_x86, monkeypatch):
    assert memtune.streaming_copy_env({}, 0) is None
    # the operator's (or an earlier re-exec's) own value wins, wherever it sits in the list
    mine = f"glibc.malloc.arena_max=2:{memtune.NONTEMPORAL_TUNABLE}=99999"
    assert memtune.streaming_copy_env({"GLIBC_TUNABLES": mine}, 1 << 20) is None
    monkeypatch.setattr(memtune.platform, "machine", lambda: "aarch64")
    assert memtune.streaming_copy_env({}, 1 << 20) is None
    monkeypatch.setattr(memtune.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(memtune.platform, "libc_ver", lambda: ("", ""))
    assert memtune.streaming_copy_env({}, 1 << 20) is None


@pytest.mark.parametrize("bad", [1, memtune.NONTEMPORAL_MIN - 1, -5, 1 << 62])
def test_streaming_copy_thresholds_glibc_refuses_are_refused(bad):
    with pytest.raises(InvalidArgument):
        memtune.streaming_copy_env({}, bad)


def test_server_config_validates_the_threshold(tmp_path):
    from kvstore import server_config

    assert server_config.build({}, data_dir=tmp_path).streaming_copy_bytes == 1 << 20
    assert server_config.build({"streaming_copy_bytes": 0}, data_dir=tmp_path).streaming_copy_bytes == 0
    with pytest.raises(InvalidArgument, match="streaming_copy_bytes"):
        server_config.build({"streaming_copy_bytes": 4096}, data_dir=tmp_path)


@pytest.mark.skipif(not _GLIBC_X86, reason="the tunable is glibc's, on x86-64")
def test_reexec_runs_the_same_command_again_with_the_tunable_once(tmp_path):
    code = ("import os, sys, kvstore.memtune as m; print('start', os.getpid(), sys.argv[1:], flush=True); "
            "m.process_entry(); m.reexec_with_streaming_copies(); print('env', os.environ['GLIBC_TUNABLES'])")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code, "x", "y"], env=env, check=True, capture_output=True,
                         text=True).stdout.splitlines()
    # printed before the exec and again after it: same pid and arguments, then no third start
    assert len(out) == 3 and out[0] == out[1] and out[0].endswith("['x', 'y']")
    assert out[2] == f"env {_ITEM}"


def test_only_a_process_entry_reexecutes(monkeypatch, glibc_x86):
    """A command run from a library or a test (typer's CliRunner, an engine) must never
    replace its caller's process."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(memtune, "_entry", False)
    calls = []
    monkeypatch.setattr(memtune.os, "execve", lambda *a: calls.append(a))
    memtune.reexec_with_streaming_copies()
    assert calls == []
    memtune.process_entry()
    memtune.reexec_with_streaming_copies()
    assert len(calls) == 1 and calls[0][2]["GLIBC_TUNABLES"] == _ITEM


def test_reexec_that_fails_runs_on(monkeypatch, glibc_x86, caplog):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(memtune, "_entry", True)

    def refuse(*args):
        raise OSError("exec refused")

    monkeypatch.setattr(memtune.os, "execve", refuse)
    memtune.reexec_with_streaming_copies()  # returns instead of raising
    assert "could not re-execute" in caplog.text
    monkeypatch.setattr(memtune.sys, "executable", "")
    calls = []
    monkeypatch.setattr(memtune.os, "execve", lambda *a: calls.append(a))
    memtune.reexec_with_streaming_copies()
    assert calls == []  # nothing to re-execute: no attempt
