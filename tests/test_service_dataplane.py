"""Put/Get through both data planes, sessions, prefetch, delete, TTL and restart, end to end."""

from __future__ import annotations

import itertools
import os
import threading
import time

import grpc
import pytest
import torch
import xxhash
from service_harness import SPEC, fresh_tokens, random_kv, restart, start

from kvstore.errors import InvalidArgument, KVStoreError, NotFound
from kvstore.spec import ModelSpec
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

torch.set_num_threads(1)


@pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])
def test_put_get_bit_exact_through_each_plane(sidecar, local):
    c = sidecar.tenant(f"t-{int(local)}", local=local)
    assert c.uses_shared_memory is local
    keys = c.block_keys(SPEC, fresh_tokens(5))
    assert len(keys) == 5
    kv = random_kv(5, seed=3)
    c.put(SPEC, keys, kv)

    hit = c.lookup(SPEC, keys)
    assert hit.num_blocks == 5 and len(hit.tiers) == 5
    got = c.get(SPEC, keys)
    assert got.dtype == kv.dtype and torch.equal(got.view(torch.int16), kv.view(torch.int16))


@pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])
def test_a_non_positive_ttl_is_invalid_and_stores_nothing(sidecar, local):
    from kvstore.errors import InvalidArgument

    c = sidecar.tenant(f"ttl-{int(local)}", local=local)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    for ttl in (0.0, -5.0):
        with pytest.raises(InvalidArgument, match="ttl_s"):
            c.put(SPEC, keys, random_kv(2), ttl_s=ttl)
    assert c.lookup(SPEC, keys).num_blocks == 0
    assert _hbm_used(sidecar) == 0


def test_blocks_larger_than_a_chunk_stream_in_pieces(sidecar):
    spec = ModelSpec(model="big", revision="r", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16")
    c = sidecar.tenant("chunky", local=False, chunk_bytes=16 * 1024)
    assert spec.block_nbytes > 16 * 1024
    keys = c.block_keys(spec, fresh_tokens(3, spec))
    kv = random_kv(3, spec, seed=9)
    c.put(spec, keys, kv)
    assert torch.equal(c.get(spec, keys).view(torch.int16), kv.view(torch.int16))


def test_a_chunk_that_leaves_no_room_for_framing_is_refused_up_front(sidecar):
    from kvstore.client import Client
    from kvstore.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="chunk_bytes"):
        Client(sidecar.target, "unused", local=False, chunk_bytes=4 << 20, max_message_bytes=4 << 20)


def test_local_blocks_move_with_one_copy_and_round_trip(sidecar):
    c = sidecar.tenant("zerocopy", local=True)
    keys = c.block_keys(SPEC, fresh_tokens(4))
    kv = random_kv(4, seed=5)
    with c.local_blocks(SPEC, 4) as src, c.local_blocks(SPEC, 4) as dst:
        src.tensor.copy_(kv)
        c.put(SPEC, keys, src.tensor)
        assert c.get_into(SPEC, keys, dst.tensor) == 4
        assert torch.equal(dst.tensor.view(torch.int16), kv.view(torch.int16))


@pytest.mark.parametrize("local", [True, False], ids=["shm", "stream"])
def test_get_into_a_non_contiguous_output_fills_it_and_keeps_the_rest(sidecar, local):
    """An output get_into cannot write in place (here a transposed view; a device tensor goes
    the same way) is filled through a host copy; blocks past the prefix keep their values."""
    import numpy as np

    from kvstore.errors import InvalidArgument

    c = sidecar.tenant(f"strided-{int(local)}", local=local)
    keys = c.block_keys(SPEC, fresh_tokens(4))
    kv = random_kv(4, seed=11)
    c.put(SPEC, keys[:3], kv[:3])
    base = torch.full((*reversed(kv.shape[1:]), 4), 7.0, dtype=kv.dtype)
    out = base.permute(*range(base.dim() - 1, -1, -1))  # [4, ...] over memory laid out backwards
    assert out.shape == kv.shape and not out.is_contiguous()
    assert c.get_into(SPEC, keys, out) == 3
    assert torch.equal(out[:3].view(torch.int16), kv[:3].view(torch.int16))
    assert bool((out[3] == 7.0).all())
    arr = np.full((kv.shape[0] * 2, *kv.shape[1:]), 5, np.int16)[::2]  # a strided numpy view
    assert c.get_into(SPEC, keys, arr) == 3
    assert np.array_equal(arr[:3], kv[:3].view(torch.int16).numpy()) and (arr[3] == 5).all()
    frozen = np.zeros(kv.shape, np.int16)
    frozen.setflags(write=False)
    with pytest.raises(InvalidArgument, match="read-only"):
        c.get_into(SPEC, keys, frozen)


