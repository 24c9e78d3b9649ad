"""Session verbs: re-opening a paused session, the state each verb answers, sessions of a
publisher of several namespaces.

Before: re-opening a PAUSED session left it paused while OpenSession answered ACTIVE (every
verb answered the state its name implies), so blocks put with ``session=`` afterwards were not
pinned and the policy evicted them; and a publisher of two or more namespaces could not use
sessions at all (SessionRequest named no namespace: "name one", yet there was no way to)."""

from __future__ import annotations

import pytest
from conftest import make_kv, tokens
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.block import SessionState
from kvstore.errors import PermissionDenied, ResourceExhausted
from proto.kvstore.v1 import kvstore_pb2 as pb

B = SPEC.block_nbytes


def _pinned(store, tenant: str, keys) -> list[int]:
    """The pin count of each of ``keys`` in the Store's index (0 for a block not stored)."""
    metas = [store._index.get(tenant, k) for k in keys]
    return [m.pins if m is not None else 0 for m in metas]


# -- the Store -----------------------------------------------------------------------------------
def test_store_reopen_of_a_paused_session_resumes_it(open_store, spec):
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru")
    keys = s.block_keys("t", spec, tokens(2, spec))
    s.open_session("t", "chat")
    s.put("t", spec, keys, make_kv(spec, 2, seed=1), session="chat")
    s.pause_session("t", "chat")
    assert s.lookup("t", spec, keys).tiers == ["dram", "dram"]

    assert s.open_session("t", "chat") is SessionState.RESUMED
    assert s.session_state("t", "chat") is SessionState.RESUMED
    assert s.lookup("t", spec, keys).tiers == ["hbm", "hbm"]
    assert _pinned(s, "t", keys) == [1, 1]
    # re-opening a pinning session is idempotent: no second pin
    assert s.open_session("t", "chat") is SessionState.RESUMED
    assert _pinned(s, "t", keys) == [1, 1]


def test_store_reopen_of_a_paused_session_is_all_or_nothing(open_store, spec):
    """HBM full of another session's pinned blocks: the re-open raises ResourceExhausted, as
    resume_session does, and the session stays paused with its blocks unpinned in DRAM."""
    s = open_store(spec, hbm_blocks=4, dram_blocks=8, nvme_blocks=64, policy="lru")
    keys = s.block_keys("t", spec, tokens(2, spec))
    s.open_session("t", "chat")
    s.put("t", spec, keys, make_kv(spec, 2, seed=1), session="chat")
    s.pause_session("t", "chat")
    s.open_session("t", "other")
    other = s.block_keys("t", spec, tokens(4, spec, start=50_000))
    s.put("t", spec, other, make_kv(spec, 4, seed=2), session="other")

    with pytest.raises(ResourceExhausted, match="stays paused"):
        s.open_session("t", "chat")
    assert s.session_state("t", "chat") is SessionState.PAUSED
    assert _pinned(s, "t", keys) == [0, 0]
    assert s.lookup("t", spec, keys).tiers == ["dram", "dram"]
    s.close_session("t", "other")  # room again: the re-open goes through
    assert s.open_session("t", "chat") is SessionState.RESUMED
    assert s.lookup("t", spec, keys).tiers == ["hbm", "hbm"]


# -- the service ---------------------------------------------------------------------------------
def _state(c, method: str, sid: str, namespace: str = "") -> str:
    """The state the service answers to a session verb (the client's verbs return nothing)."""
    r = c._call(getattr(c._kv, method), pb.SessionRequest(session_id=sid, namespace=namespace))
    return pb.SessionState.Name(r.state)


def test_reopening_a_paused_session_pins_its_later_puts(tmp_path):
    """The prober's case: after a re-open, the session's next put is pinned in HBM and stays
    there while other puts push everything unpinned out of HBM."""
    from service_harness import start

    sc = start(tmp_path, store={"hbm_bytes": 8 * B, "dram_bytes": 8 * B, "nvme_bytes": 400 * B,
                                "policy": "lru"})
    try:
        c = sc.tenant("alice", local=False)
        k1 = c.block_keys(SPEC, fresh_tokens(2))
        c.open_session("s")
        c.put(SPEC, k1, random_kv(2), session="s")
        c.pause_session("s")
        assert _state(c, "OpenSession", "s") == "SESSION_STATE_RESUMED"
        assert sc.server.store.session_state("alice", "s") is SessionState.RESUMED

        k2 = c.block_keys(SPEC, fresh_tokens(3))
        c.put(SPEC, k2, random_kv(3, seed=5), session="s")
        for i in range(10):  # other traffic, more than HBM holds
            sc.clock.now += 1
            c.put(SPEC, c.block_keys(SPEC, fresh_tokens(3)), random_kv(3, seed=100 + i))
        assert c.lookup(SPEC, k2).tiers == ["hbm"] * 3
        assert c.lookup(SPEC, k1).tiers == ["hbm"] * 2
        assert _pinned(sc.server.store, "alice", k1 + k2) == [1] * 5
    finally:
        sc.stop()


