"""A put staged through the client's shared-memory region is all or nothing, as a Put stream is.

Before, a put larger than the free part of the region went in pieces that fit, each committed
on its own: when a later piece failed, the earlier ones stayed stored (and, with ``session=``,
pinned in HBM) after the call raised, though the README promises a failed put leaves nothing
behind and the in-band path refused the same put up front. Now such a put goes in-band, as one
stream."""

from __future__ import annotations

import pytest
import torch
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore import service_data
from kvstore.errors import ResourceExhausted

torch.set_num_threads(1)
B = SPEC.block_nbytes
#: a region that holds a few blocks: a put of 10 did not fit its free part in one piece
SMALL_REGION = 16 * 1024


def _bytes_in(sc, plane: str) -> float:
    return sc.server.metrics_registry.get_sample_value("kvstore_bytes_in_total", {"plane": plane}) or 0.0


def _pinned(sc, tenant: str) -> int:
    return sum(1 for m in sc.server.store._index if m.tenant == tenant and m.pins)


@pytest.fixture
def small_hbm(tmp_path):
    """A sidecar whose HBM holds 8 blocks: a session put of 10 can never fit."""
    sc = start(tmp_path, store={"hbm_bytes": 8 * B, "dram_bytes": 64 * B, "nvme_bytes": 400 * B})
    yield sc
    sc.stop()


@pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])
def test_a_session_put_that_cannot_fit_stores_and_pins_nothing(small_hbm, local):
    """The prober's case: both planes refuse the put and leave nothing stored or pinned."""
    tenant = f"atomic-{int(local)}"
    c = small_hbm.tenant(tenant, local=local, region_bytes=SMALL_REGION)
    assert c.uses_shared_memory == local
    keys = c.block_keys(SPEC, fresh_tokens(10))
    c.open_session("s")
    with pytest.raises(ResourceExhausted):
        c.put(SPEC, keys, random_kv(10), session="s")
    assert c.lookup(SPEC, keys).num_blocks == 0
    assert _pinned(small_hbm, tenant) == 0


def test_a_failed_staged_put_keeps_what_was_stored_before_it(small_hbm):
    """Blocks stored before the put (its first keys, deduplicated) stay, unpinned; none of the
    new ones is stored. (An undo by deleting the earlier pieces would have dropped them.)"""
    c = small_hbm.tenant("atomic-keep", local=True, region_bytes=SMALL_REGION)
    keys = c.block_keys(SPEC, fresh_tokens(10))
    kv = random_kv(10, seed=3)
    c.put(SPEC, keys[:2], kv[:2])
    c.open_session("s")
    with pytest.raises(ResourceExhausted):
        c.put(SPEC, keys, kv, session="s")
    assert c.lookup(SPEC, keys).num_blocks == 2
    assert _pinned(small_hbm, "atomic-keep") == 0
    got = c.get(SPEC, keys)
    assert torch.equal(got.view(torch.int16), kv[:2].view(torch.int16))


def test_a_staged_put_whose_last_blocks_fail_to_commit_stores_none(sidecar, monkeypatch):
    """Whatever makes the commit of the put's last block fail (here injected: any commit that
    holds it), the call raises and none of its blocks is stored."""
    c = sidecar.tenant("atomic-inject", local=True, region_bytes=SMALL_REGION)
    assert c.uses_shared_memory
    keys = c.block_keys(SPEC, fresh_tokens(10))
    real = service_data.DataPlane.commit_put

    def commit_put(dp, b, *args, **kw):
        if keys[-1] in list(b.keys):
            raise ResourceExhausted("injected: no room for the last block")
        return real(dp, b, *args, **kw)

    monkeypatch.setattr(service_data.DataPlane, "commit_put", commit_put)
    with pytest.raises(ResourceExhausted, match="injected"):
        c.put(SPEC, keys, random_kv(10, seed=4))
    assert c.lookup(SPEC, keys).num_blocks == 0


def test_a_staged_put_larger_than_the_regions_free_part_is_stored_whole(sidecar):
    """It goes in-band, in one stream, and reads back bit-exact; one that fits the region
    still goes through shared memory."""
    c = sidecar.tenant("atomic-big", local=True, region_bytes=SMALL_REGION)
    keys = c.block_keys(SPEC, fresh_tokens(10))
    kv = random_kv(10, seed=5)
    c.put(SPEC, keys, kv)
    assert _bytes_in(sidecar, "stream") == 10 * B and _bytes_in(sidecar, "shm") == 0
    assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))

    small = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, small, random_kv(2, seed=6))
    assert _bytes_in(sidecar, "shm") == 2 * B
