"""Two-phase puts (Store.reserve_put / commit_put / abort_put), which the in-band Put stream uses
to write chunks straight into tier slots: nothing visible before the commit, all or nothing,
every reserved byte given back, and the ordinary put's result when the chain changed meanwhile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_kv, tokens
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

T = "tenant-a"


def _rows(kv: torch.Tensor) -> np.ndarray:
    return kv.contiguous().view(torch.uint8).reshape(kv.shape[0], -1).numpy()


def _fill(res, rows: np.ndarray) -> dict[int, np.ndarray]:
    """Write each block into its slot; the blocks without one are returned (staged)."""
    staged = {}
    for i, view in enumerate(res.views):
        if view is None:
            staged[i] = rows[i].copy()
        else:
            view[:] = rows[i]
    return staged


def _used(store) -> dict[str, int]:
    return {t: v["used_bytes"] for t, v in store.stats()["tiers"].items()}


def _tenant_bytes(store) -> dict[str, int]:
    return store.stats()["tenants"].get(T, {})


def test_reserved_blocks_are_invisible_until_committed_then_bit_exact(open_store, spec):
    store = open_store(spec, hbm_blocks=4, dram_blocks=4)
    keys = store.block_keys(T, spec, tokens(3, spec))
    kv = make_kv(spec, 3, seed=1)
    res = store.reserve_put(T, spec, keys)
    assert all(v is not None for v in res.views)
    assert _used(store)["hbm"] == 3 * spec.block_nbytes  # the slots are taken ...
    staged = _fill(res, _rows(kv))
    assert store.lookup(T, spec, keys).num_blocks == 0  # ... but nothing is visible
    store.commit_put(res, staged.__getitem__)
    assert store.lookup(T, spec, keys).tiers == ["hbm"] * 3
    assert torch.equal(store.get(T, spec, keys).view(torch.int16), kv.view(torch.int16))
    assert _used(store)["hbm"] == 3 * spec.block_nbytes  # the slots became the blocks
    assert _tenant_bytes(store) == {"hbm": 3 * spec.block_nbytes}


def test_abort_gives_every_reserved_byte_back(open_store, spec):
    store = open_store(spec, hbm_blocks=4, dram_blocks=4)
    before, tenant_before = _used(store), _tenant_bytes(store)
    keys = store.block_keys(T, spec, tokens(3, spec))
    res = store.reserve_put(T, spec, keys)
    _fill(res, _rows(make_kv(spec, 3)))
    assert _tenant_bytes(store) == {"hbm": 3 * spec.block_nbytes}  # in-flight bytes count
    store.abort_put(res)
    store.abort_put(res)  # idempotent
    assert store.lookup(T, spec, keys).num_blocks == 0
    assert _used(store) == before
    assert {k: v for k, v in _tenant_bytes(store).items() if v} == tenant_before
    with pytest.raises(FailedPrecondition):
        store.commit_put(res, {}.__getitem__)


def test_reservation_spills_to_dram_and_stages_past_the_memory_tiers(open_store, spec):
    store = open_store(spec, hbm_blocks=2, dram_blocks=2, high_watermark=1.0, low_watermark=1.0)
    keys = store.block_keys(T, spec, tokens(6, spec))
    kv = make_kv(spec, 6, seed=2)
    res = store.reserve_put(T, spec, keys)
    assert [s[0].label if s else None for s in res.slots] == ["hbm", "hbm", "dram", "dram", None, None]
    staged = _fill(res, _rows(kv))
    assert sorted(staged) == [4, 5]
    store.commit_put(res, staged.__getitem__)
    assert store.lookup(T, spec, keys).num_blocks == 6
    assert torch.equal(store.get(T, spec, keys).view(torch.int16), kv.view(torch.int16))


def test_blocks_stored_meanwhile_fall_back_to_the_ordinary_put(open_store, spec):
    store = open_store(spec, hbm_blocks=8, dram_blocks=4)
    keys = store.block_keys(T, spec, tokens(3, spec))
    kv = make_kv(spec, 3, seed=3)
    res = store.reserve_put(T, spec, keys)
    staged = _fill(res, _rows(kv))
    store.put(T, spec, keys[:2], kv[:2])  # another writer stores a part of the chain first
    store.commit_put(res, staged.__getitem__)
    assert store.lookup(T, spec, keys).num_blocks == 3
    assert torch.equal(store.get(T, spec, keys).view(torch.int16), kv.view(torch.int16))
    assert _used(store)["hbm"] == 3 * spec.block_nbytes  # no reserved slot left behind
    assert _tenant_bytes(store) == {"hbm": 3 * spec.block_nbytes}


def test_already_stored_blocks_get_no_slot(open_store, spec):
    store = open_store(spec, hbm_blocks=8, dram_blocks=4)
    keys = store.block_keys(T, spec, tokens(3, spec))
    kv = make_kv(spec, 3, seed=4)
    store.put(T, spec, keys[:1], kv[:1])
    res = store.reserve_put(T, spec, keys)
    assert res.views[0] is None and res.views[1] is not None
    store.commit_put(res, _fill(res, _rows(kv)).__getitem__)
    assert torch.equal(store.get(T, spec, keys).view(torch.int16), kv.view(torch.int16))
    assert _used(store)["hbm"] == 3 * spec.block_nbytes


def test_a_parent_deleted_meanwhile_fails_the_commit_and_frees_the_slots(open_store, spec):
    store = open_store(spec, hbm_blocks=8, dram_blocks=4)
    keys = store.block_keys(T, spec, tokens(3, spec))
    kv = make_kv(spec, 3, seed=5)
    store.put(T, spec, keys[:1], kv[:1])
    res = store.reserve_put(T, spec, keys[1:], parent=keys[0])
    staged = _fill(res, _rows(kv[1:]))
    store.delete(T, keys[:1])
    with pytest.raises(NotFound):
        store.commit_put(res, staged.__getitem__)
    assert store.lookup(T, spec, keys[1:], parent=keys[0]).num_blocks == 0
    assert _used(store)["hbm"] == 0


def test_session_blocks_committed_from_slots_are_pinned(open_store, spec):
    store = open_store(spec, hbm_blocks=3, dram_blocks=4, high_watermark=1.0, low_watermark=1.0)
    store.open_session(T, "s1")
    keys = store.block_keys(T, spec, tokens(3, spec))
    res = store.reserve_put(T, spec, keys)
    store.commit_put(res, _fill(res, _rows(make_kv(spec, 3))).__getitem__, session="s1")
    other = store.block_keys(T, spec, tokens(1, spec, start=10_000))
    with pytest.raises(ResourceExhausted):  # HBM is full of pinned blocks: nothing to evict
        store.put(T, spec, other, make_kv(spec, 1), session="s1")
    assert store.lookup(T, spec, keys).tiers == ["hbm"] * 3


def test_reserved_bytes_count_against_the_tenant_quota(open_store, spec):
    store = open_store(spec, hbm_blocks=8, dram_blocks=0, nvme_blocks=0)
    store.set_tenant_policy(T, quota_bytes={"hbm": 2 * spec.block_nbytes})
    # more new blocks than the quota could ever hold: refused before any slot is reserved
    with pytest.raises(ResourceExhausted, match="can never fit"):
        store.reserve_put(T, spec, store.block_keys(T, spec, tokens(3, spec)))
    assert _used(store)["hbm"] == 0
    # one block in flight holds one of the two blocks of quota
    first = store.reserve_put(T, spec, store.block_keys(T, spec, tokens(1, spec, start=900)))
    keys = store.block_keys(T, spec, tokens(2, spec))
    res = store.reserve_put(T, spec, keys)
    assert [v is not None for v in res.views] == [True, False]
    with pytest.raises(ResourceExhausted):  # the second block has no room at commit either
        store.commit_put(res, {1: _rows(make_kv(spec, 2))[1]}.__getitem__)
    assert store.lookup(T, spec, keys).num_blocks == 0
    store.abort_put(first)
    assert _used(store)["hbm"] == 0


# -- through the in-band Put stream --------------------------------------------------------------
def test_stream_put_mixes_reserved_slots_and_staging_bit_exact(sidecar):
    from service_harness import SPEC, fresh_tokens, random_kv

    c = sidecar.tenant("mixed", local=False, chunk_bytes=1000)  # several uneven chunks per block
    keys = c.block_keys(SPEC, fresh_tokens(5))
    kv = random_kv(5, seed=9)
    c.put(SPEC, keys[:2], kv[:2])  # stored already: the stream stages these two
    c.put(SPEC, keys, kv)
    assert c.lookup(SPEC, keys).num_blocks == 5
    assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))


def test_stream_put_past_the_memory_tiers_lands_in_nvme(tmp_path):
    from service_harness import SPEC, fresh_tokens, random_kv, start

    n = SPEC.block_nbytes
    sc = start(tmp_path, store={"hbm_bytes": 2 * n, "dram_bytes": 2 * n, "high_watermark": 1.0,
                                "low_watermark": 1.0})
    try:
        c = sc.tenant("spill", local=False)
        keys = c.block_keys(SPEC, fresh_tokens(6))
        kv = random_kv(6, seed=10)
        c.put(SPEC, keys, kv)
        assert c.lookup(SPEC, keys).tiers == ["hbm", "hbm", "dram", "dram", "nvme", "nvme"]
        assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
    finally:
        sc.stop()


def test_making_room_for_the_slots_never_moves_the_stored_part_of_the_chain(open_store, spec):
    store = open_store(spec, hbm_blocks=3, dram_blocks=4, high_watermark=1.0, low_watermark=1.0)
    keys = store.block_keys(T, spec, tokens(4, spec))
    kv = make_kv(spec, 4, seed=6)
    store.put(T, spec, keys[:2], kv[:2])
    other = store.block_keys(T, spec, tokens(1, spec, start=50_000))
    store.put(T, spec, other, make_kv(spec, 1))  # HBM is full now; this one is the victim
    res = store.reserve_put(T, spec, keys)
    assert [s[0].label if s else None for s in res.slots] == [None, None, "hbm", "dram"]
    store.commit_put(res, _fill(res, _rows(kv)).__getitem__)
    assert store.lookup(T, spec, keys).tiers == ["hbm", "hbm", "hbm", "dram"]
    assert store.lookup(T, spec, other).tiers == ["dram"]
    assert torch.equal(store.get(T, spec, keys).view(torch.int16), kv.view(torch.int16))


def test_a_failed_commit_leaves_the_stored_prefix_deadlines_as_they_were(open_store, spec, clock, monkeypatch):
    """The commit's first part (the stored prefix) extends its blocks' TTLs; when a later part
    fails, the put changed nothing, those deadlines included."""
    from kvstore.block import Tier

    store = open_store(spec, hbm_blocks=3, dram_blocks=0, nvme_blocks=0)
    keys = store.block_keys(T, spec, tokens(3, spec))
    kv = make_kv(spec, 3, seed=6)
    store.put(T, spec, keys[:1], kv[:1], ttl_s=5.0)
    res = store.reserve_put(T, spec, keys)
    assert res.views[0] is None and res.views[1] is not None and res.views[2] is not None
    # NOTE: the last block's adoption fails (it was another stream's slot taking the room, which
    # the up-front check now counts: such a put is refused before any slot)
    hbm = store._place.backend(Tier.HBM)
    adopt, adopted = hbm.adopt, []

    def failing_adopt(offset, ref):
        if adopted:
            raise ResourceExhausted("injected: no room for the last block", resource="hbm")
        adopted.append(ref)
        return adopt(offset, ref)

    monkeypatch.setattr(hbm, "adopt", failing_adopt)
    with pytest.raises(ResourceExhausted):
        store.commit_put(res, _fill(res, _rows(kv)).__getitem__, ttl_s=100.0)
    monkeypatch.undo()
    assert store.lookup(T, spec, keys).num_blocks == 1
    clock.advance(5.0)
    assert store.lookup(T, spec, keys).num_blocks == 0, "the failed put extended the prefix's TTL"
    assert _used(store)["hbm"] == 0


def test_a_stream_put_that_can_never_fit_is_resource_exhausted_and_evicts_nothing(tmp_path):
    """Reserving slots for a stream put larger than the store would evict every block and
    then fail: it is refused before any slot is reserved, and the stored blocks stay."""
    from service_harness import SPEC, fresh_tokens, random_kv, start

    n = SPEC.block_nbytes
    sc = start(tmp_path, store={"hbm_bytes": 2 * n, "dram_bytes": 2 * n, "nvme_bytes": 4 * n})
    try:
        c = sc.tenant("big", local=False)
        keys = c.block_keys(SPEC, fresh_tokens(3))
        kv = random_kv(3, seed=11)
        c.put(SPEC, keys, kv)
        with pytest.raises(ResourceExhausted, match="can never fit"):
            c.put(SPEC, c.block_keys(SPEC, fresh_tokens(9)), random_kv(9, seed=12))
        assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
        assert sc.server.store.stats()["evictions"] == 0
    finally:
        sc.stop()


def test_a_reservation_with_a_repeated_key_is_refused_up_front(open_store, spec, sidecar):
    """A key twice in one put reserved two slots for one block: commit tripped an assert
    (INTERNAL at the service), and under ``python -O`` leaked the slot. Now INVALID_ARGUMENT."""
    store = open_store(spec)
    keys = store.block_keys(T, spec, tokens(2, spec))
    used = store.stats()["tiers"]["hbm"]["used_bytes"]
    with pytest.raises(InvalidArgument, match="key 2 repeats an earlier key"):
        store.reserve_put(T, spec, [keys[0], keys[1], keys[0]])
    assert store.stats()["tiers"]["hbm"]["used_bytes"] == used
    c = sidecar.tenant("dup", local=False)
    k = c.block_keys(SPEC, fresh_tokens(1))
    with pytest.raises(InvalidArgument, match="repeats an earlier key"):
        c.put(SPEC, [k[0], k[0]], random_kv(2))


def test_a_reservation_outlived_by_its_tenant_commits_nothing(open_store, spec):
    from kvstore.errors import Unauthenticated

    store = open_store(spec)
    keys = store.block_keys(T, spec, tokens(2, spec))
    since = store.drop_epoch
    res = store.reserve_put(T, spec, keys, since=since)
    for v in res.views:
        v[:] = 1
    store.drop_tenant(T)
    with pytest.raises(Unauthenticated, match="deleted while this call ran"):
        store.commit_put(res, lambda i: None)
    assert store.stats()["blocks"] == 0 and store.stats()["tiers"]["hbm"]["used_bytes"] == 0
    with pytest.raises(Unauthenticated):  # checked before the drop, reserved after it
        store.reserve_put(T, spec, keys, since=since)
    store.put(T, spec, keys, make_kv(spec, 2))  # in-process calls (no since) go on as before
    assert store.lookup(T, spec, keys).num_blocks == 2


def test_store_put_names_a_repeated_key(open_store, spec):
    store = open_store(spec)
    keys = store.block_keys(T, spec, tokens(2, spec))
    with pytest.raises(InvalidArgument, match="key 2 repeats an earlier key"):  # "already stored with
        store.put(T, spec, [keys[0], keys[1], keys[0]], make_kv(spec, 3))   # another parent" before
    assert store.stats()["blocks"] == 0