def test_each_verb_answers_the_sessions_real_state(sidecar):
    c = sidecar.tenant("states", local=False)
    assert _state(c, "OpenSession", "s") == "SESSION_STATE_ACTIVE"
    assert _state(c, "OpenSession", "s") == "SESSION_STATE_ACTIVE"
    assert _state(c, "ResumeSession", "s") == "SESSION_STATE_ACTIVE"  # not paused: unchanged
    assert _state(c, "PauseSession", "s") == "SESSION_STATE_PAUSED"
    assert _state(c, "PauseSession", "s") == "SESSION_STATE_PAUSED"
    assert _state(c, "ResumeSession", "s") == "SESSION_STATE_RESUMED"
    assert _state(c, "PauseSession", "s") == "SESSION_STATE_PAUSED"
    assert _state(c, "OpenSession", "s") == "SESSION_STATE_RESUMED"
    assert _state(c, "CloseSession", "s") == "SESSION_STATE_CLOSED"


def test_a_failed_reopen_is_refused_and_the_session_stays_paused(tmp_path):
    from service_harness import start

    sc = start(tmp_path, store={"hbm_bytes": 4 * B, "dram_bytes": 8 * B, "nvme_bytes": 64 * B,
                                "policy": "lru"})
    try:
        c = sc.tenant("full", local=False)
        keys = c.block_keys(SPEC, fresh_tokens(2))
        c.open_session("chat")
        c.put(SPEC, keys, random_kv(2), session="chat")
        c.pause_session("chat")
        c.open_session("other")
        c.put(SPEC, c.block_keys(SPEC, fresh_tokens(4)), random_kv(4, seed=2), session="other")
        with pytest.raises(ResourceExhausted):
            c.open_session("chat")
        assert sc.server.store.session_state("full", "chat") is SessionState.PAUSED
        assert _state(c, "PauseSession", "chat") == "SESSION_STATE_PAUSED"
    finally:
        sc.stop()


# -- a publisher of several namespaces -----------------------------------------------------------
def test_a_publisher_of_two_namespaces_uses_sessions_in_one(sidecar):
    admin = sidecar.admin()
    pub = sidecar.client(admin.create_tenant("pub2", role="publisher", namespaces=["shared:a", "shared:b"]),
                         local=False)
    store = sidecar.server.store
    keys = pub.block_keys(SPEC, fresh_tokens(2), namespace="shared:a")

    pub.open_session("s", namespace="shared:a")
    assert store.session_state("shared:a", "s") is SessionState.ACTIVE
    pub.put(SPEC, keys, random_kv(2), session="s", namespace="shared:a")
    assert _pinned(store, "shared:a", keys) == [1, 1]
    pub.pause_session("s", namespace="shared:a")
    assert store.session_state("shared:a", "s") is SessionState.PAUSED
    assert _pinned(store, "shared:a", keys) == [0, 0]
    pub.resume_session("s", namespace="shared:a")
    assert store.session_state("shared:a", "s") is SessionState.RESUMED
    assert _pinned(store, "shared:a", keys) == [1, 1]
    assert pub.lookup(SPEC, keys, namespace="shared:a").tiers == ["hbm", "hbm"]
    pub.close_session("s", namespace="shared:a")
    assert _pinned(store, "shared:a", keys) == [0, 0]
    assert pub.lookup(SPEC, keys, namespace="shared:a").num_blocks == 2  # kept as prefix cache

    # the session lives in the namespace it was opened in, not in the other one
    pub.open_session("t", namespace="shared:a")
    with pytest.raises(Exception, match="unknown session"):
        pub.pause_session("t", namespace="shared:b")


def test_a_reader_of_a_shared_namespace_cannot_open_a_session_there(sidecar):
    admin = sidecar.admin()
    admin.create_tenant("pub1", role="publisher", namespaces=["shared:ro"])
    reader = sidecar.client(admin.create_tenant("reader1", namespaces=["shared:ro"]), local=False)
    with pytest.raises(PermissionDenied):
        reader.open_session("s", namespace="shared:ro")
    assert "s" not in {sid for _, sid in sidecar.server.store._sessions}
    # its own namespace, named or not, keeps working
    reader.open_session("mine")
    reader.open_session("mine2", namespace="reader1")
    assert sidecar.server.store.session_state("reader1", "mine2") is SessionState.ACTIVE
