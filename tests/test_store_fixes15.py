"""Store put/close defects a prober found (each test failed before its fix).

* A put refused with ParentNotStored made room first: ``reserve_put`` (the service's two-phase
  put) evicted and demoted the tenant's blocks before ``commit_put`` refused it.
* A chained put refused by the tenant's NVMe quota was labelled as NVMe's capacity (resource
  "nvme") and not counted in ``quota_rejections``: the metrics said NVMe was full.
* A tenant at its NVMe quota lost its whole cache on a graceful restart: close could not commit
  its memory blocks (the chain's ancestors), and the NVMe blocks below them were dropped at the
  next open as orphans, without a word at close.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_kv, tokens

from kvstore.errors import ParentNotStored, ResourceExhausted


def _at_quota(open_store, spec, n=6, **kw):
    """A store whose tenant "q" holds ``n`` blocks: 2 in each tier, at its quota everywhere
    (NVMe's: its 2 blocks and the copies of the 4 above them, which a block goes to NVMe with:
    tests/test_nvme_closure15.py)."""
    s = open_store(spec, hbm_blocks=16, dram_blocks=16, nvme_blocks=64, **kw)
    B = spec.block_nbytes
    s.set_tenant_policy("q", quota_bytes={"hbm": 2 * B, "dram": 2 * B, "nvme": 6 * B})
    keys = s.block_keys("q", spec, tokens(n, spec))
    s.put("q", spec, keys, make_kv(spec, n))
    return s, keys


def _where(s, keys):
    return [(m.tier.label if (m := s._index.get("q", k)) is not None else None) for k in keys]


@pytest.mark.parametrize("how", ["reserve_put", "put"])
def test_a_put_under_a_parent_not_stored_changes_nothing(open_store, spec, how):
    s, keys = _at_quota(open_store, spec)
    before, counters = _where(s, keys), dict(s.stats()["counters"])
    assert before == ["hbm", "hbm", "dram", "dram", "nvme", "nvme"]
    new = s.block_keys("q", spec, tokens(1, spec, start=1000))
    with pytest.raises(ParentNotStored):
        if how == "put":
            s.put("q", spec, new, make_kv(spec, 1), parent=b"\x07" * len(keys[0]))
        else:
            res = s.reserve_put("q", spec, new, parent=b"\x07" * len(keys[0]))
            s.commit_put(res, lambda i: bytes(spec.block_nbytes))
    assert _where(s, keys) == before
    after = s.stats()["counters"]
    assert {k: after.get(k, 0) for k in ("evictions", "demotions")} == \
        {k: counters.get(k, 0) for k in ("evictions", "demotions")}
    assert s.lookup("q", spec, keys).num_blocks == 6


@pytest.mark.parametrize("how", ["reserve_put", "put"])
def test_a_put_refused_by_the_nvme_quota_is_a_quota_rejection(open_store, spec, how):
    s, keys = _at_quota(open_store, spec)
    new = s.block_keys("q", spec, tokens(7, spec))[6:]  # continues the chain from keys[5], in NVMe
    with pytest.raises(ResourceExhausted) as err:
        if how == "put":
            s.put("q", spec, new, make_kv(spec, 1), parent=keys[5])
        else:
            res = s.reserve_put("q", spec, new, parent=keys[5])
            s.commit_put(res, lambda i: bytes(spec.block_nbytes))
    assert err.value.resource == "quota:q:nvme"  # it was "nvme", with NVMe nearly empty
    assert "quota" in str(err.value)
    assert s.stats()["counters"].get("quota_rejections", 0) == 1  # it was 0
    assert s.lookup("q", spec, keys[:6]).num_blocks == 6


def test_a_chained_put_refused_by_nvme_capacity_stays_nvme(open_store, spec):
    s = open_store(spec, hbm_blocks=0, dram_blocks=0, nvme_blocks=2)
    keys = s.block_keys("q", spec, tokens(3, spec))
    s.put("q", spec, keys[:2], make_kv(spec, 2))
    with pytest.raises(ResourceExhausted) as err:
        s.put("q", spec, keys[2:], make_kv(spec, 1), parent=keys[1])
    assert err.value.resource == "nvme"
    assert s.stats()["counters"].get("quota_rejections", 0) == 0


def test_close_at_the_nvme_quota_keeps_a_usable_prefix(open_store, spec, tmp_path):
    s, keys = _at_quota(open_store, spec, path=tmp_path / "st")
    assert s.lookup("q", spec, keys).num_blocks == 6
    closed = s
    # NOTE: the memory blocks got their NVMe copies when the blocks below them went to NVMe
    # (tests/test_nvme_closure15.py): nothing is left to commit, and the whole chain comes back
    # (before, close committed the two shallowest and lost the other two)
    assert s.close() == 0
    s = open_store(spec, hbm_blocks=16, dram_blocks=16, nvme_blocks=64, path=tmp_path / "st")
    assert s.lookup("q", spec, keys).num_blocks == 6  # it was 0
    assert s.stats()["counters"].get("orphans_dropped", 0) == 0  # it dropped both: 0 found after
    assert torch.equal(s.get("q", spec, keys), make_kv(spec, 6))
    assert closed.uncommitted_at_close == 0


def test_close_commits_everything_that_fits_as_before(open_store, spec, tmp_path):
    s = open_store(spec, hbm_blocks=2, dram_blocks=2, nvme_blocks=64, path=tmp_path / "st")
    keys = s.block_keys("q", spec, tokens(6, spec))
    s.put("q", spec, keys, make_kv(spec, 6))
    # NOTE: 0: the 4 memory blocks got their NVMe copies when the 2 below them went to NVMe
    # (tests/test_nvme_closure15.py); close committed them before
    assert s.close() == 0
    s = open_store(spec, hbm_blocks=2, dram_blocks=2, nvme_blocks=64, path=tmp_path / "st")
    assert torch.equal(s.get("q", spec, keys), make_kv(spec, 6))
