"""An NVMe commit that fails (a full disk, an I/O error): the call fails with NVMeWriteFailed
(RESOURCE_EXHAUSTED), and nothing the commit did not store is announced by a lookup — before,
LMDB's raw error escaped and the index kept blocks that were not on disk (lookup hit, get miss).

The failure is injected: the tier's LMDB environment is wrapped so that the next write
transactions fail to commit, as ``mdb_txn_commit`` does on a full disk (checked by hand on a
16 MiB tmpfs: ``mdb_txn_commit: Input/output error``)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_kv, tokens
from disk_faults import FailingEnv, FailingTxn, failing

from kvstore.errors import NVMeWriteFailed, ResourceExhausted


def test_a_put_whose_commit_fails_stores_and_announces_nothing(open_store, spec, tmp_path):
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=64)
    before = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, before, make_kv(spec, 2))
    env = failing(s)
    keys = s.block_keys("a", spec, tokens(3, spec, start=100))
    used = s.stats()["tiers"]["nvme"]["used_bytes"]
    env.failures = 1
    with pytest.raises(NVMeWriteFailed, match="could not commit") as err:
        s.put("a", spec, keys, make_kv(spec, 3))
    assert isinstance(err.value, ResourceExhausted) and err.value.code == "RESOURCE_EXHAUSTED"
    assert s.lookup("a", spec, keys).num_blocks == 0
    assert s.stats()["tiers"]["nvme"]["used_bytes"] == used
    assert s.stats()["counters"]["nvme_write_failures"] == 1
    # the store goes on: the same put succeeds once commits do, and everything survives a reopen
    kv = make_kv(spec, 3, seed=4)
    s.put("a", spec, keys, kv)
    assert torch.equal(s.get("a", spec, keys), kv)
    s.close()
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=64)
    assert s.lookup("a", spec, before + keys).num_blocks == 2  # a different chain after 2
    assert s.lookup("a", spec, keys).num_blocks == 3


def test_a_failed_pipelined_commit_leaves_no_part_of_the_put(open_store, spec, monkeypatch):
    """A put of many NVMe-bound blocks commits every few MiB; when a later commit fails, the
    blocks of the earlier commits are rolled back with the rest, on disk too."""
    from tiers import nvme as nvme_mod

    monkeypatch.setattr(nvme_mod, "PIPELINE_COMMIT_BYTES", 2 * spec.block_nbytes)
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=64)
    s._nvme._commit_bytes = 2 * spec.block_nbytes
    env = failing(s)
    keys = s.block_keys("a", spec, tokens(8, spec))
    env.failures = 1
    real_commit = FailingTxn.commit
    commits = []

    def second_fails(self: FailingTxn) -> None:  # let the first commit of the put through
        commits.append(1)
        if len(commits) == 1:
            self._txn.commit()
            return
        real_commit(self)

    monkeypatch.setattr(FailingTxn, "commit", second_fails)
    with pytest.raises(NVMeWriteFailed):
        s.put("a", spec, keys, make_kv(spec, 8))
    assert len(commits) >= 2
    assert s.lookup("a", spec, keys).num_blocks == 0 and s.stats()["blocks"] == 0
    s.close()
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=64)
    assert s.stats()["blocks"] == 0  # the first commit's blocks were deleted again


def test_a_failed_flush_keeps_the_memory_blocks_without_an_nvme_copy(open_store, spec):
    s = open_store(spec, hbm_blocks=4, dram_blocks=0, nvme_blocks=16)
    keys = s.block_keys("a", spec, tokens(3, spec))
    kv = make_kv(spec, 3)
    s.put("a", spec, keys, kv)
    env = failing(s)
    env.failures = 1
    with pytest.raises(NVMeWriteFailed):
        s.flush()
    assert s.lookup("a", spec, keys).tiers == ["hbm"] * 3
    assert s.stats()["tiers"]["nvme"]["used_bytes"] == 0
    assert all(not m.persisted for m in s._index)
    assert torch.equal(s.get("a", spec, keys), kv)
    assert s.flush() == 3  # commits work again
    s.close()
    s = open_store(spec, hbm_blocks=4, dram_blocks=0, nvme_blocks=16)
    assert torch.equal(s.get("a", spec, keys), kv)


def test_a_tenant_key_that_cannot_be_stored_or_destroyed_fails_the_call_by_name(open_store, spec):
    """The keyring's own LMDB (tenant data keys): a new tenant's first put, or the destruction
    of a deleted tenant's key, that cannot commit fails with NVMeWriteFailed saying which,
    not an INTERNAL error (a tenant deletion that silently kept the key would keep its data
    readable)."""
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16)
    backend = s.keyring._backend
    env = FailingEnv(backend._env)
    backend._env = env
    env.failures = 1
    with pytest.raises(NVMeWriteFailed, match="store tenant 'new'.s data key"):
        s.put("new", spec, s.block_keys("new", spec, tokens(1, spec)), make_kv(spec, 1))
    s.put("old", spec, s.block_keys("old", spec, tokens(1, spec)), make_kv(spec, 1))
    env.failures = 1
    with pytest.raises(NVMeWriteFailed, match="destroy tenant 'old'.s data key"):
        s.drop_tenant("old")


def test_a_disk_smaller_than_nvme_bytes_is_warned_of_at_open(open_store, spec, tmp_path, monkeypatch, caplog):
    from collections import namedtuple

    from tiers import nvme as nvme_mod

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(nvme_mod.shutil, "disk_usage", lambda p: usage(1 << 30, 0, 1 << 30))
    assert open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=64, path=tmp_path / "a").disk_warning is None
    monkeypatch.setattr(nvme_mod.shutil, "disk_usage", lambda p: usage(1 << 30, 0, 3 * 1024))
    with caplog.at_level("WARNING", logger="kvstore.store"):
        s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=64, path=tmp_path / "b")
    assert s.disk_warning is not None and "can take only" in s.disk_warning
    assert "lower nvme_bytes or free space" in caplog.text


def test_a_paused_sessions_block_is_not_lost_to_a_commit_that_fails(open_store, spec):
    """A paused session's blocks are kept: one demoted to NVMe is committed before its memory
    copy is freed, so when that commit fails it stays in DRAM (the call that demoted it fails)
    and the session resumes whole. Found by the state machine: the block was dropped."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=3, nvme_blocks=6)
    s.open_session("a", "chat")
    mine = s.block_keys("a", spec, tokens(2, spec))
    kv = make_kv(spec, 2)
    s.put("a", spec, mine, kv, session="chat")
    s.pause_session("a", "chat")
    assert s.lookup("a", spec, mine).tiers == ["dram", "dram"]
    env = failing(s)
    # a chain sharing the session's first block: its new block goes to DRAM, whose high
    # watermark demotes the session's leaf to NVMe
    other = s.block_keys("a", spec, tokens(1, spec) + tokens(1, spec, start=50))
    assert other[0] == mine[0]
    env.failures = 1
    with pytest.raises(NVMeWriteFailed):
        s.put("a", spec, other, make_kv(spec, 2, seed=3))
    assert s.lookup("a", spec, mine).tiers == ["dram", "dram"]
    s.resume_session("a", "chat")
    assert s.lookup("a", spec, mine).tiers == ["hbm", "hbm"]
    assert torch.equal(s.get("a", spec, mine), kv)
    assert s.stats()["counters"]["nvme_commit_failures"] == 1


