"""One caller cannot hang or confuse the sidecar: one authorization header per call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from service_harness import SPEC

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
