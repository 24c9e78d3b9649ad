"""Operators' figures that counted the wrong things.

* ``session list`` / ``session close`` counted a read lease (a Get streaming a session's blocks)
  as another session's pin: a session alone on its blocks said none of them were its alone, and
  a close said they "stay pinned by other sessions".
"""

from __future__ import annotations

import numpy as np
from conftest import make_kv, tokens


def test_a_read_lease_is_not_counted_as_another_sessions_pin(open_store, spec):
    s = open_store(spec, hbm_blocks=8, dram_blocks=8, nvme_blocks=64)
    s.open_session("a", "s1")
    keys = s.block_keys("a", spec, tokens(3, spec))
    s.put("a", spec, keys, make_kv(spec, 3), session="s1")
    assert s.session_info("a", "s1").only_pinned_blocks == 3

    def stage(_i: int) -> np.ndarray:
        return np.empty(spec.block_nbytes, np.uint8)

    with s.lease_prefix("a", spec, keys, stage) as lease:  # a Get of the blocks in progress
        assert len(lease.views) == 3
        info = s.session_info("a", "s1")
        assert (info.pinned_blocks, info.only_pinned_blocks, info.only_pinned_bytes) == (3, 3, 3 * spec.block_nbytes)
        closed = s.end_session("a", "s1")
        assert (closed.pinned_blocks, closed.only_pinned_blocks) == (3, 3)


def test_only_the_sessions_that_pin_a_block_count_as_its_other_pinners(open_store, spec):
    """A paused session that holds a block does not pin it; an active one does."""
    s = open_store(spec, hbm_blocks=8, dram_blocks=8, nvme_blocks=64)
    keys = s.block_keys("a", spec, tokens(3, spec))
    for sid in ("s1", "s2", "s3"):
        s.open_session("a", sid)
    s.put("a", spec, keys, make_kv(spec, 3), session="s1")
    s.put("a", spec, keys[:2], make_kv(spec, 2), session="s2")
    s.put("a", spec, keys[:1], make_kv(spec, 1), session="s3")
    s.pause_session("a", "s2")
    assert s.session_info("a", "s1").only_pinned_blocks == 2  # the first block: s3 pins it too
    assert s.session_info("a", "s3").only_pinned_blocks == 0
    assert s.session_info("a", "s2").only_pinned_blocks == 0  # paused: it pins nothing
