"""Independent root keys (``Target.roots``): many one-block prefixes looked up, put and got in
one call, each key answered as a call of that key alone would be, at every level (Store,
service, client on both data planes). Why: an engine whose pages are roots (SGLang's HiCache)
paid one RPC per page."""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
import torch
from conftest import make_kv
from service_harness import SPEC, fresh_tokens, random_kv

from kvstore.errors import InvalidArgument, ResourceExhausted
from kvstore.keys import KEY_BYTES
from kvstore.spec import ModelSpec
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

torch.set_num_threads(1)
#: the spec of conftest's ``servers`` (the Stores sharing a remote tier)
SPEC_REMOTE = ModelSpec(model="m", revision="r1", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                        block_tokens=4)


def _roots(n: int, tag: str = "") -> list[bytes]:
    """Keys no chain holds (as an engine hashing its own pages makes them)."""
    return [hashlib.blake2b(f"{tag}/page-{i}".encode(), digest_size=KEY_BYTES).digest() for i in range(n)]


# -- Store ----------------------------------------------------------------------------------------
def test_store_put_of_roots_stores_each_key_as_its_own_prefix(open_store, spec):
    s = open_store(spec)
    keys = _roots(4, "store")
    kv = make_kv(spec, 4)
    s.put("a", spec, keys, kv, roots=True)

    # each key alone is a one-block prefix; as a chain they are not one
    assert [s.lookup("a", spec, [k]).num_blocks for k in keys] == [1, 1, 1, 1]
    assert s.lookup("a", spec, keys).num_blocks == 1
    assert s.lookup_roots("a", spec, keys) == ["hbm"] * 4
    outs = [torch.zeros_like(kv[0]) for _ in keys]
    assert s.get_roots_into("a", spec, keys, outs) == [True] * 4
    assert all(torch.equal(o, k) for o, k in zip(outs, kv))


def test_store_roots_answer_each_key_a_miss_in_the_middle_included(open_store, spec):
    s = open_store(spec)
    keys = _roots(5, "holes")
    kv = make_kv(spec, 5, seed=3)
    s.put_bytes("a", spec, [keys[0], keys[2], keys[4]],
                [kv[i].view(torch.uint8).flatten().numpy() for i in (0, 2, 4)], roots=True)

    assert s.lookup_roots("a", spec, keys) == ["hbm", None, "hbm", None, "hbm"]
    outs = [torch.full_like(kv[0], 7) for _ in keys]
    assert s.get_roots_into("a", spec, keys, outs) == [True, False, True, False, True]
    assert torch.equal(outs[2], kv[2]) and torch.equal(outs[4], kv[4])
    assert torch.equal(outs[1], torch.full_like(kv[0], 7))  # a miss leaves its buffer alone
    lease, present = s.lease_roots("a", spec, keys, lambda i: np.empty(spec.block_nbytes, np.uint8))
    try:
        assert present == [True, False, True, False, True]
        assert [bytes(v) for v in lease.views] == [kv[i].view(torch.uint8).flatten().numpy().tobytes()
                                                 for i in (0, 2, 4)]
    finally:
        lease.release()


def test_store_roots_never_see_chain_links_or_another_tenant(open_store, spec):
    s = open_store(spec)
    chain = s.block_keys("a", spec, list(range(3 * spec.block_tokens)))
    s.put("a", spec, chain, make_kv(spec, 3))
    # the first block of a chain is a root; the links after it are not
    assert s.lookup_roots("a", spec, chain) == ["hbm", None, None]
    keys = _roots(2, "tenant")
    s.put("a", spec, keys, make_kv(spec, 2), roots=True)
    assert s.lookup_roots("b", spec, keys) == [None, None]
    assert s.get_roots_into("b", spec, keys, [np.zeros(spec.block_nbytes, np.uint8) for _ in keys]) == [False] * 2
    # a root put of a key stored as a chain's link is refused, nothing stored
    with pytest.raises(InvalidArgument, match="another fingerprint or parent"):
        s.put("a", spec, [_roots(1, "new")[0], chain[1]], make_kv(spec, 2), roots=True)
    assert s.lookup_roots("a", spec, _roots(1, "new")) == [None]


