"""The pipelined NVMe write path: values encoded ahead on a background thread while the owner
thread stores them, with durable commits every few MiB inside one Store call.

Held to: bit-exact read-back (quantized values too), errors surfacing on the caller's thread,
no job left reading a caller's buffer after the call, values written without the memory map
still read with it, and kill -9 in the middle of a pipelined call losing nothing acknowledged.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.config import StoreConfig
from kvstore.quantization import Quantization
from kvstore.spec import ModelSpec
from kvstore.store import Store
from tiers.base import BlockRef
from tiers.nvme import NVMeTier
from tiers.nvme_ahead import AheadJob, BufferPool, EncodeAhead

MASTER = bytes(range(32))
SPEC = ModelSpec(model="pipe", revision="r", num_layers=2, num_kv_heads=2, head_dim=64,
                 dtype="float16", block_tokens=16)


def _kv(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *SPEC.block_shape), generator=g).to(torch.float16)


def _tokens(n: int, base: int) -> list[int]:
    return list(range(base, base + n * SPEC.block_tokens))


def _nvme_store(path: Path, **kw) -> Store:
    return Store.open(StoreConfig(path=path, hbm_bytes=0, dram_bytes=0,
                                  nvme_bytes=4000 * SPEC.block_nbytes, device="cpu",
                                  master_key=MASTER, persist_on_close=False, **kw))


@pytest.fixture
def small_commits(monkeypatch):
    """Every pipelined put_record commits (the smallest possible step)."""
    monkeypatch.setattr("tiers.nvme.PIPELINE_COMMIT_BYTES", 1)


def _commits(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = NVMeTier._commit_step

    def counting(self: NVMeTier) -> None:
        calls.append(1)
        real(self)

    monkeypatch.setattr(NVMeTier, "_commit_step", counting)
    return calls


@pytest.mark.parametrize("level", [1, 0])
@pytest.mark.parametrize("encrypt", [True, False])
def test_pipelined_put_reads_back_bit_exact(tmp_path, small_commits, monkeypatch, level, encrypt):
    commits = _commits(monkeypatch)
    kv = _kv(12, seed=1)
    with _nvme_store(tmp_path / "s", compression_level=level, encrypt=encrypt) as s:
        keys = s.block_keys("t", SPEC, _tokens(12, 0))
        s.put("t", SPEC, keys, kv)
        assert len(commits) == 12  # one durable commit per value at this threshold
        got = s.get("t", SPEC, keys)
        assert torch.equal(got.view(torch.int16), kv.view(torch.int16))
    with _nvme_store(tmp_path / "s", compression_level=level, encrypt=encrypt) as s:  # reopen
        assert torch.equal(s.get("t", SPEC, keys).view(torch.int16), kv.view(torch.int16))


def test_put_continuing_a_chain_and_existing_blocks(tmp_path, small_commits):
    """A put that re-sends stored blocks (not re-encoded) and continues a chain via parent=."""
    kv = _kv(8, seed=2)
    with _nvme_store(tmp_path / "s") as s:
        keys = s.block_keys("t", SPEC, _tokens(8, 0))
        s.put("t", SPEC, keys[:3], kv[:3])
        s.put("t", SPEC, keys[:6], kv[:6])  # 3 stored, 3 new
        s.put("t", SPEC, keys[6:], kv[6:], parent=keys[5])
        assert s.stats()["counters"]["blocks_put"] == 8
        assert torch.equal(s.get("t", SPEC, keys).view(torch.int16), kv.view(torch.int16))


def test_pipelined_put_of_quantized_blocks(tmp_path, small_commits):
    kv = _kv(6, seed=3)
    with _nvme_store(tmp_path / "s") as s:
        s.set_tenant_policy("lossy", quantization="int8")
        keys = s.block_keys("lossy", SPEC, _tokens(6, 0))
        s.put("lossy", SPEC, keys, kv)
        got = s.get("lossy", SPEC, keys)
        assert got.shape[0] == 6
        assert not torch.equal(got.view(torch.int16), kv.view(torch.int16))  # lossy indeed
        assert torch.allclose(got.float(), kv.float(), atol=0.1)


def test_pipelined_flush_commits_dram_blocks(tmp_path, small_commits, monkeypatch):
    commits = _commits(monkeypatch)
    kv = _kv(10, seed=4)
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=0, dram_bytes=40 * SPEC.block_nbytes,
                      nvme_bytes=40 * SPEC.block_nbytes, device="cpu", master_key=MASTER,
                      persist_on_close=False)
    kv_u = _kv(4, seed=6)
    with Store.open(cfg) as s:
        keys = s.block_keys("t", SPEC, _tokens(10, 0))
        keys_u = s.block_keys("u", SPEC, _tokens(4, 0))  # a second tenant, same tokens
        s.put("t", SPEC, keys, kv)
        s.put("u", SPEC, keys_u, kv_u)
        assert s.lookup("t", SPEC, keys).tiers == ["dram"] * 10
        assert commits == []  # nothing bound for NVMe: no encode-ahead, no extra commits
        assert s.flush() == 14
        assert len(commits) == 14
    with Store.open(cfg) as s:
        assert s.lookup("t", SPEC, keys).tiers == ["nvme"] * 10
        assert torch.equal(s.get("t", SPEC, keys).view(torch.int16), kv.view(torch.int16))
        assert torch.equal(s.get("u", SPEC, keys_u).view(torch.int16), kv_u.view(torch.int16))


def test_values_written_without_writemap_read_with_it(tmp_path):
    ref = BlockRef("t", b"k" * 32, SPEC)
    data = _kv(1, seed=5).view(torch.uint8).reshape(-1).numpy()
    for writemap in (False, True):
        tier = NVMeTier(tmp_path / "n", 10 * SPEC.block_nbytes, writemap=writemap)
        from kvstore.codec import Codec, CodecConfig

        tier.codec = Codec(CodecConfig(encrypt=False), None)
        list(tier.records())
        if not writemap:
            assert tier.put(ref, data)
        out = np.empty(SPEC.block_nbytes, np.uint8)
        assert tier.get_into(ref, out) and np.array_equal(out, data)
        tier.close()


# -- EncodeAhead itself -------------------------------------------------------------------------
def _ref(i: int) -> BlockRef:
    return BlockRef("t", bytes([i]) * 32, SPEC)


def _encoder(seen: list[int], fail: int | None = None, gate: threading.Event | None = None):
    def encode(ref, data, quant, out):
        if gate is not None:
            gate.wait(5)
        if ref.key[0] == fail:
            raise ValueError("boom")
        seen.append(ref.key[0])
        out[: data.size] = data
        return int(data.size)

    return encode


def _ahead(jobs, encode, depth=2):
    ex = ThreadPoolExecutor(1)
    return ex, EncodeAhead(ex, encode, BufferPool(keep=2), lambda ref: 64, jobs, depth=depth)


def test_ahead_serves_only_the_announced_job():
    srcs = [np.full(16, i, np.uint8) for i in range(4)]
    seen: list[int] = []
    ex, ahead = _ahead([AheadJob(_ref(i), srcs[i], None) for i in range(4)], _encoder(seen))
    try:
        buf, n = ahead.take(_ref(0), srcs[0], None)
        assert n == 16 and np.array_equal(buf[:n], srcs[0])
        ahead.release(buf)
        assert ahead.take(_ref(1), srcs[2], None) is None  # another source buffer
        assert ahead.take(_ref(2), srcs[2], Quantization("int8", "channel")) is None  # format
        assert ahead.take(_ref(9), srcs[0], None) is None  # never announced
        got = ahead.take(_ref(3), srcs[3], None)
        assert got is not None and np.array_equal(got[0][:16], srcs[3])
    finally:
        ahead.close()
        ex.shutdown()


def test_ahead_reraises_encoding_errors_on_take():
    srcs = [np.zeros(8, np.uint8) for _ in range(2)]
    ex, ahead = _ahead([AheadJob(_ref(i), srcs[i], None) for i in range(2)], _encoder([], fail=1))
    try:
        assert ahead.take(_ref(0), srcs[0], None) is not None
        with pytest.raises(ValueError, match="boom"):
            ahead.take(_ref(1), srcs[1], None)
    finally:
        ahead.close()
        ex.shutdown()


def test_ahead_close_waits_for_running_jobs_and_drops_the_rest():
    gate = threading.Event()
    seen: list[int] = []
    srcs = [np.zeros(8, np.uint8) for _ in range(5)]
    ex, ahead = _ahead([AheadJob(_ref(i), srcs[i], None) for i in range(5)],
                       _encoder(seen, gate=gate), depth=2)
    threading.Timer(0.2, gate.set).start()
    t0 = time.perf_counter()
    ahead.close()  # job 0 is running (blocked on the gate), job 1 queued: cancelled
    assert time.perf_counter() - t0 >= 0.15
    ex.shutdown(wait=True)
    assert seen == [0]  # nothing read a source after close, nothing beyond the depth started


# -- kill -9 in the middle of pipelined, multi-commit puts -----------------------------------
CHILD = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    import tiers.nvme
    tiers.nvme.PIPELINE_COMMIT_BYTES = 1
    sys.path.insert(0, {tests!r})
    from test_nvme_pipeline import _kv, _nvme_store, _tokens, SPEC
    store = _nvme_store(Path(sys.argv[1]))
    print("ready", flush=True)
    i = int(sys.argv[2])
    for _ in range(100):  # 6 children x 100 chains x 6 blocks: the tier never evicts
        store.put("t", SPEC, store.block_keys("t", SPEC, _tokens(6, i << 16)), _kv(6, i))
        print(f"ack {{i}}", flush=True)
        i += 1
    import time
    time.sleep(60)
""")


def test_kill_9_inside_pipelined_puts_loses_nothing_acknowledged(tmp_path):
    rng = random.Random(11)
    path = tmp_path / "s"
    script = CHILD.format(tests=str(Path(__file__).parent))
    acked: set[int] = set()
    start = 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", script, str(path), str(start)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else line
        time.sleep(rng.uniform(0.05, 0.5))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        new = [int(x.split()[1]) for x in out.splitlines() if x.startswith("ack ")]
        acked.update(new)
        start = max([start - 1, *new]) + 2  # skip the chain that was in flight
    with _nvme_store(path) as s:
        for i in range(start):
            keys = s.block_keys("t", SPEC, _tokens(6, i << 16))
            got = s.get("t", SPEC, keys)
            assert torch.equal(got.view(torch.int16), _kv(6, i)[: got.shape[0]].view(torch.int16))
            if i in acked:
                assert got.shape[0] == 6, f"acknowledged chain {i} lost"
        assert s.stats()["integrity_failures"] == 0
        assert s.stats()["evictions"] == 0  # a block missing here was lost, not evicted
    assert acked, "the child never acknowledged a put: the test proved nothing"
