"""Idle expiry of sessions (StoreConfig.session_idle_pause_s / session_idle_close_s), run by
Store.expire (the sidecar's expiry sweep), on the Store's injected clock.

Before: a session lived until closed. A client that went away without closing its session
(a crash, a disconnect) left its blocks pinned in HBM for as long as the store ran: with HBM
full of them every other tenant's session put was refused (for days), no admin verb could end
it, a tenant TTL set afterwards did not touch them, and the leaked id counted against
limits.max_sessions_per_tenant for good."""

from __future__ import annotations

import pytest
from conftest import make_kv, tokens
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.block import SessionState
from kvstore.config import StoreConfig
from kvstore.errors import InvalidArgument, NotFound, ResourceExhausted

B = SPEC.block_nbytes


def _pins(store, tenant: str, keys) -> list[int]:
    return [m.pins if (m := store._index.get(tenant, k)) is not None else 0 for k in keys]


def _state(store, tenant: str, sid: str) -> SessionState:
    """The session's state, read without using it (``session_state`` is a use: it refreshes)."""
    return store._sessions._by_id[(tenant, sid)].state


def _abandon(s, spec, tenant: str = "gone", sid: str = "chat", n: int = 4) -> list[bytes]:
    """``tenant`` opens ``sid``, fills HBM (``n`` blocks) with it and never comes back."""
    keys = s.block_keys(tenant, spec, tokens(n, spec, start=70_000))
    s.open_session(tenant, sid)
    s.put(tenant, spec, keys, make_kv(spec, n, seed=3), session=sid)
    return keys