def test_lookup_by_token_ids_returns_keys_and_longest_prefix(sidecar):
    c = sidecar.tenant("prefix")
    tokens = fresh_tokens(4)
    keys = c.block_keys(SPEC, tokens)
    c.put(SPEC, keys[:2], random_kv(2))
    hit = c.lookup(SPEC, token_ids=tokens)
    assert hit.num_blocks == 2
    assert hit.keys == keys
    assert len(c.get(SPEC, keys)) == 2  # a miss stops the prefix


def test_sessions_follow_their_states_and_unknown_is_not_found(sidecar):
    c = sidecar.tenant("sess")
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.open_session("s1")
    c.put(SPEC, keys, random_kv(2), session="s1")
    assert c.lookup(SPEC, keys).tiers == ["hbm", "hbm"]
    c.pause_session("s1")
    assert c.lookup(SPEC, keys).tiers == ["dram", "dram"]
    c.resume_session("s1")
    assert c.lookup(SPEC, keys).tiers == ["hbm", "hbm"]
    c.close_session("s1")
    with pytest.raises(NotFound):
        c.pause_session("s1")
    with pytest.raises(NotFound):
        c.put(SPEC, c.block_keys(SPEC, fresh_tokens(1)), random_kv(1), session="nope")


def test_prefetch_brings_blocks_up(sidecar):
    c = sidecar.tenant("pf")
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.open_session("s")
    c.put(SPEC, keys, random_kv(2), session="s")
    c.pause_session("s")
    assert c.lookup(SPEC, keys).tiers == ["dram", "dram"]
    c.close_session("s")
    assert c.prefetch(SPEC, keys, "hbm") == 2
    assert c.lookup(SPEC, keys).tiers == ["hbm", "hbm"]


def test_delete_removes_blocks_and_is_audited(sidecar):
    c = sidecar.tenant("del")
    keys = c.block_keys(SPEC, fresh_tokens(3))
    c.put(SPEC, keys, random_kv(3))
    assert c.delete(keys[1:2]) == 2  # the block and its descendant
    assert c.lookup(SPEC, keys).num_blocks == 1
    entries = sidecar.admin().audit()
    assert any(e["action"] == "blocks.delete" and e["principal"] == "del" and e["target"] == "del"
               and e["result"] == "OK" for e in entries)
    # refused or malformed deletions are recorded too (they were not)
    sidecar.tenant("other")
    with pytest.raises(KVStoreError):
        c.delete(keys[:1], namespace="other")
    with pytest.raises(InvalidArgument):
        c._call(c._kv.Delete, pb.DeleteRequest(keys=b"12345"))
    refused = [(e["target"], e["result"], e["detail"]) for e in sidecar.admin().audit()
               if e["action"] == "blocks.delete" and e["principal"] == "del" and e["result"] not in ("OK", "STARTED")]
    assert refused == [("other", "PERMISSION_DENIED", "1 keys"), ("del", "INVALID_ARGUMENT", "5 bytes of keys")]
    # a refused delete whose record cannot be written still says why it was refused
    from kvstore.errors import FailedPrecondition, PermissionDenied

    def broken(*args, **kw):
        raise FailedPrecondition("the audit log cannot be written")

    sidecar.server.data.audit.append = broken
    try:
        with pytest.raises(PermissionDenied):  # was INTERNAL (an UnboundLocalError)
            c.delete(keys[:1], namespace="other")
    finally:
        del sidecar.server.data.audit.append