def test_a_close_whose_commit_fails_still_closes_and_says_so(open_store, spec, tmp_path):
    """persist_on_close on a full disk: the memory blocks cannot be committed, the store
    closes anyway (its directory free for the next open) and then raises the failure."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=0, nvme_blocks=16, path=tmp_path / "c")
    kept = s.block_keys("a", spec, tokens(1, spec))
    s.put("a", spec, kept, make_kv(spec, 1))
    s.flush()
    s.put("a", spec, s.block_keys("a", spec, tokens(2, spec, start=40)), make_kv(spec, 2))
    failing(s).failures = 1
    with pytest.raises(NVMeWriteFailed):
        s.close()
    assert s.close() == 0  # closed
    again = open_store(spec, hbm_blocks=4, dram_blocks=0, nvme_blocks=16, path=tmp_path / "c")
    assert again.lookup("a", spec, kept).tiers == ["nvme"] and again.stats()["blocks"] == 1


def test_a_put_whose_blocks_are_stored_succeeds_when_only_a_demotion_fails(open_store, spec, caplog):
    """The commit that fails may hold only other blocks the put pushed down to NVMe: those are
    dropped (lookup no longer announces them) and counted, but the put's own blocks are in HBM,
    so the put returns (an engine told it failed would recompute them for nothing)."""
    s = open_store(spec, hbm_blocks=2, dram_blocks=0, nvme_blocks=16)
    old = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, old, make_kv(spec, 2))
    env = failing(s)
    env.failures = 1
    new = s.block_keys("a", spec, tokens(2, spec, start=100))
    kv = make_kv(spec, 2, seed=5)
    with caplog.at_level("WARNING", logger="kvstore.store"):
        s.put("a", spec, new, kv)  # makes room by demoting `old` to NVMe, whose commit fails
    assert "put stored its 2 blocks, but the NVMe tier could not commit" in caplog.text
    assert s.stats()["counters"]["nvme_commit_failures"] == 1
    assert s.lookup("a", spec, new).tiers == ["hbm", "hbm"]
    assert torch.equal(s.get("a", spec, new), kv)
    assert s.lookup("a", spec, old).num_blocks == 0  # not announced: it is not on disk
    assert s.get("a", spec, old).shape[0] == 0


def test_a_get_that_served_its_blocks_returns_them_when_only_a_demotion_fails(open_store, spec):
    """A get promotes NVMe hits into HBM, pushing others down; when that commit fails the blocks
    already copied out are still the caller's: get returns them (and the others are dropped)."""
    s = open_store(spec, hbm_blocks=2, dram_blocks=0, nvme_blocks=16)
    first = s.block_keys("a", spec, tokens(2, spec))
    kv = make_kv(spec, 2)
    s.put("a", spec, first, kv)
    second = s.block_keys("a", spec, tokens(2, spec, start=100))
    s.put("a", spec, second, make_kv(spec, 2, seed=2))  # `first` goes down to NVMe
    assert s.lookup("a", spec, first).tiers == ["nvme", "nvme"]
    failing(s).failures = 1
    out = torch.empty_like(kv)
    assert s.get_into("a", spec, first, list(out)) == 2  # promotes `first`, demotes `second`
    assert torch.equal(out, kv)
    assert s.stats()["counters"]["nvme_commit_failures"] == 1
    assert s.lookup("a", spec, second).num_blocks == 0