def test_store_roots_refuse_a_parent_repeated_keys_and_a_non_bool(open_store, spec):
    s = open_store(spec)
    keys = _roots(2, "bad")
    kv = make_kv(spec, 2)
    with pytest.raises(InvalidArgument, match="roots take no parent"):
        s.put("a", spec, keys, kv, roots=True, parent=_roots(1, "p")[0])
    with pytest.raises(InvalidArgument, match="repeats an earlier key"):
        s.put("a", spec, [keys[0], keys[0]], kv, roots=True)
    with pytest.raises(InvalidArgument, match="roots must be True or False"):
        s.put("a", spec, keys, kv, roots="yes")
    with pytest.raises(InvalidArgument, match="roots take no parent"):
        s.reserve_put("a", spec, keys, parent=_roots(1, "p")[0], roots=True)
    assert s.lookup_roots("a", spec, keys) == [None, None]


def test_store_roots_put_is_all_or_nothing_within_the_tenant_quota(open_store, spec):
    """A put of roots the tenant's quota cannot hold is refused whole, as a chain's put."""
    from kvstore.block import Tier

    s = open_store(spec, hbm_blocks=4, dram_blocks=0, nvme_blocks=0)
    s.set_tenant_policy("a", quota_bytes={Tier.HBM: 2 * spec.block_nbytes})
    keys = _roots(3, "quota")
    with pytest.raises(ResourceExhausted):
        s.put("a", spec, keys, make_kv(spec, 3), roots=True)
    assert s.lookup_roots("a", spec, keys) == [None] * 3
    s.put("a", spec, keys[:2], make_kv(spec, 2), roots=True)
    assert s.lookup_roots("a", spec, keys) == ["hbm", "hbm", None]


def test_store_reserved_put_of_roots_commits_roots(open_store, spec):
    s = open_store(spec)
    keys = _roots(3, "reserve")
    kv = make_kv(spec, 3, seed=5)
    rows = kv.view(torch.uint8).reshape(3, -1).numpy()
    res = s.reserve_put("a", spec, keys, roots=True)
    assert res.views == [None, None, None]  # the bytes wait outside the tiers
    s.commit_put(res, rows.__getitem__)
    assert s.lookup_roots("a", spec, keys) == ["hbm"] * 3
    assert [s.lookup("a", spec, [k]).num_blocks for k in keys] == [1, 1, 1]


def test_store_roots_put_on_one_server_are_found_and_served_by_another_through_remote(servers):
    """Roots written through to the remote tier by server A: B's lookup of roots answers
    "remote" for them (a miss elsewhere), its get serves them bit-exact and promotes them,
    for the same tenant only."""
    a, b = servers("a"), servers("b")
    spec = SPEC_REMOTE
    keys = _roots(4, "remote")
    kv = make_kv(spec, 4, seed=9)
    a.put("acme", spec, [keys[0], keys[1], keys[3]], kv[[0, 1, 3]], roots=True)
    a.flush()  # the write-through queue drained

    assert b.lookup_roots("acme", spec, keys) == ["remote", "remote", None, "remote"]
    outs = [torch.zeros_like(kv[0]) for _ in keys]
    assert b.get_roots_into("acme", spec, keys, outs) == [True, True, False, True]
    assert all(torch.equal(outs[i], kv[i]) for i in (0, 1, 3))
    assert b.lookup_roots("acme", spec, keys) == ["hbm", "hbm", None, "hbm"]  # promoted on hit
    assert b.lookup_roots("globex", spec, keys) == [None] * 4


def test_store_roots_put_with_a_session_pins_them(open_store, spec):
    s = open_store(spec, hbm_blocks=4, dram_blocks=4)
    s.open_session("a", "s1")
    keys = _roots(2, "session")
    s.put("a", spec, keys, make_kv(spec, 2), roots=True, session="s1")
    assert s.lookup_roots("a", spec, keys) == ["hbm", "hbm"]
    s.pause_session("a", "s1")
    assert s.lookup_roots("a", spec, keys) == ["dram", "dram"]


