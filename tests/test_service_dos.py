"""One caller cannot hang the sidecar for everyone: per-principal caps on running calls and
streams (RESOURCE_EXHAUSTED naming the limit), worker threads kept for the admin, grpc's own
bound on calls at once, streams that move nothing cancelled after ``limits.stream_idle_s``,
a floor under a Get's ``chunk_bytes``, and one authorization header per call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.frames import decoder, encode
from kvstore.service_convert import spec_to_pb
from kvstore.spec import ModelSpec
from proto.kvstore.v1 import kvstore_pb2 as pb

_KV = "/kvstore.v1.KVStore/"
WAIT = 20.0  # generous: a bound on waiting for a state, never a timing claim
BIG = ModelSpec(model="dos/big", revision="r1", num_layers=4, num_kv_heads=8, head_dim=128, block_tokens=16)


def _wait_for(predicate, timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


class Raw:
    """Raw Put/Get/Stats of one token over a channel of its own."""

    def __init__(self, sc, token: str) -> None:
        self.channel = grpc.insecure_channel(sc.target)
        sc.clients.append(self.channel)  # closed with the sidecar
        self.md = (("authorization", f"Bearer {token}"),)
        self.put = self.channel.stream_unary(_KV + "Put", request_serializer=None,
                                             response_deserializer=pb.PutResponse.FromString)
        self.get = self.channel.unary_stream(_KV + "Get", request_serializer=pb.GetRequest.SerializeToString,
                                             response_deserializer=decoder(pb.GetFrame))
        self.stats = self.channel.unary_unary(_KV + "Stats", request_serializer=pb.StatsRequest.SerializeToString,
                                              response_deserializer=pb.StatsResponse.FromString)


def _header(keys: list[bytes], spec: ModelSpec = SPEC) -> bytes:
    return encode(pb.PutFrame(header=pb.PutHeader(target=pb.Target(spec=spec_to_pb(spec), keys=b"".join(keys)))))


def _stalled(first: list[bytes], release: threading.Event) -> Iterator[bytes]:
    """A Put's frames: ``first``, then nothing until ``release`` (the stream stays open)."""
    yield from first
    release.wait(60)


def _hbm_used(sc) -> int:
    return sc.server.store.stats()["tiers"]["hbm"]["used_bytes"]


def _details(fut: grpc.Future) -> tuple[grpc.StatusCode, str]:
    exc = fut.exception()
    assert exc is not None, "the call succeeded"
    return exc.code(), exc.details()


