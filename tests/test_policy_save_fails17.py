"""A policy set whose save fails changes nothing: the TTL cap on stored blocks (and a quota's
demotions) wait for the save. Before, the Store capped every stored block's deadline first,
and the rollback (no TTL) gave nothing back: the call failed and the blocks expired anyway."""

from __future__ import annotations

import pytest
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.auth import AuthRegistry
from kvstore.errors import NVMeWriteFailed, ResourceExhausted


@pytest.fixture
def sidecar(tmp_path):
    sc = start(tmp_path, store={"hbm_bytes": 8 * SPEC.block_nbytes, "dram_bytes": 16 * SPEC.block_nbytes,
                                "nvme_bytes": 64 * SPEC.block_nbytes})
    yield sc
    sc.stop()


def test_a_policy_set_whose_save_fails_cuts_no_blocks_lifetime(sidecar, monkeypatch):
    alice = sidecar.tenant("alice")
    keys = alice.block_keys(SPEC, fresh_tokens(4))
    alice.put(SPEC, keys, random_kv(4))

    def failing(self, ns, policy):
        raise NVMeWriteFailed("disk full (simulated)")

    with monkeypatch.context() as m:
        m.setattr(AuthRegistry, "set_policy", failing)
        with pytest.raises(ResourceExhausted, match="disk full"):
            sidecar.admin().set_policy("alice", ttl_s=1.0, quota_bytes={"hbm": SPEC.block_nbytes})
    assert sidecar.admin().get_policy("alice").get("ttl_s") is None
    sidecar.clock.now += 2.0
    assert alice.lookup(SPEC, keys).num_blocks == 4
    assert sidecar.admin().stats()["tenants"]["alice"]["hbm"] == 4 * SPEC.block_nbytes  # not demoted


def test_a_policy_set_that_saves_caps_the_stored_blocks(sidecar):
    alice = sidecar.tenant("alice")
    keys = alice.block_keys(SPEC, fresh_tokens(4))
    alice.put(SPEC, keys, random_kv(4))
    sidecar.admin().set_policy("alice", ttl_s=1.0)
    sidecar.clock.now += 2.0
    assert alice.lookup(SPEC, keys).num_blocks == 0
