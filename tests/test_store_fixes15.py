"""Store put/close defects a prober found (each test failed before its fix).

* A put refused with ParentNotStored made room first: ``reserve_put`` (the service's two-phase
  put) evicted and demoted the tenant's blocks before ``commit_put`` refused it.
* A chained put refused by the tenant's NVMe quota was labelled as NVMe's capacity (resource
  "nvme") and not counted in ``quota_rejections``: the metrics said NVMe was full.
"""

from __future__ import annotations

import pytest
from conftest import make_kv, tokens

from kvstore.errors import ParentNotStored, ResourceExhausted


def _at_quota(open_store, spec, n=6, **kw):
    """A store whose tenant "q" holds ``n`` blocks: 2 in each tier, at its quota everywhere."""
    s = open_store(spec, hbm_blocks=16, dram_blocks=16, nvme_blocks=64, **kw)
    B = spec.block_nbytes
    s.set_tenant_policy("q", quota_bytes={"hbm": 2 * B, "dram": 2 * B, "nvme": 2 * B})
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
