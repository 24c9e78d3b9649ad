"""A two-phase put (Store.reserve_put / commit_put: the server's Put and PutLocal) whose own
blocks were all stored, but whose NVMe commit failed for other blocks it pushed down to make
room, succeeds, as Store.put does: the lost blocks are dropped and counted, the failure logged.
Before, commit_put raised NVMeWriteFailed and the server answered RESOURCE_EXHAUSTED (counted
as a failed Put and an "nvme disk" limit rejection) for a put whose blocks were stored and pinned.

The disk fault is injected as in test_store_disk_full.py: the next LMDB commit fails."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from conftest import make_kv, tokens
from disk_faults import failing
from prometheus_client import generate_latest
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore import service_data
from kvstore.errors import NVMeWriteFailed
from kvstore.keys import KEY_BYTES


def _roots(n: int, tag: str) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/page-{i}".encode(), digest_size=KEY_BYTES).digest() for i in range(n)]


def _rows(kv: torch.Tensor) -> list:
    return [row.view(torch.uint8).flatten().numpy() for row in kv]


def test_commit_put_of_roots_succeeds_when_only_a_demotion_fails(open_store, spec, caplog):
    """HBM holds two blocks; a reserved put of two roots makes room at its commit by demoting
    them to NVMe, whose commit fails: the roots are stored in HBM, the demoted blocks are gone."""
    s = open_store(spec, hbm_blocks=2, dram_blocks=0, nvme_blocks=16)
    old = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, old, make_kv(spec, 2))
    keys = _roots(2, "commit")
    kv = make_kv(spec, 2, seed=4)
    res = s.reserve_put("a", spec, keys, roots=True)
    failing(s).failures = 1
    with caplog.at_level("WARNING", logger="kvstore.store"):
        s.commit_put(res, _rows(kv).__getitem__)  # raised NVMeWriteFailed

    assert "put stored its 2 blocks, but the NVMe tier could not commit" in caplog.text
    assert s.stats()["counters"]["nvme_commit_failures"] == 1
    assert s.lookup_roots("a", spec, keys) == ["hbm", "hbm"]
    outs = [torch.zeros_like(kv[0]) for _ in keys]
    assert s.get_roots_into("a", spec, keys, outs) == [True, True]
    assert all(torch.equal(o, k) for o, k in zip(outs, kv))
    assert s.lookup("a", spec, old).num_blocks == 0  # not announced: not on disk


def test_commit_put_of_a_session_succeeds_when_only_a_demotion_fails(open_store, spec, caplog):
    """A session put continuing a stored block (committed by the ordinary put of the chain) whose
    commit demotes another tenant's blocks to NVMe, and that commit fails: the put's blocks stay
    stored and pinned, and the put returns."""
    s = open_store(spec, hbm_blocks=2, dram_blocks=0, nvme_blocks=16)
    s.put("b", spec, s.block_keys("b", spec, tokens(1, spec)), make_kv(spec, 1))
    keys = s.block_keys("a", spec, tokens(2, spec, start=100))
    kv = make_kv(spec, 2, seed=5)
    s.put("a", spec, keys[:1], kv[:1])
    s.open_session("a", "s1")
    res = s.reserve_put("a", spec, keys, session="s1")
    failing(s).failures = 1
    with caplog.at_level("WARNING", logger="kvstore.store"):
        s.commit_put(res, _rows(kv).__getitem__)

    assert "put stored its 2 blocks, but" in caplog.text
    assert s.lookup("a", spec, keys).tiers == ["hbm", "hbm"]
    assert torch.equal(s.get("a", spec, keys), kv)
    assert s.session_info("a", "s1").pinned_blocks == 2


def test_commit_put_still_fails_when_its_own_blocks_were_not_stored(open_store, spec):
    """The other side of the rule: blocks of the put bound for NVMe (no memory tier) that the
    failed commit did not store fail the put, and none of them is announced."""
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=16)
    keys = s.block_keys("a", spec, tokens(2, spec))
    res = s.reserve_put("a", spec, keys)
    failing(s).failures = 1
    with pytest.raises(NVMeWriteFailed):
        s.commit_put(res, _rows(make_kv(spec, 2)).__getitem__)
    assert s.lookup("a", spec, keys).num_blocks == 0


@pytest.mark.parametrize("local", [False, True], ids=["Put", "PutLocal"])
def test_server_put_whose_blocks_are_stored_answers_ok_when_a_demotion_fails(tmp_path: Path, monkeypatch,
                                                                              local: bool):
    nb = SPEC.block_nbytes
    sc = start(tmp_path, store={"hbm_bytes": 2 * nb, "dram_bytes": 2 * nb, "nvme_bytes": 64 * nb,
                                "high_watermark": 1.0, "low_watermark": 1.0})
    try:
        b, a = sc.tenant("b", local=False), sc.tenant("a", local=local)
        b.put(SPEC, b.block_keys(SPEC, fresh_tokens(3)), random_kv(3))  # fills HBM and DRAM
        keys = a.block_keys(SPEC, fresh_tokens(2))
        kv = random_kv(2, seed=7)
        a.put(SPEC, keys[:1], kv[:1])
        a.open_session("s1")
        env = failing(sc.server.store)
        real = service_data.DataPlane.reserve_put

        def reserve_then_fail(plane, *args, **kw):  # the commit's NVMe transaction fails
            res = real(plane, *args, **kw)
            env.failures = 1
            return res

        monkeypatch.setattr(service_data.DataPlane, "reserve_put", reserve_then_fail)
        a.put(SPEC, keys, kv, session="s1")  # raised ResourceExhausted

        assert env.failures == 0  # the commit did fail
        assert a.lookup(SPEC, keys).num_blocks == 2
        assert torch.equal(a.get(SPEC, keys), kv)
        text = generate_latest(sc.server.metrics_registry).decode()
        assert 'code="RESOURCE_EXHAUSTED"' not in text
        assert 'kvstore_limit_rejections_total{resource="nvme disk"}' not in text
    finally:
        sc.stop()


def test_a_commit_that_fails_inside_commit_puts_batch_is_counted_once(open_store, spec):
    """A reserved put with no slot (an NVMe-only store) is committed by the ordinary put inside
    commit_put's batch; that put's pipelined commit failing was counted by the inner batch and
    again by the outer one (nvme_commit_failures +2 for one failed commit)."""
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=64)
    s._nvme._commit_bytes = 2 * spec.block_nbytes  # a pipelined commit every two blocks
    keys = s.block_keys("a", spec, tokens(8, spec))
    res = s.reserve_put("a", spec, keys)
    failing(s).failures = 1
    with pytest.raises(NVMeWriteFailed):
        s.commit_put(res, _rows(make_kv(spec, 8)).__getitem__)
    assert s.stats()["counters"]["nvme_commit_failures"] == 1
    assert s.lookup("a", spec, keys).num_blocks == 0