# -- service and client ---------------------------------------------------------------------------
@pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])
def test_client_roots_round_trip_in_one_rpc_each(sidecar, local):
    c = sidecar.tenant(f"roots-{int(local)}", local=local)
    assert c.uses_shared_memory == local
    keys = _roots(6, f"rt{local}")
    kv = random_kv(6, seed=21)
    stored = [0, 1, 3, 5]
    c.put(SPEC, [keys[i] for i in stored], kv[stored], roots=True)

    assert c.lookup_roots(SPEC, keys) == ["hbm", "hbm", None, "hbm", None, "hbm"]
    out = torch.full_like(kv, 3)
    assert c.get_roots_into(SPEC, keys, out) == [True, True, False, True, False, True]
    for i in range(6):
        want = kv[i] if i in stored else torch.full_like(kv[i], 3)
        assert torch.equal(out[i].view(torch.int16), want.view(torch.int16)), i
    # a list of buffers, and bytes put as raw rows
    rows = np.zeros((6, SPEC.block_nbytes), np.uint8)
    assert c.get_roots_into(SPEC, keys, list(rows)) == [True, True, False, True, False, True]
    assert rows[3].tobytes() == kv[3].view(torch.uint8).numpy().tobytes()
    c.put_bytes(SPEC, [keys[2]], rows[3:4], roots=True)
    assert c.lookup_roots(SPEC, keys)[2] == "hbm"


def _requests(sc, rpc: str) -> float:
    """``rpc`` calls the sidecar answered OK so far."""
    return sc.server.metrics_registry.get_sample_value("kvstore_requests_total", {"rpc": rpc, "code": "OK"}) or 0.0


def test_client_roots_in_the_shared_region_move_with_one_copy(sidecar):
    """Buffers from ``local_blocks``: the server reads and writes each root in its own slot
    (a miss leaves its slot alone), in one GetLocal. The two buffers fill the region: a get
    staged through its free part would have gone in-band."""
    c = sidecar.tenant("roots-local-blocks", local=True, region_bytes=8 * SPEC.block_nbytes)
    keys = _roots(4, "slots")
    kv = random_kv(4, seed=13)
    with c.local_blocks(SPEC, 4) as src, c.local_blocks(SPEC, 4) as dst:
        src.tensor.copy_(kv)
        c.put(SPEC, keys[:2] + keys[3:], src.tensor[[0, 1, 3]], roots=True)  # staged (a copy of the rows)
        c.put(SPEC, keys[2:3], src.tensor[2:3], roots=True)  # in the region: its slot as it is
        c.delete(keys[1:2])
        dst.tensor.fill_(5)
        before = _requests(sidecar, "GetLocal"), _requests(sidecar, "Get")
        assert c.get_roots_into(SPEC, keys, dst.tensor) == [True, False, True, True]
        assert (_requests(sidecar, "GetLocal"), _requests(sidecar, "Get")) == (before[0] + 1, before[1])
        assert torch.equal(dst.tensor[[0, 2, 3]].view(torch.int16), kv[[0, 2, 3]].view(torch.int16))
        assert torch.equal(dst.tensor[1], torch.full_like(kv[1], 5))


def test_client_roots_staged_get_larger_than_the_region_goes_in_pieces(sidecar):
    c = sidecar.tenant("roots-pieces", local=True, region_bytes=3 * SPEC.block_nbytes)
    keys = _roots(7, "pieces")
    kv = random_kv(7, seed=4)
    c.put(SPEC, keys[::2], kv[::2], roots=True)  # 4 blocks: more than the region, in-band whole
    out = torch.zeros_like(kv)
    assert c.get_roots_into(SPEC, keys, out) == [True, False, True, False, True, False, True]
    assert torch.equal(out[::2].view(torch.int16), kv[::2].view(torch.int16))


