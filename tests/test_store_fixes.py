"""Store read/flush/session edge cases a prober found (each failed before its fix).

* A chain continued from a ``parent`` was served by get/get_into/lease_prefix/prefetch after
  that parent expired: the walk trusted the parent link and never swept due deadlines.
* ``flush()`` (and so ``close()`` with ``persist_on_close``) wrote past a tenant's NVMe quota.
* ``resume_session`` that could not bring every block back to HBM returned a smaller count
  and left pinned blocks in DRAM without a word.
* A lazily negated output tensor failed with torch's RuntimeError deep in the copy.
* A bare str per-block extra key was iterated char by char (a key collision with the list of
  its chars); bare bytes was refused as "got int".
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_kv, tokens

from kvstore.block import SessionState
from kvstore.errors import InvalidArgument, ResourceExhausted


def _split_chain(s, spec, clock):
    keys = s.block_keys("a", spec, tokens(4, spec))
    kv = make_kv(spec, 4)
    s.put("a", spec, keys[:2], kv[:2], ttl_s=1.0)
    s.put("a", spec, keys[2:], kv[2:], parent=keys[1], ttl_s=100.0)
    return keys, kv


def _served(s, spec, call, keys, parent):
    if call == "get":
        return s.get("a", spec, keys, parent=parent).shape[0]
    if call == "get_into":
        return s.get_into("a", spec, keys, [bytearray(spec.block_nbytes) for _ in keys], parent=parent)
    if call == "prefetch":
        return s.prefetch("a", spec, keys, "hbm", parent=parent)
    stage = lambda i: np.empty(spec.block_nbytes, np.uint8)
    with s.lease_prefix("a", spec, keys, stage, parent=parent) as lease:
        return len(lease.views)


@pytest.mark.parametrize("call", ["get", "get_into", "prefetch", "lease"])
def test_a_chain_under_an_expired_parent_is_not_served(open_store, spec, clock, call):
    s = open_store(spec, hbm_blocks=2, dram_blocks=4, nvme_blocks=16)
    keys, _ = _split_chain(s, spec, clock)
    assert s.lookup("a", spec, keys[2:], parent=keys[1]).tiers == ["dram"] * 2
    clock.advance(1.5)  # the parent (and its ancestors) are past their deadline
    assert _served(s, spec, call, keys[2:], keys[1]) == 0
    assert s.stats()["blocks"] == 0  # the read swept the expired subtree
    assert s.lookup("a", spec, keys[2:], parent=keys[1]).num_blocks == 0


def test_a_parent_of_another_model_or_absent_serves_nothing(open_store, spec):
    s = open_store(spec, hbm_blocks=8)
    keys = s.block_keys("a", spec, tokens(3, spec))
    s.put("a", spec, keys, make_kv(spec, 3))
    assert s.get("a", spec, keys[1:], parent=keys[0]).shape[0] == 2
    assert s.get("a", spec, keys[1:], parent=b"\x05" * 32).shape[0] == 0


def test_flush_keeps_within_the_tenant_nvme_quota(open_store, spec):
    n = spec.block_nbytes
    s = open_store(spec, hbm_blocks=8, dram_blocks=0, nvme_blocks=16)
    s.set_tenant_policy("a", quota_bytes={"nvme": 2 * n})
    s.put("a", spec, s.block_keys("a", spec, tokens(5, spec)), make_kv(spec, 5))
    s.put("b", spec, s.block_keys("b", spec, tokens(3, spec)), make_kv(spec, 3))
    s.flush()
    tenants = s.stats()["tenants"]
    assert tenants["a"]["nvme"] == 2 * n  # two ancestors, within the quota
    assert tenants["b"]["nvme"] == 3 * n  # another tenant is not held back by it


def test_close_persists_within_the_quota(open_store, spec, tmp_path):
    n = spec.block_nbytes
    path = tmp_path / "q"
    s = open_store(spec, hbm_blocks=8, dram_blocks=0, nvme_blocks=16, path=path)
    s.set_tenant_policy("a", quota_bytes={"nvme": 1 * n})
    keys = s.block_keys("a", spec, tokens(4, spec))
    s.put("a", spec, keys, make_kv(spec, 4))
    assert s.close() == 1
    s2 = open_store(spec, hbm_blocks=8, dram_blocks=0, nvme_blocks=16, path=path)
    assert s2.lookup("a", spec, keys).num_blocks == 1


def test_resume_is_all_or_nothing(open_store, spec):
    s = open_store(spec, hbm_blocks=3, dram_blocks=8, nvme_blocks=16)
    s.open_session("a", "chat")
    keys = s.block_keys("a", spec, tokens(3, spec))
    kv = make_kv(spec, 3)
    s.put("a", spec, keys, kv, session="chat")
    assert s.pause_session("a", "chat") == 3
    # another session takes two of the three HBM slots and pins them
    s.open_session("a", "other")
    other = s.block_keys("a", spec, tokens(2, spec, start=500))
    s.put("a", spec, other, make_kv(spec, 2, seed=1), session="other")
    with pytest.raises(ResourceExhausted, match="stays paused"):
        s.resume_session("a", "chat")
    assert s.session_state("a", "chat") == SessionState.PAUSED
    assert s.lookup("a", spec, keys).tiers == ["dram"] * 3  # what moved went back down
    s.close_session("a", "other")
    assert s.resume_session("a", "chat") == 3
    assert s.lookup("a", spec, keys).tiers == ["hbm"] * 3
    assert torch.equal(s.get("a", spec, keys), kv)


def test_resume_brings_a_parent_outside_the_session_along(open_store, spec):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=16)
    keys = s.block_keys("a", spec, tokens(3, spec))
    kv = make_kv(spec, 3)
    s.put("a", spec, keys[:1], kv[:1])  # a shared prefix, in no session
    s.open_session("a", "chat")
    s.put("a", spec, keys[1:], kv[1:], parent=keys[0], session="chat")
    s.pause_session("a", "chat")
    s.prefetch("a", spec, keys[:1], "dram")
    assert s.prefetch("a", spec, keys, "dram") >= 0
    for i in range(4):  # push the prefix down to DRAM too
        s.put("b", spec, s.block_keys("b", spec, tokens(1, spec, start=900 + 10 * i)), make_kv(spec, 1))
    assert s.lookup("a", spec, keys).tiers[0] != "hbm"
    assert s.resume_session("a", "chat") >= 2
    assert s.lookup("a", spec, keys).tiers == ["hbm"] * 3


def test_a_negated_view_as_output_is_refused_clearly(open_store, spec):
    s = open_store(spec)
    keys = s.block_keys("a", spec, tokens(2, spec))
    kv = make_kv(spec, 2)
    s.put("a", spec, keys, kv)
    out = torch.empty_like(kv)
    with pytest.raises(InvalidArgument, match="negated/conjugated view"):
        s.get("a", spec, keys, out=torch._neg_view(out))
    with pytest.raises(InvalidArgument, match="negated/conjugated view"):
        s.get_into("a", spec, keys, [torch._neg_view(out[0]), out[1]])
    # as input it is read as the values it shows
    k2 = s.block_keys("a", spec, tokens(2, spec, start=100))
    s.put_bytes("a", spec, k2, [torch._neg_view(kv[0]), kv[1]])
    got = s.get("a", spec, k2)
    assert torch.equal(got[0], -kv[0]) and torch.equal(got[1], kv[1])


def test_a_bare_str_or_bytes_extra_key_is_one_item(spec):
    from kvstore.keys import block_keys

    fp = spec.fingerprint
    toks = tokens(1, spec)

    def key(extra):
        return block_keys("a", fp, spec.block_tokens, toks, extra_keys=[extra])[0]

    assert key("img") == key(["img"]) == key(b"img") == key([b"img"])
    assert key("img") != key(["i", "m", "g"])
    assert key(np.uint8(1).tobytes()) == key([b"\x01"])
    with pytest.raises(InvalidArgument, match="one entry per full block"):
        block_keys("a", fp, spec.block_tokens, toks, extra_keys="img")


@pytest.mark.parametrize("policy", ["lru", "gdsf", "cost"])
@pytest.mark.parametrize("how", ["put", "lower-quota"])
def test_a_tenant_over_quota_never_pushes_out_another_tenants_blocks(open_store, spec, clock, policy, how):
    # the blocks its quota demotes made room in DRAM with the store-wide victims: another
    # tenant's DRAM blocks were evicted (dropped, with no NVMe) while HBM was 10-20 % used
    n = spec.block_nbytes
    s = open_store(spec, hbm_blocks=10, dram_blocks=3, nvme_blocks=0, policy=policy)
    s.set_tenant_policy("b", quota_bytes={"hbm": 0})  # b's blocks live in DRAM
    kb = s.block_keys("b", spec, tokens(2, spec, start=100))
    kv_b = make_kv(spec, 2, seed=3)
    s.put("b", spec, kb, kv_b)
    clock.advance(1)
    if how == "put":
        s.set_tenant_policy("a", quota_bytes={"hbm": 2 * n})
        s.put("a", spec, s.block_keys("a", spec, tokens(2, spec)), make_kv(spec, 2))
        clock.advance(1)
        s.put("a", spec, s.block_keys("a", spec, tokens(2, spec, start=500)), make_kv(spec, 2))
    else:
        s.put("a", spec, s.block_keys("a", spec, tokens(3, spec)), make_kv(spec, 3))
        clock.advance(1)
        s.set_tenant_policy("a", quota_bytes={"hbm": n})
    assert s.lookup("b", spec, kb).tiers == ["dram", "dram"]
    assert torch.equal(s.get("b", spec, kb), kv_b)
    assert s.stats()["tenants"]["a"]["hbm"] <= 2 * n
