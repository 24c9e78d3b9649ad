"""One caller cannot hang or confuse the sidecar: a floor under a Get's ``chunk_bytes``, and one
authorization header per call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from service_harness import SPEC, fresh_tokens, start

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
