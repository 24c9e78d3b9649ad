"""Deleting a whole chain by naming every block of it walks each block once. It walked each
named block's subtree: quadratic in the chain (a 2,048-block chain, seconds under the Store's
lock, every call of every tenant waiting)."""

from __future__ import annotations

from conftest import make_kv, tokens


def test_deleting_every_block_of_a_chain_walks_it_once(open_store, spec, monkeypatch):
    n = 256
    s = open_store(spec, hbm_blocks=2 * n, dram_blocks=0, nvme_blocks=0)
    keys = s.block_keys("t", spec, tokens(n, spec))
    s.put("t", spec, keys, make_kv(spec, n))
    assert s.lookup("t", spec, keys).tiers == ["hbm"] * n
    other = s.block_keys("t", spec, tokens(3, spec, start=10**6))
    s.put("t", spec, other, make_kv(spec, 3))
    calls = 0
    real = type(s._index).children

    def children(index, meta):
        nonlocal calls
        calls += 1
        return real(index, meta)
    monkeypatch.setattr(type(s._index), "children", children)
    assert s.delete("t", list(reversed(keys))) == n
    assert calls <= 4 * n, f"{calls} children lookups to delete a {n}-block chain"
    monkeypatch.undo()
    assert s.lookup("t", spec, keys).num_blocks == 0
    assert s.lookup("t", spec, other).num_blocks == 3
    assert s.delete("t", keys[5:7] + keys[100:101]) == 0
