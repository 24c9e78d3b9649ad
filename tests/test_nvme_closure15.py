"""Invariant 6 under a hot prefix: the blocks committed to NVMe are closed under parents.

Recovery rebuilds the index from NVMe and drops every block whose parent is not there (it can
never be part of a usable prefix). A block written to NVMe while an ancestor lived in HBM or
DRAM without an NVMe copy was committed and still lost at the next crash: a system prompt kept
hot in HBM while leaf-first eviction demoted every conversation's tail to NVMe lost all of them
(``recovered 0 blocks from NVMe (dropped 490 orphans_dropped)``). So an ancestor gets its NVMe
copy before its descendant is written there, and an ancestor's copy is not evicted while a
descendant is on NVMe.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import MASTER
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import crash_child

from kvstore.block import Tier
from kvstore.config import StoreConfig
from kvstore.errors import ResourceExhausted
from kvstore.keys import ROOT_KEY
from kvstore.spec import ModelSpec
from kvstore.store import Store

SPEC = ModelSpec(model="closure", revision="r", num_layers=2, num_kv_heads=2, head_dim=16,
                 dtype="float16", block_tokens=2)
N = SPEC.block_nbytes
PREFIX = 2  # blocks of the shared prompt


def tokens(prefix: int, conv: int, own: int) -> list[int]:
    """A conversation: prompt ``prefix`` (PREFIX blocks shared by every conversation under it),
    then ``own`` blocks of its own."""
    toks = [1000 * prefix + j for j in range(PREFIX * SPEC.block_tokens)]
    return toks + [100_000 + 1000 * conv + j for j in range(own * SPEC.block_tokens)]


def values(tenant: str, keys: list[bytes]) -> torch.Tensor:
    """Content is a pure function of (tenant, key), as content keys promise."""
    out = []
    for k in keys:
        g = torch.Generator().manual_seed(int.from_bytes(k[:4], "little") ^ len(tenant))
        out.append(torch.randn(SPEC.block_shape, generator=g).to(SPEC.torch_dtype))
    return torch.stack(out)


def assert_closed(store: Store) -> None:
    """Every block committed to NVMe (on disk: what a crash leaves) has its parent there too,
    and so does every indexed block that lives in NVMe or keeps an NVMe copy."""
    assert store._nvme is not None
    on_disk = {(r.tenant, r.key): r for r, _ in store._nvme._read_records()}
    for (tenant, _key), rec in on_disk.items():
        closed = rec.parent == ROOT_KEY or (tenant, rec.parent) in on_disk
        assert closed, f"a committed block of depth {rec.depth} whose parent has no NVMe copy"
    for m in store._index:
        if m.tier == Tier.NVME or m.persisted:
            assert (m.tenant, m.key) in on_disk
            p = store._index.get(m.tenant, m.parent)
            assert m.parent == ROOT_KEY or (p is not None and (p.tier == Tier.NVME or p.persisted))


def test_tails_demoted_under_a_hot_prefix_survive_a_restart_without_a_flush(tmp_path):
    """The repro, in-process: the prompt stays in HBM (each new conversation lands there next to
    it), the older tails go down to NVMe; the store closes without committing memory blocks
    (persist_on_close=false: what a crash leaves), and every demoted conversation comes back."""
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=8 * N, dram_bytes=8 * N, nvme_bytes=400 * N,
                      master_key=MASTER, persist_on_close=False, policy="lru")  # every victim demoted
    store = Store.open(cfg)
    chains = []
    for i in range(30):
        keys = store.block_keys("t", SPEC, tokens(0, i, 3))
        store.put("t", SPEC, keys, values("t", keys))
        chains.append(keys)
        assert_closed(store)
    assert store.lookup("t", SPEC, chains[-1]).tiers[:PREFIX] == ["hbm"] * PREFIX  # the hot prefix
    demoted = [i for i, keys in enumerate(chains) if store.lookup("t", SPEC, keys).tiers[-1] == "nvme"]
    assert len(demoted) >= 20
    store.close()

    store = Store.open(cfg)
    try:
        assert store.counters.get("orphans_dropped") == 0
        for i in demoted:
            got = store.get("t", SPEC, chains[i])
            assert got.shape[0] == len(chains[i]), f"conversation {i} lost its committed blocks"
            assert torch.equal(got.view(torch.uint8), values("t", chains[i]).view(torch.uint8))
    finally:
        store.close()


def test_a_put_straight_to_nvme_under_a_prefix_in_memory_commits_the_prefix_first(tmp_path):
    """A chain continued (``parent=``) from a block in HBM, with HBM and DRAM full of pinned
    session blocks: its new blocks land in NVMe, and the prefix gets its NVMe copy first."""
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=4 * N, dram_bytes=0, nvme_bytes=100 * N,
                      master_key=MASTER, persist_on_close=False)
    store = Store.open(cfg)
    store.open_session("t", "s1")
    pinned = store.block_keys("t", SPEC, tokens(1, 1, 0))
    store.put("t", SPEC, pinned, values("t", pinned), session="s1")
    head = store.block_keys("t", SPEC, tokens(0, 0, 0))
    store.put("t", SPEC, head, values("t", head))  # HBM full now
    full = store.block_keys("t", SPEC, tokens(0, 0, 3))
    tail = full[PREFIX:]
    store.put("t", SPEC, tail, values("t", tail), parent=head[-1])
    assert store.lookup("t", SPEC, full).tiers == ["hbm"] * PREFIX + ["nvme"] * 3
    assert_closed(store)
    store.close()
    store = Store.open(cfg)
    try:
        assert store.counters.get("orphans_dropped") == 0
        assert torch.equal(store.get("t", SPEC, full).view(torch.uint8), values("t", full).view(torch.uint8))
    finally:
        store.close()


def test_no_nvme_quota_for_the_prefix_copies_means_no_room_for_the_tail(tmp_path):
    """A tenant whose NVMe quota cannot take the prompt's copies with a tail: the tail does not
    go to NVMe without them (it would be an orphan after a crash); it is dropped instead, as a
    block that finds no room below."""
    cfg = StoreConfig(path=tmp_path / "s", hbm_bytes=6 * N, dram_bytes=0, nvme_bytes=100 * N,
                      master_key=MASTER, persist_on_close=False, policy="lru")
    store = Store.open(cfg)
    store.set_tenant_policy("t", quota_bytes={"nvme": 1 * N})
    for i in range(6):
        keys = store.block_keys("t", SPEC, tokens(0, i, 2))
        store.put("t", SPEC, keys, values("t", keys))
        assert_closed(store)
    # no block lives in NVMe (the prompt's first block may keep a copy: closed all the same)
    assert not [m for m in store._index if m.tier == Tier.NVME]
    assert store.counters.get("evictions") > 0
    store.close()


OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "put", "get", "delete", "flush"]),
                         st.sampled_from(["a", "b"]), st.integers(0, 5), st.integers(1, 4)),
               min_size=1, max_size=40)


@pytest.mark.parametrize("policy", ["lru", "cost"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_the_committed_set_stays_closed_under_parents(policy, ops):
    """Random puts, gets, deletes and flushes of conversations under two prompts, with tiers
    small enough that NVMe evicts too (its copies of blocks living above included) and a tenant
    whose NVMe quota binds: after every call the NVMe tier holds no block without its parent."""
    with tempfile.TemporaryDirectory(prefix="kvclosure-") as d:
        store = Store.open(StoreConfig(path=Path(d), hbm_bytes=4 * N, dram_bytes=3 * N,
                                       nvme_bytes=10 * N, master_key=MASTER, policy=policy,
                                       persist_on_close=False))
        try:
            store.set_tenant_policy("b", quota_bytes={"nvme": 5 * N})
            for op, tenant, conv, n in ops:
                keys = store.block_keys(tenant, SPEC, tokens(conv % 2, conv, n))
                if op == "put":
                    try:
                        store.put(tenant, SPEC, keys, values(tenant, keys))
                    except ResourceExhausted:
                        pass
                elif op == "get":
                    got = store.get(tenant, SPEC, keys)
                    assert torch.equal(got.view(torch.uint8), values(tenant, keys)[: got.shape[0]].view(torch.uint8))
                elif op == "delete":
                    store.delete(tenant, keys[PREFIX + n // 2:])
                else:
                    store.flush()
                assert_closed(store)
        finally:
            store.close()


CHILD = Path(__file__).with_name("crash_child.py")


def test_kill_9_keeps_every_committed_conversation_under_a_hot_prefix(tmp_path):
    """A child process keeps a prompt hot in HBM while it puts conversations under it (their
    tails demoted to NVMe) and is killed with SIGKILL; the reopened store drops no orphan and
    serves every conversation that had gone down to NVMe, bit-exact. Three rounds: the prompt
    comes back from NVMe and is hot again each time."""
    path = tmp_path / "store"
    cfg = crash_child.config(path, "hot")
    in_memory = (cfg.hbm_bytes + cfg.dram_bytes) // crash_child.SPEC.block_nbytes  # the newest chains' blocks
    start = 0
    kept: set[int] = set()  # chains found whole after a kill: committed, found whole after every later one
    for _round in range(3):
        proc = subprocess.Popen([sys.executable, str(CHILD), str(path), "hot", str(start)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else line
        acked = []
        while len(acked) < 40:
            line = proc.stdout.readline()
            assert line.startswith("ack "), proc.stderr.read() if proc.stderr else line
            acked.append(int(line.split()[1]))
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        started = acked[-1] + 2  # the put in progress at the kill may have committed

        store = Store.open(cfg)
        try:
            assert store.counters.get("orphans_dropped") == 0
            for i in range(started):
                toks, kv = crash_child.chain(i)
                got = store.get("t", crash_child.SPEC, store.block_keys("t", crash_child.SPEC, toks))
                assert torch.equal(got.view(torch.uint8), kv[: got.shape[0]].view(torch.uint8)), i
                # acknowledged this round and older than every chain HBM and DRAM can hold
                if i in kept or start <= i < acked[-1] - in_memory:
                    assert got.shape[0] == kv.shape[0], f"committed conversation {i} lost"
                if got.shape[0] == kv.shape[0]:
                    kept.add(i)
        finally:
            store.close()
        start = started