def test_a_deletion_that_cannot_be_committed_is_made_with_the_next_write(open_store, spec, tmp_path):
    """Delete on a full disk: the blocks leave the index at once and the call says their NVMe
    copies are still on disk; the next commit that succeeds deletes them, so a restart does not
    bring them back (before, nothing retried them: every deleted block returned at the next start)."""
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16, path=tmp_path / "d")
    gone = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, gone, make_kv(spec, 2))
    env = failing(s)
    env.failures = 1
    with pytest.raises(NVMeWriteFailed, match="2 deleted blocks are still on disk"):
        s.delete("a", gone)
    assert s.lookup("a", spec, gone).num_blocks == 0
    assert s.stats()["tiers"]["nvme"]["deletions_pending"] == 2
    kept = s.block_keys("a", spec, tokens(1, spec, start=60))
    s.put("a", spec, kept, make_kv(spec, 1))  # commits, and with it the deletion
    assert s.stats()["tiers"]["nvme"]["deletions_pending"] == 0
    s.close()
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16, path=tmp_path / "d")
    assert s.lookup("a", spec, gone).num_blocks == 0 and s.stats()["blocks"] == 1


def test_a_pending_deletion_is_made_at_close_and_never_removes_a_block_put_again(open_store, spec, tmp_path):
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16, path=tmp_path / "e")
    gone = s.block_keys("a", spec, tokens(1, spec))
    again = s.block_keys("a", spec, tokens(2, spec, start=30))
    s.put("a", spec, gone, make_kv(spec, 1))
    s.put("a", spec, again, make_kv(spec, 2))
    env = failing(s)
    env.failures = 2
    with pytest.raises(NVMeWriteFailed):
        s.delete("a", gone + again)
    kv = make_kv(spec, 2, seed=9)
    with pytest.raises(NVMeWriteFailed):  # the put after fails too: the deletions stay pending
        s.put("a", spec, again, kv)
    assert s.stats()["tiers"]["nvme"]["deletions_pending"] == 3
    s.put("a", spec, again, kv)  # this commit makes the deletions first, then stores `again`
    env.failures = 1
    with pytest.raises(NVMeWriteFailed):
        s.delete("a", gone)  # not stored: nothing to delete, but the commit fails
    assert s.stats()["tiers"]["nvme"]["deletions_pending"] == 0
    with pytest.raises(NVMeWriteFailed):
        env.failures = 1
        s.delete("a", again[1:])
    assert s.stats()["tiers"]["nvme"]["deletions_pending"] == 1
    s.close()  # its last try makes it
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16, path=tmp_path / "e")
    assert s.lookup("a", spec, gone).num_blocks == 0
    assert s.lookup("a", spec, again).num_blocks == 1
    assert torch.equal(s.get("a", spec, again[:1]), kv[:1])
