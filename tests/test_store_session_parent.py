"""A session put that continues from a stored prefix a slower tier holds (a shared system prompt
demoted by other traffic): the prefix is brought up first. Before, the put failed with
RESOURCE_EXHAUSTED, "could not be brought up" (nothing had tried) or "it is full of pinned
blocks" (none was pinned), though the same chain put from its root worked."""

from __future__ import annotations

import pytest
import torch
from conftest import make_kv, tokens

from kvstore.errors import ResourceExhausted


def _demoted_prefix(s, spec, n=2):
    keys = s.block_keys("t", spec, tokens(4, spec))
    kv = make_kv(spec, 4, seed=1)
    s.put("t", spec, keys[:n], kv[:n])
    for i in range(4):  # other traffic pushes the prefix out of HBM
        s.put("t", spec, s.block_keys("t", spec, tokens(2, spec, start=10_000 * (i + 1))),
              make_kv(spec, 2, seed=10 + i))
    assert s.lookup("t", spec, keys[:n]).tiers == ["dram"] * n
    return keys, kv


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_a_session_continues_a_prefix_demoted_to_dram(open_store, spec, policy):
    s = open_store(spec, hbm_blocks=4, dram_blocks=16, nvme_blocks=64, policy=policy)
    keys, kv = _demoted_prefix(s, spec)
    s.open_session("t", "chat")
    s.put("t", spec, keys[2:], kv[2:], session="chat", parent=keys[1])
    assert s.lookup("t", spec, keys).tiers == ["hbm"] * 4
    assert torch.equal(s.get("t", spec, keys), kv)
    for i in range(4):  # the session's blocks are pinned; its prefix may go down again
        s.put("t", spec, s.block_keys("t", spec, tokens(1, spec, start=90_000 + 100 * i)),
              make_kv(spec, 1, seed=20 + i))
    assert s.lookup("t", spec, keys).tiers[2:] == ["hbm"] * 2


def test_a_session_put_of_a_stored_block_under_a_demoted_parent(open_store, spec):
    s = open_store(spec, hbm_blocks=4, dram_blocks=16, nvme_blocks=64, policy="lru")
    keys, kv = _demoted_prefix(s, spec)
    s.open_session("t", "chat")
    s.put("t", spec, keys[1:2], kv[1:2], session="chat", parent=keys[0])
    assert s.lookup("t", spec, keys[:2]).tiers == ["hbm", "hbm"]


def test_no_room_for_the_prefix_says_why(open_store, spec):
    """HBM full of another session's pinned blocks: the put is refused, saying so, and stores
    nothing."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=16, nvme_blocks=64, policy="lru")
    keys, kv = _demoted_prefix(s, spec)
    s.open_session("t", "other")
    other = s.block_keys("t", spec, tokens(4, spec, start=50_000))
    s.put("t", spec, other, make_kv(spec, 4, seed=3), session="other")
    s.open_session("t", "chat")
    with pytest.raises(ResourceExhausted, match="pinned by sessions|held by pinned"):
        s.put("t", spec, keys[2:], kv[2:], session="chat", parent=keys[1])
    assert s.lookup("t", spec, keys).num_blocks == 2
