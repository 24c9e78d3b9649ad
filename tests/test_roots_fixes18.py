"""Fixes to the independent-root-keys mode (``Target.roots``, ae0bf31), one test per bug the
prober found (/tmp/probe_roots): a roots get dropping keys of its own batch, chain links read as
roots through the remote tier, an old server not detected, the SGLang backend and repeated
pages, and the message of a repeated root."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from service_harness import SPEC, random_kv, start

from kvstore.keys import KEY_BYTES

torch.set_num_threads(1)


def _roots(n: int, tag: str) -> list[bytes]:
    """Keys no chain holds (as an engine hashing its own pages makes them)."""
    return [hashlib.blake2b(f"{tag}/page-{i}".encode(), digest_size=KEY_BYTES).digest() for i in range(n)]


def _page(spec, fill: int) -> np.ndarray:
    return np.full(spec.block_nbytes, fill, np.uint8)


# -- 1. a roots get never evicts keys of its own call ---------------------------------------------
def test_get_of_roots_serves_every_stored_key_of_its_batch_and_drops_none(open_store, spec):
    """8 roots put one at a time into HBM 2, DRAM 2, NVMe 8 blocks: all stored. Serving the
    batch promoted its first keys, whose room was made by pushing later keys of the same batch
    down until two fell off NVMe: [T,T,T,T,T,F,F,T], keys 5 and 6 gone."""
    s = open_store(spec, hbm_blocks=2, dram_blocks=2, nvme_blocks=8)
    keys = _roots(8, "evict")
    for i, k in enumerate(keys):
        s.put_bytes("a", spec, [k], [_page(spec, i + 1)], roots=True)
    assert None not in s.lookup_roots("a", spec, keys)

    outs = [np.zeros(spec.block_nbytes, np.uint8) for _ in keys]
    assert s.get_roots_into("a", spec, keys, outs) == [True] * 8
    assert [int(o[0]) for o in outs] == list(range(1, 9))
    assert None not in s.lookup_roots("a", spec, keys)  # nothing dropped

    lease, present = s.lease_roots("a", spec, keys, lambda i: np.zeros(spec.block_nbytes, np.uint8))
    try:
        assert present == [True] * 8
        assert [int(v[0]) for v in lease.views] == list(range(1, 9))
    finally:
        lease.release()
    assert None not in s.lookup_roots("a", spec, keys)


@pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])
def test_client_get_of_roots_drops_no_key_of_its_batch(tmp_path: Path, local: bool):
    nb = SPEC.block_nbytes
    sc = start(tmp_path, store={"hbm_bytes": nb, "dram_bytes": 0, "nvme_bytes": 4 * nb})
    try:
        c = sc.tenant("t", local=local)
        keys = _roots(4, f"svc{local}")
        kv = random_kv(4, seed=1)
        for i in range(4):
            c.put(SPEC, [keys[i]], kv[i:i + 1], roots=True)
        assert None not in c.lookup_roots(SPEC, keys)
        out = torch.zeros_like(kv)
        assert c.get_roots_into(SPEC, keys, out) == [True] * 4
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
        assert None not in c.lookup_roots(SPEC, keys)
    finally:
        sc.stop()


# -- 5. a repeated root is refused with words about roots -----------------------------------------
def test_a_repeated_root_is_refused_saying_roots_must_be_distinct(open_store, spec, sidecar):
    from kvstore.errors import InvalidArgument

    k = _roots(1, "dup")[0]
    s = open_store(spec)
    for put in (lambda: s.put_bytes("a", spec, [k, k], [_page(spec, 1)] * 2, roots=True),
                lambda: s.reserve_put("a", spec, [k, k], roots=True)):
        with pytest.raises(InvalidArgument, match="roots of a put must be distinct") as e:
            put()
        assert "chain" not in str(e.value)
    with pytest.raises(InvalidArgument, match="must be a chain"):  # a chain's message stays
        s.put_bytes("a", spec, [k, k], [_page(spec, 1)] * 2)
    for local in (True, False):
        c = sidecar.tenant(f"dup{int(local)}", local=local)
        with pytest.raises(InvalidArgument, match="roots of a put must be distinct"):
            c.put(SPEC, [k, k], random_kv(2), roots=True)


# -- 4. the SGLang backend: a batch naming a page twice -------------------------------------------
def _sglang_backend(sidecar, monkeypatch, shm: bool):
    import sglang_wheel

    try:
        sglang_wheel.load()
    except sglang_wheel.WheelUnavailable as exc:
        pytest.skip(f"sglang wheel unavailable, HiCache backend not checked: {exc}")
    from test_integration_sglang17 import attach, pools

    # SGLang's factory wraps backends in a random-failure proxy when these are set
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", raising=False)
    monkeypatch.delenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", raising=False)
    token = sidecar.admin().create_tenant(f"sgl-dup-{int(shm)}")
    return attach(sidecar, token, pools(3), extra_config={
        "backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
        "class_name": "KVStoreHiCacheStorage", "kvstore_target": sidecar.target, "kvstore_token": token,
        "kvstore_shared_memory": shm})


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "stream"])
def test_sglang_batch_naming_a_page_twice_stores_it_once_and_reports_every_page(sidecar, monkeypatch, shm):
    """batch_set_v1 / batch_set of [p0, p1, p0] raised InvalidArgument ("key 2 repeats an
    earlier key") into SGLang since the batch became one put(roots=True); the per-page loop
    before stored it: [True, True, True]."""
    from test_integration_sglang17 import idx

    b = _sglang_backend(sidecar, monkeypatch, shm)
    keys = ["p0", "p1", "p0"]
    assert b.batch_set_v1(keys, idx(range(3))) == [True, True, True]
    assert b.batch_exists(keys) == 3
    pages = [torch.full((b.spec.block_nbytes,), i + 1, dtype=torch.uint8) for i in range(3)]
    assert b.batch_set(["q0", "q1", "q0", "q1"], pages + pages[1:2]) is True
    assert b.batch_exists(["q0", "q1", "q0"]) == 3
    got = b.batch_get(["q1", "q0", "q1"], [torch.zeros(b.spec.block_nbytes, dtype=torch.uint8) for _ in range(3)])
    assert [int(g[0]) for g in got] == [2, 1, 2]  # the first value of a repeated page is stored
    assert b.batch_get_v1(["p1", "p0", "p1"], idx(range(3, 6))) == [True, True, True]


# -- 2. chain links are no roots through the remote tier ------------------------------------------
def _chain_on_a(servers, spec, a=None):
    a = a or servers("a")
    chain = a.block_keys("acme", spec, list(range(3 * spec.block_tokens)))
    data = [_page(spec, i + 1) for i in range(3)]
    a.put_bytes("acme", spec, chain, data)  # an ordinary chain: keys 1 and 2 are links
    a.flush()  # written through to Redis
    return a, chain, data


def test_chain_links_are_no_roots_through_the_remote_tier(servers, spec):
    """Server A holds a chain written through to Redis. A's lookup_roots answered its links
    'remote' (asked remotely though held here); B's answered all three present, its
    get_roots_into served the links and promoted them as roots (parent ROOT_KEY, depth 0), and a
    valid put of the chain on B then failed with InvalidArgument."""
    a, chain, data = _chain_on_a(servers, spec)
    assert a.lookup_roots("acme", spec, chain) == ["hbm", None, None]
    outs = [np.zeros(spec.block_nbytes, np.uint8) for _ in chain]
    assert a.get_roots_into("acme", spec, chain, outs) == [True, False, False]

    b = servers("b")
    assert b.lookup_roots("acme", spec, chain) == ["remote", None, None]
    lease, present = b.lease_roots("acme", spec, chain, lambda i: np.zeros(spec.block_nbytes, np.uint8))
    lease.release()
    assert present == [True, False, False]
    outs = [np.zeros(spec.block_nbytes, np.uint8) for _ in chain]
    assert b.get_roots_into("acme", spec, chain, outs) == [True, False, False]
    assert int(outs[0][0]) == 1 and not outs[1].any()
    assert b.lookup("acme", spec, chain).tiers == ["hbm", "remote", "remote"]  # the chain still is one
    b.put_bytes("acme", spec, chain, data)  # was InvalidArgument: links 1 and 2 stored as roots
    assert b.lookup("acme", spec, chain).tiers == ["hbm"] * 3

    # the older chain get of a link alone (as if a root) is a miss too, and promotes nothing
    c = servers("c")
    assert c.get_into("acme", spec, chain[1:2], [np.zeros(spec.block_nbytes, np.uint8)]) == 0
    assert c.lookup("acme", spec, chain[1:2]).num_blocks == 0
    c.put_bytes("acme", spec, chain, data)
    got = [np.zeros(spec.block_nbytes, np.uint8) for _ in chain]
    assert c.get_into("acme", spec, chain, got) == 3 and [int(g[0]) for g in got] == [1, 2, 3]


def test_a_chain_served_through_the_remote_tier_still_continues_from_its_parent(servers, spec):
    _a, chain, _ = _chain_on_a(servers, spec)
    b = servers("b")
    assert b.lookup("acme", spec, chain).tiers == ["remote"] * 3
    got = [np.zeros(spec.block_nbytes, np.uint8) for _ in chain]
    assert b.get_into("acme", spec, chain, got) == 3 and [int(g[0]) for g in got] == [1, 2, 3]
    assert b.lookup("acme", spec, chain).tiers == ["hbm"] * 3
    # a continuation split across calls (parent=) is checked against its parent too
    d = servers("d")
    assert d.lookup("acme", spec, chain[2:], parent=chain[1]).tiers == ["remote"]
    assert d.lookup("acme", spec, chain[2:], parent=chain[0]).num_blocks == 0


def test_a_remote_copy_that_records_no_parent_is_a_miss_to_roots_and_served_to_chains(servers, spec):
    """A copy written before the envelope recorded the parent (version 2) cannot say whether
    it is a root or a link: a roots call neither looks it up, serves nor promotes it (a miss is
    safe); a chain read serves it as before the upgrade (refusing it there made every copy
    written before the upgrade a miss until written again)."""
    import redis

    from tiers.base import BlockRef
    from tiers.remote_envelope import ENVELOPE, ENVELOPE_MAGIC, ENVELOPE_V2, split_value

    a = servers("a")
    root = _roots(1, "old")[0]
    a.put_bytes("acme", spec, [root], [_page(spec, 5)], roots=True)
    a, chain, _ = _chain_on_a(servers, spec, a)
    raw = redis.Redis.from_url(servers.url)
    try:
        for key in (root, *chain):  # rewrite each copy as version 2 wrote it
            rk = a._remote.redis_key(BlockRef("acme", key, spec))
            value = raw.get(rk)
            _, info = split_value(value)
            assert info.parent == (chain[chain.index(key) - 1] if key in chain[1:] else bytes(KEY_BYTES))
            raw.set(rk, ENVELOPE_V2.pack(ENVELOPE_MAGIC, 2, float("nan"), float("nan"), bytes(8))
                    + value[ENVELOPE.size:])
            assert split_value(raw.get(rk))[1].parent is None
    finally:
        raw.close()
    b = servers("b")
    assert b.lookup_roots("acme", spec, [root, *chain]) == [None] * 4
    outs = [np.zeros(spec.block_nbytes, np.uint8) for _ in range(4)]
    assert b.get_roots_into("acme", spec, [root, *chain], outs) == [False] * 4
    assert not any(o.any() for o in outs)  # a miss leaves its buffer alone
    assert b.lookup_roots("acme", spec, [root]) == [None]  # nothing promoted
    assert b.lookup("acme", spec, chain).tiers == ["remote"] * 3
    assert b.get_into("acme", spec, chain, outs[:3]) == 3
    assert b.lookup("acme", spec, chain).num_blocks == 3  # promoted here as the chain it is


# -- 3. a server without roots is found out before the first call with roots ----------------------
def _whoami_calls(sc) -> float:
    return sc.server.metrics_registry.get_sample_value("kvstore_requests_total", {"rpc": "WhoAmI", "code": "OK"}) or 0.0


@pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])
def test_client_refuses_roots_against_a_server_that_predates_them(tmp_path: Path, monkeypatch, local: bool):
    """A server that ignores Target.roots (an old one drops the unknown field) stored a put of
    roots as a chain and returned OK; a lookup of that batch answered every key present (n
    codes for a chain of n keys), a lookup of one page alone raised. The client now asks once
    whether the server takes roots (WhoAmIResponse.supports_roots, absent from an old server's
    answer) and refuses every roots verb there with FailedPrecondition, storing nothing."""
    from kvstore import service_data, servicer_kv
    from kvstore.errors import FailedPrecondition
    from proto.kvstore.v1 import kvstore_pb2 as pb

    real_resolve, real_whoami = service_data.DataPlane.resolve, servicer_kv.KVStoreServicer.WhoAmI
    old = [True]  # the sidecar predates roots until it is "upgraded" below

    def old_resolve(self, principal, target, **kw):
        if old[0]:
            t = pb.Target()
            t.CopyFrom(target)
            t.ClearField("roots")  # what protobuf does with a field it does not know
            target = t
        return real_resolve(self, principal, target, **kw)

    def old_whoami(self, request, context):
        r = real_whoami(self, request, context)
        if old[0]:
            r.ClearField("supports_roots")  # an old server's answer has no such field
        return r

    monkeypatch.setattr(service_data.DataPlane, "resolve", old_resolve)
    monkeypatch.setattr(servicer_kv.KVStoreServicer, "WhoAmI", old_whoami)  # bound as the server starts
    sc = start(tmp_path)
    try:
        c = sc.tenant("old", local=local)
        keys = _roots(3, f"old{local}")
        kv = random_kv(3, seed=2)
        for verb in (lambda: c.put(SPEC, keys, kv, roots=True),
                     lambda: c.put_bytes(SPEC, keys, kv.view(torch.uint8).reshape(3, -1).numpy(), roots=True),
                     lambda: c.lookup_roots(SPEC, keys),
                     lambda: c.lookup_roots(SPEC, keys[1:2]),
                     lambda: c.get_roots_into(SPEC, keys, torch.zeros_like(kv))):
            with pytest.raises(FailedPrecondition, match="does not support independent root keys"):
                verb()
        assert c.lookup(SPEC, keys).num_blocks == 0  # nothing was stored, as a chain or otherwise

        # the sidecar upgraded: the same client asks again, and then only once
        old[0] = False
        asked = _whoami_calls(sc)
        c.put(SPEC, keys, kv, roots=True)
        assert c.lookup_roots(SPEC, keys) == ["hbm"] * 3
        assert c.get_roots_into(SPEC, keys, torch.zeros_like(kv)) == [True] * 3
        assert _whoami_calls(sc) == asked + 1
        assert c.whoami()["principal"]  # the public verb is unchanged
    finally:
        sc.stop()
