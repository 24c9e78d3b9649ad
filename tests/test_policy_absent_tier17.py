"""A quota on a tier the server does not have was accepted, saved and shown by ``policy get``
as if it bound something. Admin SetPolicy now refuses it naming the tier; a policy saved before
a config change took the tier away still loads at start."""

from __future__ import annotations

import pytest
from service_harness import restart, start

from kvstore.errors import InvalidArgument


@pytest.mark.parametrize("tier", ["nvme", "remote"])
def test_a_quota_on_a_tier_the_server_lacks_is_refused(tmp_path, tier):
    sc = start(tmp_path, store={"nvme_bytes": 0})
    try:
        admin = sc.admin()
        sc.tenant("alice")
        with pytest.raises(InvalidArgument, match=f"no {tier} tier"):
            admin.set_policy("alice", quota_bytes={tier: 1 << 20})
        assert not admin.get_policy("alice").get("quota_bytes")  # nothing saved
        admin.set_policy("alice", quota_bytes={"hbm": 1 << 20})  # a tier it has: taken
        assert admin.get_policy("alice")["quota_bytes"] == {"hbm": 1 << 20}
    finally:
        sc.stop()


def test_a_saved_quota_on_a_tier_taken_away_since_still_loads(tmp_path):
    sc = start(tmp_path, store={"nvme_bytes": 64 << 20})
    admin = sc.admin()
    sc.tenant("bob")
    admin.set_policy("bob", ttl_s=60.0, quota_bytes={"nvme": 1 << 20, "hbm": 1 << 20})
    sc.stop()
    sc.overrides["store"] = {**sc.overrides.get("store", {}), "nvme_bytes": 0}
    sc = restart(sc)  # NOTE: restart() stops it again first (a no-op on a stopped server)
    try:
        policy = sc.admin().get_policy("bob")
        assert policy["ttl_s"] == 60.0 and policy["quota_bytes"]["hbm"] == 1 << 20
    finally:
        sc.stop()
