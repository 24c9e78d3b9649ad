"""Counters an operator reads: promotions (none was counted) and a pause's demotions (counted
in moved_hbm_to_dram only)."""

from __future__ import annotations

from conftest import make_kv, tokens


def test_promotions_and_a_pauses_demotions_are_counted(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru")
    s.open_session("a", "chat")
    keys = s.block_keys("a", spec, tokens(3, spec))
    s.put("a", spec, keys, make_kv(spec, 3), session="chat")
    before = s.stats()
    assert s.pause_session("a", "chat") == 3
    after = s.stats()
    assert after["demotions"] - before["demotions"] == 3
    assert s.resume_session("a", "chat") == 3
    again = s.stats()
    assert again["promotions"] - after["promotions"] == 3
    c = again["counters"]
    assert again["promotions"] == sum(v for k, v in c.items() if k.startswith("moved_")
                                      and ["hbm", "dram", "nvme"].index(k.split("_")[3])
                                      < ["hbm", "dram", "nvme"].index(k.split("_")[1]))