# -- the Store -----------------------------------------------------------------------------------
def test_an_abandoned_active_session_is_paused_and_its_hbm_freed(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru")
    gone = _abandon(s, spec)
    s.open_session("b", "s")
    kb = s.block_keys("b", spec, tokens(1, spec, start=90_000))
    with pytest.raises(ResourceExhausted):
        s.put("b", spec, kb, make_kv(spec, 1, seed=4), session="s")

    clock.advance(599)
    s.expire()
    assert _state(s, "gone", "chat") is SessionState.ACTIVE  # not idle long enough yet
    clock.advance(1)
    s.expire()

    assert _state(s, "gone", "chat") is SessionState.PAUSED
    assert _pins(s, "gone", gone) == [0, 0, 0, 0]
    assert s.lookup("gone", spec, gone).tiers == ["dram"] * 4  # spilled as a pause does, kept
    assert s.stats()["counters"]["sessions_idle_paused"] == 2  # b's too, unused since its put
    assert s.open_session("b", "s") is SessionState.RESUMED
    s.put("b", spec, kb, make_kv(spec, 1, seed=4), session="s")  # HBM is free again
    assert _pins(s, "b", kb) == [1]
    # the client comes back (once there is room): opening it resumes it
    s.close_session("b", "s")
    assert s.open_session("gone", "chat") is SessionState.RESUMED
    assert _pins(s, "gone", gone) == [1, 1, 1, 1]


def test_every_use_of_a_session_restarts_its_idle_time(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=8, dram_blocks=8, nvme_blocks=64, policy="lru")
    keys = s.block_keys("t", spec, tokens(3, spec))
    s.open_session("t", "a")
    s.open_session("t", "b")
    s.put("t", spec, keys[:1], make_kv(spec, 1), session="a")
    s.put("t", spec, keys[1:2], make_kv(spec, 1, seed=1), session="b", parent=keys[0])
    clock.advance(500)
    s.put("t", spec, keys[2:], make_kv(spec, 1, seed=2), session="a", parent=keys[1])  # a put naming a
    s.resume_session("t", "b")  # a verb (a no-op: b is ACTIVE) is a use too
    clock.advance(500)
    s.expire()
    assert _state(s, "t", "a") is SessionState.ACTIVE
    assert _state(s, "t", "b") is SessionState.ACTIVE
    clock.advance(100)
    s.expire()
    assert _state(s, "t", "a") is SessionState.PAUSED
    assert _state(s, "t", "b") is SessionState.PAUSED
    assert s.stats()["counters"]["sessions_idle_paused"] == 2


def test_a_session_idle_for_a_day_is_closed_and_its_id_freed(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru")
    gone = _abandon(s, spec)
    clock.advance(700)
    s.expire()  # idle-paused: that is no use of it, the close timer still runs from its last put
    clock.advance(86_400 - 700)
    s.expire()

    with pytest.raises(NotFound):
        s.session_state("gone", "chat")
    assert _pins(s, "gone", gone) == [0, 0, 0, 0]
    assert all(m.paused == 0 and not m.sessions for k in gone if (m := s._index.get("gone", k)))
    assert s.lookup("gone", spec, gone).num_blocks == 4  # kept as prefix cache
    assert s.stats()["counters"]["sessions_idle_closed"] == 1
    assert s.stats()["sessions"] == 0
    # the id no longer counts against the tenant's session limit
    assert s.open_session("gone", "next", max_sessions=1) is SessionState.ACTIVE


def test_an_active_session_idle_for_the_close_time_is_closed_at_once(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru")
    gone = _abandon(s, spec)
    clock.advance(86_400)
    s.expire()
    assert s.stats()["sessions"] == 0
    assert _pins(s, "gone", gone) == [0, 0, 0, 0]
    assert s.stats()["counters"]["sessions_idle_closed"] == 1
    assert s.stats()["counters"]["sessions_idle_paused"] == 0


def test_zero_turns_idle_expiry_off(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru",
                   session_idle_pause_s=0, session_idle_close_s=0)
    gone = _abandon(s, spec)
    clock.advance(365 * 86_400)
    s.expire()
    assert s.session_state("gone", "chat") is SessionState.ACTIVE
    assert _pins(s, "gone", gone) == [1, 1, 1, 1]


def test_pause_only_closes_nothing(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru",
                   session_idle_pause_s=60, session_idle_close_s=0)
    _abandon(s, spec)
    clock.advance(365 * 86_400)
    s.expire()
    assert s.session_state("gone", "chat") is SessionState.PAUSED


def test_the_idle_times_are_validated_config_fields(tmp_path):
    cfg = StoreConfig(path=tmp_path)
    assert (cfg.session_idle_pause_s, cfg.session_idle_close_s) == (600.0, 86_400.0)
    for field in ("session_idle_pause_s", "session_idle_close_s"):
        for bad in (-1, True, float("nan"), float("inf")):
            with pytest.raises(InvalidArgument, match=field):
                StoreConfig.build(path=tmp_path, **{field: bad})


# -- the sidecar (its expiry sweep calls Store.expire) -------------------------------------------
def test_sidecar_an_abandoned_session_stops_blocking_other_tenants(tmp_path):
    from service_harness import start

    sc = start(tmp_path, store={"hbm_bytes": 8 * B, "dram_bytes": 8 * B, "nvme_bytes": 64 * B},
               limits={"max_sessions_per_tenant": 1})
    try:
        tok = sc.admin().create_tenant("a")
        a = sc.client(tok, local=False)
        a.open_session("chat")
        ka = a.block_keys(SPEC, fresh_tokens(8))
        a.put(SPEC, ka, random_kv(8), session="chat")
        a.close()  # the engine goes away without closing its session
        b = sc.tenant("b", local=False)
        b.open_session("s")
        kb = b.block_keys(SPEC, fresh_tokens(1))
        with pytest.raises(ResourceExhausted):
            b.put(SPEC, kb, random_kv(1), session="s")

        sc.clock.now += 601
        sc.server.store.expire()  # what the sidecar's sweep runs every expire_interval_s
        assert sc.admin().stats()["counters"]["sessions_idle_paused"] == 2  # a's and b's
        assert b.open_session("s") is SessionState.RESUMED  # b is back: re-opening resumes it
        b.put(SPEC, kb, random_kv(1), session="s")  # HBM is free of a's blocks
        assert sc.server.store._index.get("b", kb[0]).pins == 1

        a = sc.client(tok, local=False)
        with pytest.raises(ResourceExhausted, match="max_sessions_per_tenant"):
            a.open_session("next")  # the leaked id holds tenant a's only session
        sc.clock.now += 86_400
        sc.server.store.expire()
        assert sc.admin().stats()["counters"]["sessions_idle_closed"] == 2  # a's and b's
        a.open_session("next")  # a's leaked id is freed
    finally:
        sc.stop()


# -- sessions do not survive a restart: NotFound says so -------------------------------------------
_LOST = r"unknown session 'chat' .*sessions do not survive a restart of the store; open it again"


def test_store_reopened_has_no_sessions_and_says_why(open_store, spec, tmp_path):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, path=tmp_path / "st")
    keys = s.block_keys("t", spec, tokens(2, spec))
    s.open_session("t", "chat")
    s.put("t", spec, keys, make_kv(spec, 2), session="chat")
    s.close()
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, path=tmp_path / "st")
    assert s.lookup("t", spec, keys).tiers == ["nvme", "nvme"]  # the blocks come back, unpinned
    assert _pins(s, "t", keys) == [0, 0]
    with pytest.raises(NotFound, match=_LOST):
        s.session_state("t", "chat")
    more = s.block_keys("t", spec, tokens(3, spec))[2:]
    with pytest.raises(NotFound, match=_LOST):
        s.put("t", spec, more, make_kv(spec, 1), session="chat", parent=keys[-1])


def test_sidecar_restart_session_verbs_say_sessions_do_not_survive_it(tmp_path):
    from service_harness import restart, start

    sc = start(tmp_path, store={"hbm_bytes": 8 * B, "dram_bytes": 8 * B, "nvme_bytes": 64 * B})
    try:
        tok = sc.admin().create_tenant("a")
        a = sc.client(tok, local=False)
        a.open_session("chat")
        keys = a.block_keys(SPEC, fresh_tokens(2))
        a.put(SPEC, keys, random_kv(2), session="chat")
        sc = restart(sc)
        a = sc.client(tok, local=False)
        assert a.lookup(SPEC, keys).num_blocks == 2
        for verb in (a.pause_session, a.resume_session, a.close_session):
            with pytest.raises(NotFound, match=_LOST):
                verb("chat")
        with pytest.raises(NotFound, match=_LOST):
            a.put(SPEC, a.block_keys(SPEC, fresh_tokens(1)), random_kv(1), session="chat")
        assert a.open_session("chat") is SessionState.ACTIVE  # what the message tells it to do
    finally:
        sc.stop()
