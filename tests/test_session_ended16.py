"""A session's id used after its session ended says how it ended.

Before: every use of an id no session holds was NotFound "unknown session ... (sessions do not
survive a restart of the store; open it again)", also when the engine's own close, the idle
expiry (``session_idle_close_s``) or an operator (``kvstore session close``) had ended it: an
engine engineer went looking for a restart that never happened. The table keeps how the last
``SessionTable.ENDED_KEPT`` sessions ended."""

from __future__ import annotations

import pytest
from conftest import make_kv, tokens

from kvstore.errors import NotFound
from kvstore.sessions import SessionTable


def test_each_way_a_session_ends_is_named_on_its_next_use(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru")
    for sid in ("mine", "idle", "ops"):
        s.open_session("a", sid)
    keys = s.block_keys("a", spec, tokens(1, spec))
    s.put("a", spec, keys, make_kv(spec, 1), session="ops")

    s.close_session("a", "mine")
    clock.advance(5)
    with pytest.raises(NotFound, match="session 'mine' of tenant 'a' was closed 5 s ago; open it again"):
        s.pause_session("a", "mine")

    info = s.end_session("a", "ops")
    assert info.pinned_blocks == 1
    with pytest.raises(NotFound, match="no open session 'ops' in 'a': it was closed by an operator "
                                       "\\(kvstore session close\\) 0 s ago"):
        s.end_session("a", "ops")  # an operator's second close is told too
    with pytest.raises(NotFound, match="was closed by an operator \\(kvstore session close\\) 0 s ago"):
        s.put("a", spec, keys, make_kv(spec, 1), session="ops")

    clock.advance(s.config.session_idle_close_s)
    s.expire()
    unused = s.config.session_idle_close_s + 5  # opened before the 5 s above
    with pytest.raises(NotFound, match=f"'idle' of tenant 'a' was closed after {unused:.0f} s unused "
                                       f"\\(session_idle_close_s\\) 0 s ago"):
        s.resume_session("a", "idle")

    # an id never opened, and one opened again, are not "ended"
    with pytest.raises(NotFound, match="unknown session 'never'.*do not survive a restart"):
        s.close_session("a", "never")
    s.open_session("a", "mine")
    s.pause_session("a", "mine")
    with pytest.raises(NotFound, match="unknown session 'mine' of tenant 'b'"):  # per tenant
        s.pause_session("b", "mine")


def test_a_deleted_tenant_s_ended_sessions_are_forgotten_and_the_record_is_bounded(monkeypatch):
    t = [0.0]
    table = SessionTable(clock=lambda: t[0])
    table.open("a", "s")
    table.remove("a", "s", "closed")
    with pytest.raises(NotFound, match="was closed"):
        table.get("a", "s")
    table.drop_tenant("a")  # a new tenant of the name learns nothing of the old one's sessions
    with pytest.raises(NotFound, match="unknown session"):
        table.get("a", "s")

    monkeypatch.setattr(SessionTable, "ENDED_KEPT", 3)
    for i in range(5):
        table.open("b", f"s{i}")
        table.remove("b", f"s{i}")
    assert len(table._ended) == 3
    with pytest.raises(NotFound, match="unknown session 's0'"):  # the oldest forgotten
        table.get("b", "s0")
    with pytest.raises(NotFound, match="'s4' of tenant 'b' was closed"):
        table.get("b", "s4")


def test_reading_a_session_s_state_is_no_use_of_it(open_store, spec, clock):
    """Store.session_state refreshed the session's last use: an in-process engine polling it
    kept an abandoned session ACTIVE, its blocks pinned in HBM, past session_idle_pause_s."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru")
    s.open_session("a", "chat")
    keys = s.block_keys("a", spec, tokens(2, spec))
    s.put("a", spec, keys, make_kv(spec, 2), session="chat")
    for _ in range(12):  # polled every 60 s past the 600 s idle pause
        clock.advance(60)
        s.expire()
        state = s.session_state("a", "chat")
    from kvstore.block import SessionState

    assert state is SessionState.PAUSED
    assert s.stats()["counters"]["sessions_idle_paused"] == 1
    s.close_session("a", "chat")
    with pytest.raises(NotFound, match="was closed"):
        s.session_state("a", "chat")