def test_get_of_roots_past_the_stream_limit_goes_on_from_the_first_key_not_answered(tmp_path):
    from service_harness import start

    sc = start(tmp_path, limits={"max_stream_bytes": 2 * SPEC.block_nbytes})
    try:
        c = sc.tenant("roots-limit", local=False)
        keys = _roots(5, "limit")
        kv = random_kv(5, seed=8)
        c.put(SPEC, keys[:2], kv[:2], roots=True)
        c.put(SPEC, keys[3:], kv[3:], roots=True)
        out = torch.zeros_like(kv)
        assert c.get_roots_into(SPEC, keys, out) == [True, True, False, True, True]
        assert torch.equal(out[3:].view(torch.int16), kv[3:].view(torch.int16))
    finally:
        sc.stop()


def test_roots_of_one_tenant_are_misses_for_another(sidecar):
    a, b = sidecar.tenant("roots-a", local=False), sidecar.tenant("roots-b", local=False)
    keys = _roots(3, "iso")
    a.put(SPEC, keys, random_kv(3), roots=True)
    assert b.lookup_roots(SPEC, keys) == [None] * 3
    assert b.get_roots_into(SPEC, keys, torch.zeros((3, *SPEC.block_shape), dtype=SPEC.torch_dtype)) == [False] * 3
    assert a.lookup_roots(SPEC, keys) == ["hbm"] * 3


def test_client_refuses_roots_with_a_parent_before_any_rpc(sidecar):
    c = sidecar.tenant("roots-client-bad", local=False)
    keys = _roots(2, "cbad")
    with pytest.raises(InvalidArgument, match="roots take no parent"):
        c.put(SPEC, keys, random_kv(2), roots=True, parent=_roots(1, "p")[0])
    assert c.lookup_roots(SPEC, []) == []


def _raw(sidecar, name: str):
    token = sidecar.admin().create_tenant(name)
    channel = grpc.insecure_channel(sidecar.target)
    return channel, kvstore_pb2_grpc.KVStoreStub(channel), (("authorization", f"Bearer {token}"),)


def test_the_service_refuses_malformed_roots_with_invalid_argument(sidecar):
    from kvstore.service_convert import spec_to_pb

    channel, kv, md = _raw(sidecar, "roots-raw")
    try:
        spec = spec_to_pb(SPEC)
        bad = [
            pb.Target(spec=spec, roots=True, tokens=pb.TokenIds(ids=fresh_tokens(2))),
            pb.Target(spec=spec, roots=True, keys=b"".join(_roots(2, "r")), parent=_roots(1, "p")[0]),
            pb.Target(spec=spec, roots=True, keys=b"x" * 33),
        ]
        for target in bad:
            with pytest.raises(grpc.RpcError) as err:
                kv.Lookup(pb.LookupRequest(target=target), metadata=md)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, target
        with pytest.raises(grpc.RpcError) as err:
            kv.Prefetch(pb.PrefetchRequest(target=pb.Target(spec=spec, roots=True, keys=_roots(1, "f")[0])),
                        metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "roots" in err.value.details()
    finally:
        channel.close()


def test_roots_lookup_answers_one_tier_code_per_key_and_respects_the_key_limit(tmp_path):
    from service_harness import start

    from kvstore.service_convert import spec_to_pb

    sc = start(tmp_path, limits={"max_keys_per_call": 4})
    channel, kv, md = _raw(sc, "roots-codes")
    try:
        c = sc.tenant("roots-codes2", local=False)
        keys = _roots(3, "codes")
        c.put(SPEC, keys[1:2], random_kv(1), roots=True)
        assert c.lookup_roots(SPEC, keys) == [None, "hbm", None]
        r = kv.Lookup(pb.LookupRequest(target=pb.Target(spec=spec_to_pb(SPEC), roots=True,
                                                        keys=b"".join(keys))), metadata=md)
        assert (r.num_blocks, r.tier_codes) == (0, bytes(3))  # another tenant: all absent
        with pytest.raises(InvalidArgument, match="max_keys_per_call"):
            c.lookup_roots(SPEC, _roots(5, "many"))
        with pytest.raises(InvalidArgument, match="max_keys_per_call"):
            c.put(SPEC, _roots(5, "many"), random_kv(5), roots=True)
    finally:
        channel.close()
        sc.stop()
