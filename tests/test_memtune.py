"""retain_freed_memory: applied through the C library's mallopt on glibc, at Store open when
configured (and only then), and a refusal leaves it unapplied."""

from __future__ import annotations

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
