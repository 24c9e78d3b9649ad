"""A Get past ``limits.max_stream_bytes`` with ``GetRequest.partial``: the server serves the
leading blocks that fit and says whether it stopped at the limit (``GetHeader.limited``) or at
a miss. Clients asked for more than the limit, were refused, and learned the limit by parsing
the refusal's text; they now never make a refused call."""

from __future__ import annotations

import grpc
import pytest
import torch
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.client import spec_to_pb
from kvstore.frames import decoder
from proto.kvstore.v1 import kvstore_pb2 as pb

LIMIT_BLOCKS = 4


@pytest.fixture
def sidecar(tmp_path):
    sc = start(tmp_path, limits={"max_stream_bytes": LIMIT_BLOCKS * SPEC.block_nbytes})
    yield sc
    sc.stop()


def _put_within_limit(c, keys: list[bytes], kv: torch.Tensor) -> None:
    """Put a chain in puts of at most LIMIT_BLOCKS (a Put stream past the limit is refused)."""
    for lo in range(0, len(keys), LIMIT_BLOCKS):
        hi = min(lo + LIMIT_BLOCKS, len(keys))
        c.put(SPEC, keys[lo:hi], kv[lo:hi], parent=keys[lo - 1] if lo else None)


def _raw_get(sidecar, token: str, keys: list[bytes], *, partial: bool, parent: bytes = b""):
    """(header, payload bytes) of one raw Get."""
    ch = grpc.insecure_channel(sidecar.target)
    try:
        call = ch.unary_stream("/kvstore.v1.KVStore/Get", request_serializer=pb.GetRequest.SerializeToString,
                               response_deserializer=decoder(pb.GetFrame))
        req = pb.GetRequest(target=pb.Target(spec=spec_to_pb(SPEC), keys=b"".join(keys), parent=parent),
                            partial=partial)
        frames = list(call(req, metadata=(("authorization", f"Bearer {token}"),), timeout=10))
    finally:
        ch.close()
    return frames[0].meta.header, b"".join(bytes(f.data) for f in frames[1:])


def test_a_partial_get_serves_what_fits_and_says_it_stopped_at_the_limit(sidecar):
    token = sidecar.admin().create_tenant("partial")
    c = sidecar.client(token, local=False)
    keys = c.block_keys(SPEC, fresh_tokens(10))
    kv = random_kv(10, seed=3)
    _put_within_limit(c, keys, kv)
    raw = kv.contiguous().view(torch.uint8).numpy().tobytes()
    n = SPEC.block_nbytes

    header, data = _raw_get(sidecar, token, keys, partial=True)
    assert (header.num_blocks, header.limited) == (LIMIT_BLOCKS, True)
    assert data == raw[: LIMIT_BLOCKS * n]
    header, data = _raw_get(sidecar, token, keys[LIMIT_BLOCKS:], partial=True, parent=keys[LIMIT_BLOCKS - 1])
    assert (header.num_blocks, header.limited) == (LIMIT_BLOCKS, True)
    assert data == raw[LIMIT_BLOCKS * n : 2 * LIMIT_BLOCKS * n]
    # exactly the limit asked for: nothing was cut
    header, _ = _raw_get(sidecar, token, keys[:LIMIT_BLOCKS], partial=True)
    assert (header.num_blocks, header.limited) == (LIMIT_BLOCKS, False)

    c.delete([keys[2]])  # a miss before the cut ends the prefix: not limited
    header, data = _raw_get(sidecar, token, keys, partial=True)
    assert (header.num_blocks, header.limited) == (2, False)
    assert data == raw[: 2 * n]


def test_a_get_without_partial_past_the_limit_is_still_refused(sidecar):
    token = sidecar.admin().create_tenant("whole")
    c = sidecar.client(token, local=False)
    keys = c.block_keys(SPEC, fresh_tokens(LIMIT_BLOCKS + 1))
    with pytest.raises(grpc.RpcError) as err:
        _raw_get(sidecar, token, keys, partial=False)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_stream_bytes" in err.value.details()


def test_the_client_reads_past_the_limit_without_a_refused_call(sidecar, monkeypatch):
    c = sidecar.tenant("no-refusal", local=False)
    keys = c.block_keys(SPEC, fresh_tokens(11))
    kv = random_kv(11, seed=4)
    _put_within_limit(c, keys, kv)
    calls: list[int] = []
    failures: list[Exception] = []
    get_frames, failure = c._get_frames, c._failure
    monkeypatch.setattr(c, "_get_frames", lambda req, **kw: calls.append(len(req.target.keys)) or get_frames(req, **kw))
    monkeypatch.setattr(c, "_failure", lambda err: failures.append(err) or failure(err))

    assert torch.equal(c.get(SPEC, keys), kv)
    assert len(calls) == 3 and not failures  # 4 + 4 + 3 blocks; no call refused
    assert c._stream_cap is None  # nothing learned from a refusal's text
    c.delete([keys[6]])
    calls.clear()
    assert torch.equal(c.get(SPEC, keys), kv[:6])  # a miss in the second piece ends the prefix
    assert len(calls) == 2 and not failures


def test_against_a_server_that_predates_partial_the_client_learns_the_limit_once(sidecar, monkeypatch):
    from kvstore import servicer_kv

    real = servicer_kv.get_stream

    def old_server(plane, p, request):  # a server that does not know GetRequest.partial
        request.ClearField("partial")
        return real(plane, p, request)

    monkeypatch.setattr(servicer_kv, "get_stream", old_server)
    c = sidecar.tenant("old-server", local=False)
    keys = c.block_keys(SPEC, fresh_tokens(9))
    kv = random_kv(9, seed=6)
    _put_within_limit(c, keys, kv)
    assert torch.equal(c.get(SPEC, keys), kv)
    assert c._stream_cap == LIMIT_BLOCKS * SPEC.block_nbytes  # learned from the refusal's text
    assert torch.equal(c.get(SPEC, keys), kv)  # and kept: read in pieces with no refusal