def test_ttl_expiry_through_the_service(sidecar):
    admin = sidecar.admin()
    c = sidecar.client(admin.create_tenant("ttl"))
    admin.set_policy("ttl", ttl_s=60.0)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    c.put(SPEC, keys, random_kv(2))
    short = c.block_keys(SPEC, fresh_tokens(1))
    c.put(SPEC, short, random_kv(1), ttl_s=5.0)
    sidecar.clock.now += 30
    assert c.lookup(SPEC, keys).num_blocks == 2
    assert c.lookup(SPEC, short).num_blocks == 0
    sidecar.clock.now += 31
    assert c.lookup(SPEC, keys).num_blocks == 0
    assert len(c.get(SPEC, keys)) == 0


def test_restart_keeps_nvme_blocks_tokens_and_policies(tmp_path):
    sc = start(tmp_path)
    admin = sc.admin()
    token = admin.create_tenant("durable")
    admin.set_policy("durable", quota_bytes={"nvme": 1 << 28})
    c = sc.client(token)
    keys = c.block_keys(SPEC, fresh_tokens(3))
    kv = random_kv(3, seed=11)
    c.put(SPEC, keys, kv)
    sc = restart(sc)
    try:
        c = sc.client(token)
        hit = c.lookup(SPEC, keys)
        assert hit.num_blocks == 3
        assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
        assert sc.admin().get_policy("durable")["quota_bytes"] == {"nvme": 1 << 28}
    finally:
        sc.stop()


def _hbm_used(sidecar) -> int:
    return sidecar.server.store.stats()["tiers"]["hbm"]["used_bytes"]


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_cancelled_put_leaves_nothing_visible(sidecar):
    token = sidecar.admin().create_tenant("cancel")
    c = sidecar.client(token, local=False)
    keys = c.block_keys(SPEC, fresh_tokens(3))
    release = threading.Event()
    before = _hbm_used(sidecar)
    reserved = []

    def messages():
        yield pb.PutFrame(header=pb.PutHeader(target=pb.Target(spec=_spec_pb(), keys=b"".join(keys))))
        data = bytes(SPEC.block_nbytes)
        yield pb.PutFrame(block=0, offset=0, data=data, xxh3=xxhash.xxh3_64_intdigest(data))
        # the server reserved a tier slot per block; the stream stalls, the client cancels it
        reserved.append(_wait_for(lambda: _hbm_used(sidecar) == before + 3 * SPEC.block_nbytes))
        release.wait(5)

    with grpc.insecure_channel(sidecar.target) as ch:
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        future = stub.Put.future(messages(), metadata=(("authorization", f"Bearer {token}"),))
        threading.Timer(0.3, future.cancel).start()
        with pytest.raises(grpc.FutureCancelledError):
            future.result(timeout=5)
        release.set()
    assert c.lookup(SPEC, keys).num_blocks == 0
    assert reserved == [True]
    assert _wait_for(lambda: _hbm_used(sidecar) == before)  # every reserved byte given back


