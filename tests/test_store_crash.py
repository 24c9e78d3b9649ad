"""Invariant 6: kill -9 at random points loses at most uncommitted blocks; after reopening,
every committed block is served intact and nothing is served wrong."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import crash_child

from kvstore.store import Store

CHILD = Path(__file__).with_name("crash_child.py")


def run_and_kill(path: Path, mode: str, start: int, rng: random.Random) -> list[int]:
    proc = subprocess.Popen([sys.executable, str(CHILD), str(path), mode, str(start)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", proc.stderr.read() if proc.stderr else line
    time.sleep(rng.uniform(0.05, 0.6))  # kill anywhere inside the put loop
    proc.send_signal(signal.SIGKILL)
    out, _err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return [int(x.split()[1]) for x in out.splitlines() if x.startswith("ack ")]


def check(path: Path, mode: str, acked: list[int], started: int) -> None:
    store = Store.open(crash_child.config(path, mode))
    try:
        spec = crash_child.SPEC
        for i in range(started):
            toks, kv = crash_child.chain(i)
            keys = store.block_keys("t", spec, toks)
            got = store.get("t", spec, keys)
            # whatever is served is exactly what was put (invariant 1)
            assert torch.equal(got.view(torch.uint8), kv[: got.shape[0]].view(torch.uint8)), i
            if mode == "nvme" and i in acked:
                assert got.shape[0] == len(keys), f"acknowledged chain {i} lost"
        assert store.stats()["integrity_failures"] == 0
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["nvme", "tiered"])
def test_kill_9_loses_nothing_committed(tmp_path, mode):
    rng = random.Random(7 if mode == "nvme" else 8)
    path = tmp_path / "store"
    acked: list[int] = []
    start = 0
    kills = 0
    while kills < 10:
        new = run_and_kill(path, mode, start, rng)
        kills += 1
        acked += new
        # the put in progress at the kill may or may not have committed: it counts as started
        started = (max(new) + 2) if new else start + 1
        check(path, mode, acked, started)
        start = started
    assert kills >= 10 and len(acked) > 10  # the child made progress between kills


def test_open_reports_its_progress_rebuilding_the_index(tmp_path, monkeypatch):
    """Store.open(progress=) is called once the records are read (0, total), every
    RECOVERY_STEP blocks and once at the end, with (done, total); not at all for a store with
    nothing on NVMe. (The first report came RECOVERY_STEP blocks in: 8,192, seconds of
    silence on a slow disk.)"""
    from kvstore import StoreConfig
    from kvstore import store as store_mod

    SPEC = crash_child.SPEC
    monkeypatch.setattr(store_mod, "RECOVERY_STEP", 2)
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=0, dram_bytes=0, nvme_bytes=1 << 20, master_key=bytes(32))
    calls: list[tuple[int, int]] = []
    Store.open(cfg, progress=lambda d, t: calls.append((d, t))).close()
    assert calls == []
    s = Store.open(cfg)
    s.put("a", SPEC, s.block_keys("a", SPEC, list(range(5 * SPEC.block_tokens))),
          torch.zeros((5, *SPEC.block_shape), dtype=SPEC.torch_dtype))
    s.close()
    s = Store.open(cfg, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(0, 5), (2, 5), (4, 5), (5, 5)]
    assert s.lookup("a", SPEC, s.block_keys("a", SPEC, list(range(5 * SPEC.block_tokens)))).num_blocks == 5
    s.close()


def test_flush_and_close_report_progress_and_close_says_how_many_it_committed(tmp_path, monkeypatch):
    from kvstore import StoreConfig
    from kvstore import store as store_mod

    SPEC = crash_child.SPEC
    monkeypatch.setattr(store_mod, "FLUSH_STEP", 2)
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=8 * SPEC.block_nbytes, dram_bytes=0,
                      nvme_bytes=1 << 20, master_key=bytes(32))
    s = Store.open(cfg)
    keys = s.block_keys("a", SPEC, list(range(5 * SPEC.block_tokens)))
    s.put("a", SPEC, keys, torch.zeros((5, *SPEC.block_shape), dtype=SPEC.torch_dtype))
    calls: list[tuple[int, int]] = []
    assert s.close(progress=lambda d, t: calls.append((d, t))) == 5
    assert calls == [(0, 5), (2, 5), (4, 5), (5, 5)]  # (0, total) first: the total at once
    assert s.close() == 0  # closed already
    s = Store.open(cfg)
    assert s.lookup("a", SPEC, keys).tiers == ["nvme"] * 5
    calls.clear()
    assert s.flush(progress=lambda d, t: calls.append((d, t))) == 0 and calls == []
    s.close()