# -- the per-principal caps, the admin's workers, grpc's bound ----------------------------------
def test_stalled_put_streams_of_one_tenant_leave_the_others_served(tmp_path):
    """16 Put streams that send their header and then nothing (no deadline) held all 16
    workers: another tenant's stats() timed out. A tenant now runs at most
    ``max_streams_per_principal`` streams (a quarter of the workers by default); the rest are
    refused at once, naming the limit, and everyone else is served."""
    sc = start(tmp_path)
    try:
        admin = sc.admin()
        a = Raw(sc, admin.create_tenant("a"))
        b = sc.client(admin.create_tenant("b"), local=False, timeout=10)
        release = threading.Event()
        try:
            futs = [a.put.future(_stalled([_header([bytes([i]) * 32])], release), metadata=a.md)
                    for i in range(16)]
            assert _wait_for(lambda: sum(f.done() for f in futs) == 12)
            refused = [_details(f) for f in futs if f.done()]
            assert {code for code, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert all("limits.max_streams_per_principal=4" in d for _, d in refused)
            assert sc.server.rpc.limiter.running("a") == (4, 4)
            assert "tiers" in b.stats()  # another tenant: served
            assert admin.stats()  # the admin: served
        finally:
            release.set()
        for f in futs:
            f.exception(WAIT)  # the stalled ones end (the stream ended early)
        assert _wait_for(lambda: sc.server.rpc.limiter.running("a") == (0, 0))
    finally:
        sc.stop()


def test_a_principal_runs_at_most_max_calls_per_principal(tmp_path):
    sc = start(tmp_path, workers=8, limits={"max_calls_per_principal": 2, "max_streams_per_principal": 2})
    try:
        admin = sc.admin()
        a = Raw(sc, admin.create_tenant("a"))
        release = threading.Event()
        try:
            held = [a.put.future(_stalled([_header([bytes([i]) * 32])], release), metadata=a.md) for i in range(2)]
            assert _wait_for(lambda: sc.server.rpc.limiter.running("a") == (2, 2))
            with pytest.raises(grpc.RpcError) as err:
                a.stats(pb.StatsRequest(), metadata=a.md, timeout=WAIT)  # a unary call counts too
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limits.max_calls_per_principal=2" in err.value.details()
        finally:
            release.set()
        for f in held:
            f.exception(WAIT)
        assert _wait_for(lambda: sc.server.rpc.limiter.running("a") == (0, 0))
        assert a.stats(pb.StatsRequest(), metadata=a.md, timeout=WAIT).json  # its place given back
    finally:
        sc.stop()


def test_tenants_together_leave_the_admin_its_workers(tmp_path):
    """4 workers, one kept for the admin (the default, an eighth, at least 1): three tenants'
    stalled streams hold the other three; a fourth tenant is refused naming the limit, and the
    admin is still served (before: every worker held, the admin's call queued for ever)."""
    sc = start(tmp_path, workers=4)
    try:
        admin = sc.admin()
        raws = {name: Raw(sc, admin.create_tenant(name)) for name in "abcd"}
        release = threading.Event()
        try:
            held = [r.put.future(_stalled([_header([name.encode() * 32])], release), metadata=r.md)
                    for name, r in raws.items() if name != "d"]
            assert _wait_for(lambda: all(sc.server.rpc.limiter.running(n) == (1, 1) for n in "abc"))
            d = raws["d"]
            with pytest.raises(grpc.RpcError) as err:
                d.stats(pb.StatsRequest(), metadata=d.md, timeout=WAIT)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limits.admin_workers" in err.value.details()
            assert admin.stats()
        finally:
            release.set()
        for f in held:
            f.exception(WAIT)
    finally:
        sc.stop()


def test_calls_past_workers_and_queue_are_refused_not_queued_for_ever(tmp_path):
    """Two workers, both held, one call may wait for them: the next one is refused at once with
    RESOURCE_EXHAUSTED (grpc's maximum_concurrent_rpcs) instead of waiting without end."""
    sc = start(tmp_path, workers=2, limits={"admin_workers": 0, "max_calls_per_principal": 2,
                                            "max_streams_per_principal": 2, "max_queued_calls": 1})
    try:
        admin = sc.admin()
        a = Raw(sc, admin.create_tenant("a"))
        b = Raw(sc, admin.create_tenant("b"))
        release = threading.Event()
        try:
            held = [a.put.future(_stalled([_header([bytes([i]) * 32])], release), metadata=a.md) for i in range(2)]
            assert _wait_for(lambda: sc.server.rpc.limiter.running("a") == (2, 2))
            # NOTE: which of two calls reaches the server first is not ordered (under load the
            # second one sent was queued and the first refused): one of them is refused at once
            calls = [b.stats.future(pb.StatsRequest(), metadata=b.md, timeout=60) for _ in range(2)]
            assert _wait_for(lambda: any(c.done() for c in calls))
            refused = next(c for c in calls if c.done())
            queued = next(c for c in calls if c is not refused)
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert not queued.done()
            from kvstore.status import from_rpc_error

            err = from_rpc_error(refused.exception())  # it passed on grpc's words, naming no limit
            assert err.resource == "limits.max_queued_calls" and "max_queued_calls" in str(err)
        finally:
            release.set()
        for f in held:
            f.exception(WAIT)
        assert queued.result(WAIT).json  # the queued call ran once a worker was free
    finally:
        sc.stop()


# -- idle streams -------------------------------------------------------------------------------
@pytest.mark.parametrize("sent", ["header", "half-a-block", "everything"])
def test_a_put_stream_that_sends_nothing_more_is_cancelled_and_stores_nothing(tmp_path, sent):
    """A Put that stops sending (after its header, inside a block, or after its last frame
    without closing) is cancelled after ``limits.stream_idle_s``: the client sees CANCELLED
    (before: it waited for ever, here until its own deadline), nothing is stored, the reserved
    slots and the principal's place are given back."""
    from kvstore.frames import data_frame

    sc = start(tmp_path, limits={"stream_idle_s": 0.5})
    try:
        token = sc.admin().create_tenant("idle")
        c = sc.client(token, local=False)
        a = Raw(sc, token)
        keys = c.block_keys(SPEC, fresh_tokens(2))
        flat = random_kv(2).view(torch.uint8).numpy().tobytes()
        nbytes = SPEC.block_nbytes
        frames = {"header": [], "half-a-block": [data_frame(pb.PutFrame, 0, 0, flat[: nbytes // 2])],
                  "everything": [data_frame(pb.PutFrame, 0, 0, flat)]}[sent]
        before = _hbm_used(sc)
        release = threading.Event()
        try:
            with pytest.raises(grpc.RpcError) as err:
                a.put(_stalled([_header(keys), *frames], release), metadata=a.md, timeout=WAIT)
        finally:
            release.set()
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert c.lookup(SPEC, keys).num_blocks == 0
        assert _wait_for(lambda: _hbm_used(sc) == before)
        assert _wait_for(lambda: sc.server.rpc.limiter.running("idle") == (0, 0))
        c.put(SPEC, keys, random_kv(2))  # a stream that keeps sending is not cut
        assert c.lookup(SPEC, keys).num_blocks == 2
    finally:
        sc.stop()


def test_a_get_whose_client_reads_nothing_is_cancelled(tmp_path):
    """A Get whose client stops taking frames held its worker while grpc waited to send; it is
    cancelled after ``limits.stream_idle_s`` and gives its place (and its lease) back."""
    sc = start(tmp_path, limits={"stream_idle_s": 0.5},
               store={"hbm_bytes": 96 << 20, "dram_bytes": 64 << 20, "nvme_bytes": 256 << 20})
    try:
        token = sc.admin().create_tenant("reader")
        c = sc.client(token, local=False)
        a = Raw(sc, token)
        # NOTE: 64 MiB, far more than the flow-control windows and socket buffers hold (12 MiB
        # once fitted in them: the Get completed and was never idle)
        n = 256
        keys = c.block_keys(BIG, fresh_tokens(n, BIG))
        c.put(BIG, keys, torch.zeros((n, *BIG.block_shape), dtype=BIG.torch_dtype))
        req = pb.GetRequest(target=pb.Target(spec=spec_to_pb(BIG), keys=b"".join(keys)), pack_blocks=True)
        stream = a.get(req, metadata=a.md, timeout=60)
        assert next(stream).meta.header.num_blocks == n
        assert _wait_for(lambda: sc.server.rpc.limiter.running("reader") == (0, 0))
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert len(c.get(BIG, keys[:2])) == 2  # the lease was given back: the blocks serve
    finally:
        sc.stop()


# -- the Get chunk floor ------------------------------------------------------------------------
@pytest.mark.parametrize("pack", [True, False])
def test_a_get_asking_for_tiny_frames_gets_frames_of_64_kib(sidecar, pack):
    """GetRequest.chunk_bytes=1 made one checksummed frame per byte (a 1 MiB block streamed for
    over 30 s); a chunk below 64 KiB is raised to it."""
    token = sidecar.admin().create_tenant("tiny")
    c = sidecar.client(token, local=False)
    a = Raw(sidecar, token)
    keys = c.block_keys(BIG, fresh_tokens(2, BIG))
    kv = torch.randint(-999, 999, (2, *BIG.block_shape), dtype=torch.int16).view(BIG.torch_dtype)
    c.put(BIG, keys, kv)
    req = pb.GetRequest(target=pb.Target(spec=spec_to_pb(BIG), keys=b"".join(keys)), chunk_bytes=1, pack_blocks=pack)
    stream = a.get(req, metadata=a.md, timeout=WAIT)
    frames = []
    for frame in stream:
        frames.append(frame)
        if len(frames) > 64:  # the old server's 1-byte frames: stop reading
            stream.cancel()
            break
    sizes = [len(f.data) for f in frames[1:]]
    assert sizes == [64 * 1024] * (2 * BIG.block_nbytes // (64 * 1024))
    assert b"".join(bytes(f.data) for f in frames[1:]) == kv.view(torch.uint8).numpy().tobytes()


def test_the_get_floor_never_passes_the_servers_chunk_limit(tmp_path):
    """With ``limits.chunk_bytes`` below 64 KiB the floor is that limit."""
    from kvstore.service_streams import get_chunk_bytes

    assert get_chunk_bytes(2 << 20, 0) == 2 << 20
    assert get_chunk_bytes(2 << 20, 1) == 64 * 1024
    assert get_chunk_bytes(2 << 20, 100_000) == 100_000
    assert get_chunk_bytes(2 << 20, 8 << 20) == 2 << 20
    assert get_chunk_bytes(16 * 1024, 1) == 16 * 1024
    sc = start(tmp_path, limits={"chunk_bytes": 16 * 1024})
    try:
        token = sc.admin().create_tenant("small")
        c = sc.client(token, local=False)
        a = Raw(sc, token)
        keys = c.block_keys(BIG, fresh_tokens(1, BIG))
        c.put(BIG, keys, torch.zeros((1, *BIG.block_shape), dtype=BIG.torch_dtype))
        req = pb.GetRequest(target=pb.Target(spec=spec_to_pb(BIG), keys=b"".join(keys)), chunk_bytes=1,
                            pack_blocks=True)
        stream = a.get(req, metadata=a.md, timeout=WAIT)
        sizes = []
        for frame in stream:
            sizes.append(len(frame.data))
            if len(sizes) > 64:
                stream.cancel()
                break
        assert sizes[1:] == [16 * 1024] * (BIG.block_nbytes // (16 * 1024))
    finally:
        sc.stop()


# -- one authorization header -------------------------------------------------------------------
def test_two_authorization_headers_are_refused(sidecar):
    """A call with two authorization headers was served with the first; which one a proxy on
    the way honours is its own choice, so the call is refused."""
    admin = sidecar.admin()
    mine, other = admin.create_tenant("first"), admin.create_tenant("second")
    a = Raw(sidecar, mine)
    for md in ((("authorization", f"Bearer {mine}"), ("authorization", f"Bearer {other}")),
               (("authorization", f"Bearer {mine}"), ("authorization", f"Bearer {mine}"))):
        with pytest.raises(grpc.RpcError) as err:
            a.stats(pb.StatsRequest(), metadata=md, timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "more than one authorization header" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            a.put(iter([_header([b"k" * 32])]), metadata=md, timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert a.stats(pb.StatsRequest(), metadata=a.md, timeout=WAIT).json  # one header: served


def test_the_call_limits_follow_the_workers(tmp_path):
    """Defaults worked out from ``workers``; explicit limits that cannot work are refused at
    load naming the field."""
    from kvstore import server_config
    from kvstore.errors import InvalidArgument

    def limits(**data):
        return server_config.build(data, data_dir=tmp_path).call_limits

    c = limits()
    assert (c.calls_per_principal, c.streams_per_principal, c.tenant_calls, c.max_concurrent_rpcs,
            c.stream_idle_s) == (8, 4, 14, 32, 30.0)
    c = limits(workers=1)
    assert (c.calls_per_principal, c.streams_per_principal, c.tenant_calls) == (1, 1, 1)
    c = limits(workers=64, limits={"max_queued_calls": 0, "admin_workers": 4})
    assert (c.calls_per_principal, c.streams_per_principal, c.tenant_calls, c.max_concurrent_rpcs) == (32, 16, 60, 64)
    for bad, field in (({"admin_workers": 16}, "limits.admin_workers"),
                       ({"max_calls_per_principal": 15}, "limits.max_calls_per_principal"),
                       ({"max_streams_per_principal": 9}, "limits.max_streams_per_principal"),
                       ({"stream_idle_s": 0}, "limits.stream_idle_s"),
                       ({"stream_idle_s": float("inf")}, "limits.stream_idle_s"),
                       ({"max_calls_per_principal": 0}, "limits.max_calls_per_principal")):
        with pytest.raises(InvalidArgument, match=field.replace(".", r"\.")):
            limits(limits=bad)


def test_the_limiter_counts_and_gives_back(tmp_path):
    """CallLimiter alone: the admin is not counted; a refused call takes no place."""
    from kvstore.auth import Principal, Role
    from kvstore.errors import ResourceExhausted
    from kvstore.service_limits import CallLimiter

    lim = CallLimiter(calls_per_principal=2, streams_per_principal=1, tenant_calls=3)
    t, u = Principal("t", Role.TENANT), Principal("u", Role.TENANT)
    s1 = lim.enter(t, stream=True)
    with pytest.raises(ResourceExhausted, match="max_streams_per_principal=1"):
        lim.enter(t, stream=True)
    s2 = lim.enter(t, stream=False)
    with pytest.raises(ResourceExhausted, match="max_calls_per_principal=2"):
        lim.enter(t, stream=False)
    s3 = lim.enter(u, stream=False)
    with pytest.raises(ResourceExhausted, match="admin_workers"):
        lim.enter(u, stream=False)
    admins = [lim.enter(Principal("admin", Role.ADMIN), stream=False) for _ in range(10)]
    for s in (s1, s2, s3, *admins, s1):  # release is idempotent
        s.release()
    assert lim.running("t") == lim.running("u") == (0, 0)