def test_deadline_exceeded_put_leaves_nothing_visible(sidecar):
    token = sidecar.admin().create_tenant("deadline")
    c = sidecar.client(token, local=False)
    keys = c.block_keys(SPEC, fresh_tokens(2))

    def messages():
        yield pb.PutFrame(header=pb.PutHeader(target=pb.Target(spec=_spec_pb(), keys=b"".join(keys))))
        threading.Event().wait(1.0)

    with grpc.insecure_channel(sidecar.target) as ch:
        stub = kvstore_pb2_grpc.KVStoreStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Put(messages(), metadata=(("authorization", f"Bearer {token}"),), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert c.lookup(SPEC, keys).num_blocks == 0


def test_stats_are_scoped_to_the_caller(sidecar):
    a = sidecar.tenant("stats-a")
    b = sidecar.tenant("stats-b")
    a.put(SPEC, a.block_keys(SPEC, fresh_tokens(1)), random_kv(1))
    b.put(SPEC, b.block_keys(SPEC, fresh_tokens(1)), random_kv(1))
    seen = a.stats()
    assert "stats-a" in seen["tenants"] and "stats-b" not in seen["tenants"]
    assert {"stats-a", "stats-b"} <= set(sidecar.admin().stats()["tenants"])
    # nothing store-wide: b's activity does not move what a sees
    assert set(seen) == {"tenants", "tiers"} and all(set(v) == {"capacity_bytes"} for v in seen["tiers"].values())
    k = b.block_keys(SPEC, fresh_tokens(1))
    b.put(SPEC, k, random_kv(1))
    b.get(SPEC, k)
    b.delete(k)
    assert a.stats() == seen


def _spec_pb():
    from kvstore.client import spec_to_pb

    return spec_to_pb(SPEC)


def test_client_errors_are_typed(sidecar):
    c = sidecar.tenant("typed")
    with pytest.raises(KVStoreError) as err:
        c.resume_session("missing")
    assert err.value.code == "NOT_FOUND"


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_shared_memory_copies_run_outside_the_store_lock(tmp_path, copy_threads):
    """Shared-memory Put and Get copy between the region and the tiers with the Store's lock
    free (another thread takes it meanwhile), over ``copy_threads``, bit-exact across tiers
    (a small HBM sends part of the chain to DRAM and NVMe, decoded straight into the slots)."""
    from service_harness import start

    sc = start(tmp_path, copy_threads=copy_threads,
               store={"hbm_bytes": 3 * SPEC.block_nbytes, "dram_bytes": 3 * SPEC.block_nbytes})
    try:
        data, store = sc.server.data, sc.server.store
        copied: list[int] = []
        real = data._copy

        def take_and_give() -> bool:
            if not store._lock.acquire(timeout=5):
                return False
            store._lock.release()
            return True

        def checked(pairs):
            taken: list[bool] = []
            t = threading.Thread(target=lambda: taken.append(take_and_give()))
            t.start()
            t.join()
            assert taken == [True], "the Store's lock is held while the blocks are copied"
            copied.append(len(pairs))
            real(pairs)

        data._copy = checked
        c = sc.tenant("shm-lockfree", local=True)
        assert c.uses_shared_memory
        keys = c.block_keys(SPEC, fresh_tokens(8))
        kv = random_kv(8, seed=21)
        c.put(SPEC, keys, kv)  # staged through the region: a PutLocal all the same
        tiers = c.lookup(SPEC, keys).tiers
        assert len(tiers) == 8 and "hbm" in tiers and tiers != ["hbm"] * 8
        assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
        assert len(copied) == 2 and copied[0] > 0 and copied[1] > 0
    finally:
        sc.stop()


# -- in-band frames packed across blocks -----------------------------------------------------------
_KV = "/kvstore.v1.KVStore/"


def _frames_stub(sidecar, name: str):
    """(client, raw Put of encoded frames, raw Get decoding frames, call metadata) of a new tenant."""
    from kvstore.frames import decoder

    token = sidecar.admin().create_tenant(name)
    c = sidecar.client(token, local=False)
    ch = grpc.insecure_channel(sidecar.target)
    sidecar.clients.append(ch)  # closed with the sidecar
    put = ch.stream_unary(_KV + "Put", request_serializer=None, response_deserializer=pb.PutResponse.FromString)
    get = ch.unary_stream(_KV + "Get", request_serializer=pb.GetRequest.SerializeToString,
                          response_deserializer=decoder(pb.GetFrame))
    return c, put, get, (("authorization", f"Bearer {token}"),)


def _put_header(keys: list[bytes]) -> bytes:
    from kvstore.frames import encode

    return encode(pb.PutFrame(header=pb.PutHeader(target=pb.Target(spec=_spec_pb(), keys=b"".join(keys)))))


def _spans(flat: bytes, nbytes: int, cuts: list[int]) -> list[bytes]:
    """Put frames of ``flat`` (the blocks' bytes) cut at the stream positions ``cuts``."""
    from kvstore.frames import data_frame

    edges = [0, *cuts, len(flat)]
    return [data_frame(pb.PutFrame, lo // nbytes, lo % nbytes, flat[lo:hi]) for lo, hi in itertools.pairwise(edges)]


@pytest.mark.parametrize("chunk", [None, 3 * SPEC.block_nbytes + 123, 1000],
                         ids=["all-in-one-frame", "crossing-at-odd-offsets", "block-not-a-multiple"])
def test_small_blocks_stream_bit_exact_several_to_a_frame(sidecar, monkeypatch, chunk):
    """The client packs blocks smaller than its chunk into shared frames both ways (the server's
    receive sees frames that cross blocks; a Get asks for packing) and gets them back bit-exact."""
    import kvstore.client as client_mod
    import kvstore.service_streams as streams

    monkeypatch.setattr(streams, "MIN_CHUNK_BYTES", 1)  # the layouts of chunks below the Get floor
    seen: dict[str, list[tuple[int, int, int]]] = {"put": [], "get": []}

    def spying(real, name):
        def wrapper(frames, *args):
            def log(fs):
                for f in fs:
                    seen[name].append((f.meta.block, f.meta.offset, len(f.data)))
                    yield f
            return real(log(frames), *args)
        return wrapper

    monkeypatch.setattr(streams, "scatter", spying(streams.scatter, "put"))
    monkeypatch.setattr(client_mod, "scatter", spying(client_mod.scatter, "get"))
    c = sidecar.tenant(f"packed-{chunk or 0}", local=False, **({"chunk_bytes": chunk} if chunk else {}))
    nbytes, n = SPEC.block_nbytes, 7
    keys = c.block_keys(SPEC, fresh_tokens(n))
    kv = random_kv(n, seed=17)
    c.put(SPEC, keys, kv)
    assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
    step = chunk or c.chunk_bytes
    for name in ("put", "get"):
        frames = seen[name]
        assert len(frames) == -(-n * nbytes // step), name  # every frame full but the last
        assert sum(size for *_, size in frames) == n * nbytes
        assert any(off + size > nbytes for _, off, size in frames), name  # some cross blocks


def test_put_frames_crossing_blocks_keep_every_check(sidecar):
    """Frames that cross blocks get the same checks as one-block frames: a bad checksum, an
    out-of-order frame, an overrun past the last block and a short stream are INVALID_ARGUMENT
    and store nothing; the same frames intact and in order store the blocks bit-exact."""
    from kvstore.frames import encode

    c, put, _, md = _frames_stub(sidecar, "crossing")
    nbytes = SPEC.block_nbytes
    keys = c.block_keys(SPEC, fresh_tokens(3))
    kv = random_kv(3, seed=23)
    flat = kv.view(torch.uint8).numpy().tobytes()
    good = _spans(flat, nbytes, [nbytes * 3 // 2])  # two frames of 1.5 blocks
    bad_sum = pb.PutFrame(block=1, offset=nbytes // 2, xxh3=xxhash.xxh3_64_intdigest(flat[nbytes * 3 // 2:]) ^ 1)
    before = _hbm_used(sidecar)
    cases = {
        "checksum mismatch": [good[0], encode(bad_sum, flat[nbytes * 3 // 2:])],
        "out-of-order frame": [good[0], *_spans(flat[nbytes:], nbytes, [nbytes])[1:]],  # a frame at block 1 offset 0
        "overruns": [good[0], _spans(flat + b"x", nbytes, [nbytes * 3 // 2])[1]],
        "ended after 1 of 3 blocks": good[:1],
    }
    for expected, frames in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            put(iter([_put_header(keys), *frames]), metadata=md, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, expected
        assert expected in err.value.details()
        assert c.lookup(SPEC, keys).num_blocks == 0
        assert _wait_for(lambda: _hbm_used(sidecar) == before)  # the reserved slots given back
    assert put(iter([_put_header(keys), *good]), metadata=md, timeout=10).blocks_written == 3
    assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))


def test_put_still_accepts_one_block_frames(sidecar):
    """The layout older clients send: frames that stop at their block's end (here 1000-byte
    chunks, so each block ends with a short one), and whole blocks from a generic protobuf writer."""
    c, put, _, md = _frames_stub(sidecar, "old-layout")
    nbytes = SPEC.block_nbytes
    keys = c.block_keys(SPEC, fresh_tokens(3))
    kv = random_kv(3, seed=29)
    flat = kv.view(torch.uint8).numpy().tobytes()
    chunked = _spans(flat[: 2 * nbytes], nbytes, [lo for b in (0, nbytes) for lo in range(b, b + nbytes, 1000)][1:])
    last = flat[2 * nbytes :]
    generic = pb.PutFrame(block=2, offset=0, data=last, xxh3=xxhash.xxh3_64_intdigest(last)).SerializeToString()
    assert put(iter([_put_header(keys), *chunked, generic]), metadata=md, timeout=10).blocks_written == 3
    assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))


def test_get_packs_blocks_into_frames_only_when_asked(sidecar, monkeypatch):
    """An older client (no pack_blocks) still gets frames that each hold part of one block;
    with pack_blocks every frame is filled up to chunk_bytes across blocks."""
    import kvstore.service_streams as streams

    monkeypatch.setattr(streams, "MIN_CHUNK_BYTES", 1)  # the layouts of chunks below the Get floor
    c, _, get, md = _frames_stub(sidecar, "get-pack")
    nbytes, n = SPEC.block_nbytes, 5
    keys = c.block_keys(SPEC, fresh_tokens(n))
    kv = random_kv(n, seed=31)
    c.put(SPEC, keys, kv)
    flat = kv.view(torch.uint8).numpy().tobytes()

    def frames(chunk: int, pack: bool) -> list[tuple[int, int, int]]:
        req = pb.GetRequest(target=pb.Target(spec=_spec_pb(), keys=b"".join(keys)), chunk_bytes=chunk,
                            pack_blocks=pack)
        stream = list(get(req, metadata=md, timeout=10))
        assert stream[0].meta.header.num_blocks == n
        assert b"".join(bytes(f.data) for f in stream[1:]) == flat
        return [(f.meta.block, f.meta.offset, len(f.data)) for f in stream[1:]]

    assert frames(3 * nbytes, pack=False) == [(i, 0, nbytes) for i in range(n)]
    assert frames(3 * nbytes, pack=True) == [(0, 0, 3 * nbytes), (3, 0, 2 * nbytes)]
    old = frames(1000, pack=False)
    assert all(off + size <= nbytes for _, off, size in old) and len(old) == n * 5
    assert frames(1500, pack=True)[:3] == [(0, 0, 1500), (0, 1500, 1500), (0, 3000, 1500)]
    assert frames(1500, pack=True)[3] == (1, 404, 1500)  # 4500 bytes in: past block 0's 4096


def test_a_local_client_registers_its_region_again_after_the_server_restarts(tmp_path):
    """A restart forgets every registered region: the client's next shared-memory call is
    told UnknownRegion, registers the same region again and goes on, instead of failing on
    every call until it is recreated."""
    from kvstore.client import Client

    sc = start(tmp_path)
    port, admin_token = sc.port, sc.admin_token
    c = Client(sc.target, sc.admin().create_tenant("again"), local=True)
    registered = []
    real = c._register_region
    c._register_region = lambda region, *a: registered.append(region.name) or real(region, *a)
    try:
        keys = c.block_keys(SPEC, fresh_tokens(2))
        c.put(SPEC, keys, random_kv(2, seed=5))
        assert not registered
        sc.stop()
        sc = start(tmp_path, admin_token=admin_token, listen=f"127.0.0.1:{port}")
        more = c.block_keys(SPEC, fresh_tokens(2))
        kv = random_kv(2, seed=6)
        c.put(SPEC, more, kv)
        assert registered == [c._local.region.name]  # the same region, once
        out = torch.empty_like(kv)
        assert c.get_into(SPEC, more, out) == 2 and torch.equal(out.view(torch.int16), kv.view(torch.int16))
    finally:
        c.close()
        sc.stop()


def test_a_region_registered_before_a_restart_is_never_taken_for_one_registered_after(tmp_path):
    """Region ids started at 1 in every server process: a client of the same tenant that
    registered first after a restart got the id the other client still held, whose puts then
    stored bytes read from the new client's region and whose gets wrote into it."""
    from kvstore.client import Client

    sc = start(tmp_path)
    port, admin_token = sc.port, sc.admin_token
    token = sc.admin().create_tenant("pair")
    a = Client(sc.target, token, local=True)
    b = None
    try:
        keys = a.block_keys(SPEC, fresh_tokens(2))
        a.put(SPEC, keys, random_kv(2, seed=1))
        sc.stop()
        sc = start(tmp_path, admin_token=admin_token, listen=f"127.0.0.1:{port}")
        b = Client(sc.target, token, local=True)
        assert b._local is not None and b._local.region_id != a._local.region_id
        mine = b.local_blocks(SPEC, 4)
        mine.tensor.fill_(7.0)
        theirs = mine.tensor.clone()
        more = a.block_keys(SPEC, fresh_tokens(2))
        kv = random_kv(2, seed=2)
        a.put(SPEC, more, kv)
        assert torch.equal(b.get(SPEC, more).view(torch.int16), kv.view(torch.int16))
        assert torch.equal(a.get(SPEC, more).view(torch.int16), kv.view(torch.int16))
        assert torch.equal(mine.tensor, theirs)  # a's get wrote nothing into b's region
        mine.free()
    finally:
        a.close()
        if b is not None:
            b.close()
        sc.stop()


def test_regions_of_clients_that_died_are_dropped_not_held_forever(tmp_path):
    """A client killed with SIGKILL never unregisters its region; Python's resource tracker
    unlinks its name, and the server drops the region at the principal's next registration
    (and in its sweep). With one region allowed per principal, the next client still gets
    the shared-memory plane instead of RESOURCE_EXHAUSTED until the server restarts."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from kvstore.client import Client

    sc = start(tmp_path, limits={"max_regions_per_principal": 1})
    token = sc.admin().create_tenant("crashy")
    code = ("import sys, time; from kvstore.client import Client; "
            f"c = Client({sc.target!r}, {token!r}, local=True, region_bytes=1 << 20); "
            "print(c._local.region.name, flush=True); time.sleep(60)")
    repo = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=repo)
    try:
        name = child.stdout.readline().strip()
        assert name, "the child did not register a region"
        assert sc.server.data.regions.prune() == 0  # alive: kept
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        deadline = time.monotonic() + 20
        while Path("/dev/shm", name).exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the resource tracker unlinks it once it sees its parent gone
        c = Client(sc.target, token, local=True, region_bytes=1 << 20)
        try:
            assert c.uses_shared_memory
            keys = c.block_keys(SPEC, fresh_tokens(1))
            kv = random_kv(1, seed=3)
            c.put(SPEC, keys, kv)
            assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
        finally:
            c.close()
    finally:
        if child.poll() is None:
            child.kill()
        sc.stop()


def test_a_client_never_closed_unlinks_its_region_at_exit_without_warnings(sidecar):
    """An engine that drops its Client (or exits) without close(): the region's name is
    unlinked by the client itself at exit, with no 'leaked shared_memory' warning from the
    resource tracker and no BufferError from a mapping still in use; a Client collected while
    the process runs does the same."""
    import subprocess
    import sys
    from pathlib import Path

    token = sidecar.admin().create_tenant("no-close")
    code = ("import gc, torch; from kvstore.client import Client; from service_harness import SPEC, random_kv\n"
            f"c = Client({sidecar.target!r}, {token!r}, local=True, region_bytes=1 << 20)\n"
            "keys = c.block_keys(SPEC, list(range(SPEC.block_tokens)))\n"
            "c.put(SPEC, keys, random_kv(1)); c.get(SPEC, keys)\n"
            f"d = Client({sidecar.target!r}, {token!r}, local=True, region_bytes=1 << 20)\n"
            "name = d._local.region.name; del d; gc.collect()\n"
            "import os; print(os.path.exists('/dev/shm/' + name))\n"
            "print(c._local.region.name, flush=True)\n")
    tests = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tests.parent, check=False,
                          env={**os.environ, "PYTHONPATH": str(tests)}, timeout=120)
    assert done.returncode == 0, done.stderr
    collected_exists, name = done.stdout.split()
    assert collected_exists == "False"  # the collected client's region is gone already
    assert not Path("/dev/shm", name).exists()
    assert "leaked" not in done.stderr and "BufferError" not in done.stderr, done.stderr


def test_token_ids_passed_as_keys_are_refused_with_a_hint(sidecar):
    c = sidecar.tenant("ints-as-keys", local=False)
    for call in (lambda: c.lookup(SPEC, list(range(SPEC.block_tokens))), lambda: c.get(SPEC, [1, 2]),
                 lambda: c.delete([7])):
        with pytest.raises(InvalidArgument, match="not token ids"):
            call()
    with pytest.raises(InvalidArgument, match="got str"):
        c.get(SPEC, ["abc"])
    with pytest.raises(InvalidArgument, match="sequence of 32-byte keys"):
        c.get(SPEC, bytes(64))  # the packed form is the server's wire format, not the client's


@pytest.mark.parametrize("local", [True, False])
def test_meta_tensors_are_refused_by_the_client(sidecar, local):
    """A meta tensor (shapes only, no memory) as put's kv or get_into's out is InvalidArgument
    naming the meta device, and nothing is stored."""
    c = sidecar.tenant(f"meta-{int(local)}", local=local)
    keys = c.block_keys(SPEC, fresh_tokens(2))
    meta = torch.empty((2, *SPEC.block_shape), dtype=SPEC.torch_dtype, device="meta")
    with pytest.raises(InvalidArgument, match="meta device"):
        c.put(SPEC, keys, meta)
    assert c.lookup(SPEC, keys).num_blocks == 0
    c.put(SPEC, keys, random_kv(2))
    with pytest.raises(InvalidArgument, match="meta device"):
        c.get_into(SPEC, keys, meta)


def test_a_client_started_before_its_sidecar_takes_shared_memory_once_it_is_up(tmp_path, monkeypatch):
    """An engine may start before its sidecar (containers of one pod start together). The
    client then runs on streams, and registers its region at a later put or get once the
    server answers, instead of staying on streams for its whole life."""
    import kvstore.client as client_mod
    from kvstore.client import Client

    monkeypatch.setattr(client_mod, "REGISTER_RETRY_S", 0.0)
    sc = start(tmp_path)
    token = sc.admin().create_tenant("early")
    port = sc.port
    sc.stop()
    c = Client(f"127.0.0.1:{port}", token, region_bytes=1 << 20, timeout=5)
    try:
        assert not c.uses_shared_memory
        with pytest.raises(KVStoreError):
            c.stats()  # nothing answers yet
        sc = start(tmp_path, admin_token=sc.admin_token, listen=f"127.0.0.1:{port}")
        kv = random_kv(2, seed=5)
        deadline = time.monotonic() + 30
        while True:  # grpc reconnects with a backoff of about a second
            try:
                keys = c.block_keys(SPEC, fresh_tokens(2))
                c.put(SPEC, keys, kv)
                break
            except KVStoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert c.uses_shared_memory
        assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
        assert sc.server.data.regions.prune() == 0  # registered, and alive
    finally:
        c.close()
        sc.stop()


def test_a_client_refused_by_a_remote_server_does_not_retry_registering(sidecar, monkeypatch):
    """Only an unreachable server is tried again: one that answered (here: the region is not
    on its host, FAILED_PRECONDITION) keeps the client on streams without further attempts."""
    import kvstore.client as client_mod
    from kvstore.client import Client

    monkeypatch.setattr(client_mod, "REGISTER_RETRY_S", 0.0)
    token = sidecar.admin().create_tenant("elsewhere")
    real = client_mod.ShmRegion.create

    def elsewhere(size: int, **kw):
        region = real(size, **kw)
        region.name = region.name + "x"  # a name the server cannot open: "not on this host"
        return region

    monkeypatch.setattr(client_mod.ShmRegion, "create", staticmethod(elsewhere))
    c = sidecar.client(token, region_bytes=1 << 20)
    assert not c.uses_shared_memory and c._retry_register_at is None
    calls = []
    monkeypatch.setattr(Client, "_register", lambda self, required: calls.append(required))
    keys = c.block_keys(SPEC, fresh_tokens(1))
    c.put(SPEC, keys, random_kv(1))
    assert calls == [] and not c.uses_shared_memory
