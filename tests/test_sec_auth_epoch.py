"""A call authenticated before an admin rotated its token, deleted its principal or revoked its
grant must not store (or keep reading) anything after that change.

Before, the service took the principal once when a stream opened and never looked again: a Put
stream opened before a rotation (or a revocation of a publisher's namespace) committed its
blocks after it, and a Get stream went on sending."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
import torch
import xxhash
from service_harness import SPEC, HeldPut, fresh_tokens, random_kv

from kvstore import service_streams
from kvstore.auth import AuthRegistry, Role
from kvstore.client import Client, spec_to_pb
from kvstore.errors import PermissionDenied, Unauthenticated
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

torch.set_num_threads(1)
N = 3  # blocks per put
WAIT = 20  # seconds any event may take before the test gives up (never a timing assertion)


@pytest.fixture
def channel(sidecar):
    ch = grpc.insecure_channel(sidecar.target)
    yield ch
    ch.close()


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _keys(tag: int) -> bytes:
    return b"".join(bytes([tag, i]) * 16 for i in range(N))


def _target(keys: bytes, namespace: str = "") -> pb.Target:
    return pb.Target(spec=spec_to_pb(SPEC), keys=keys, namespace=namespace)


def _frames(keys: bytes, namespace: str, hold: threading.Event, *, hold_after: int) -> Iterator[pb.PutFrame]:
    """A Put stream of N blocks that stops after ``hold_after`` blocks until ``hold`` is set."""
    yield pb.PutFrame(header=pb.PutHeader(target=_target(keys, namespace)))
    for i in range(N):
        if i == hold_after:
            assert hold.wait(WAIT)
        data = bytes([i + 1]) * SPEC.block_nbytes
        yield pb.PutFrame(block=i, offset=0, data=data, xxh3=xxhash.xxh3_64_intdigest(data))
    if hold_after >= N:
        assert hold.wait(WAIT)


def _written_blocks(monkeypatch) -> list[threading.Event]:
    """Events set as the server has written each block of a Put stream."""
    events = [threading.Event() for _ in range(N)]
    real = service_streams.write_into
    count = [0]

    def write_into(dst, lo, piece):
        real(dst, lo, piece)
        if lo + len(piece) == SPEC.block_nbytes:
            events[count[0]].set()
            count[0] += 1

    monkeypatch.setattr(service_streams, "write_into", write_into)
    return events


def _lookup(kv, keys: bytes, token: str, namespace: str = "") -> int:
    return kv.Lookup(pb.LookupRequest(target=_target(keys, namespace)), metadata=_md(token), timeout=5).num_blocks


def _put(kv, keys: bytes, token: str, namespace: str = "") -> int:
    go = threading.Event()
    go.set()
    return kv.Put(_frames(keys, namespace, go, hold_after=N), metadata=_md(token), timeout=10).blocks_written


@pytest.mark.parametrize("hold_after", [1, N], ids=["mid-stream", "before-commit"])
def test_a_put_stream_opened_before_its_token_was_rotated_stores_nothing(sidecar, channel, monkeypatch,
                                                                          hold_after):
    admin = sidecar.admin()
    token = admin.create_tenant("rot")
    kv = kvstore_pb2_grpc.KVStoreStub(channel)
    keys = _keys(1)
    written = _written_blocks(monkeypatch)
    hold = threading.Event()
    call = kv.Put.future(_frames(keys, "", hold, hold_after=hold_after), metadata=_md(token), timeout=WAIT)
    assert written[hold_after - 1].wait(WAIT)  # the server authenticated the stream and took its blocks
    new = admin.rotate_token("rot")
    hold.set()
    with pytest.raises(grpc.RpcError) as err:
        call.result()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    assert "rotated" in err.value.details()
    assert _lookup(kv, keys, new) == 0  # nothing of the stream is visible
    monkeypatch.undo()
    assert _put(kv, keys, new) == N and _lookup(kv, keys, new) == N  # the same put with the new token


@pytest.mark.parametrize("hold_after", [1, N], ids=["mid-stream", "before-commit"])
def test_a_publisher_stream_revoked_meanwhile_stores_nothing_in_the_shared_namespace(sidecar, channel,
                                                                                    monkeypatch, hold_after):
    admin = sidecar.admin()
    pub = admin.create_tenant("pub", role="publisher", namespaces=["shared:a", "shared:b"])
    reader = admin.create_tenant("reader")
    admin.grant("reader", "shared:a")
    kv = kvstore_pb2_grpc.KVStoreStub(channel)
    keys = _keys(2)
    written = _written_blocks(monkeypatch)
    hold = threading.Event()
    call = kv.Put.future(_frames(keys, "shared:a", hold, hold_after=hold_after), metadata=_md(pub), timeout=WAIT)
    assert written[hold_after - 1].wait(WAIT)
    admin.grant("pub", "shared:a", revoke=True)
    hold.set()
    with pytest.raises(grpc.RpcError) as err:
        call.result()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    assert "shared:a" in err.value.details() and "revoked" in err.value.details()
    assert _lookup(kv, keys, reader, "shared:a") == 0
    # the publisher's other namespace is untouched by the revocation
    monkeypatch.undo()
    assert _put(kv, keys, pub, "shared:b") == N


def test_a_grant_of_another_namespace_does_not_fail_a_stream(sidecar, channel, monkeypatch):
    """Only a change that takes the right away fails a running stream."""
    admin = sidecar.admin()
    token = admin.create_tenant("keeps")
    kv = kvstore_pb2_grpc.KVStoreStub(channel)
    keys = _keys(3)
    written = _written_blocks(monkeypatch)
    hold = threading.Event()
    call = kv.Put.future(_frames(keys, "", hold, hold_after=1), metadata=_md(token), timeout=WAIT)
    assert written[0].wait(WAIT)
    admin.grant("keeps", "shared:extra")
    admin.create_tenant("someone-else")
    hold.set()
    assert call.result().blocks_written == N
    assert _lookup(kv, keys, token) == N


def test_a_shared_memory_put_whose_token_is_rotated_before_its_commit_stores_nothing(sidecar, monkeypatch):
    admin = sidecar.admin()
    c = sidecar.client(admin.create_tenant("shm-rot"), local=True)
    assert c.uses_shared_memory
    keys = c.block_keys(SPEC, fresh_tokens(N))
    kv = random_kv(N, seed=5)
    held = HeldPut(monkeypatch, c, SPEC, keys, kv, WAIT)  # the token is rotated between auth and commit
    new = admin.rotate_token("shm-rot")
    outcome = held.finish()
    assert isinstance(outcome, Unauthenticated), outcome
    monkeypatch.undo()
    fresh = Client(sidecar.target, new, local=True)
    try:
        assert fresh.lookup(SPEC, keys).num_blocks == 0
        fresh.put(SPEC, keys, kv)
        assert fresh.lookup(SPEC, keys).num_blocks == N
    finally:
        fresh.close()


def test_a_get_stream_stops_when_its_readers_grant_is_revoked(sidecar, channel, monkeypatch):
    admin = sidecar.admin()
    pub = admin.create_tenant("gpub", role="publisher", namespaces=["shared:g"])
    reader = admin.create_tenant("greader")
    admin.grant("greader", "shared:g")
    kv = kvstore_pb2_grpc.KVStoreStub(channel)
    keys = _keys(4)
    assert _put(kv, keys, pub, "shared:g") == N
    sent, go = threading.Event(), threading.Event()
    real = service_streams.block_frames

    def slow_frames(*args, **kw):
        for i, frame in enumerate(real(*args, **kw)):
            if i == 1:  # one data frame out: the grant is revoked before the next
                sent.set()
                assert go.wait(WAIT)
            yield frame

    monkeypatch.setattr(service_streams, "block_frames", slow_frames)
    stream = kv.Get(pb.GetRequest(target=_target(keys, "shared:g")), metadata=_md(reader), timeout=WAIT)
    got = [next(stream), next(stream)]  # header, first data frame
    assert got[0].header.num_blocks == N and len(got[1].data) > 0
    assert sent.wait(WAIT)
    admin.grant("greader", "shared:g", revoke=True)
    go.set()
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()


# -- the registry itself -------------------------------------------------------------------------


def test_registry_check_follows_rotation_deletion_and_grants(tmp_path):
    reg = AuthRegistry(tmp_path / "auth.json", clock=lambda: 1.0)
    token = reg.create("t")
    pub_token = reg.create("p", Role.PUBLISHER, ["shared:x"])
    p, pub = reg.authenticate(token), reg.authenticate(pub_token)
    reg.check(p, "t", write=True)
    reg.grant("t", "shared:x")  # adds a right: nothing fails
    reg.check(p, "t", write=True)
    reg.check(pub, "shared:x", write=True)
    reg.grant("p", "shared:x", revoke=False)
    reg.grant("p", "shared:y")
    reg.grant("p", "shared:x", revoke=True)
    with pytest.raises(PermissionDenied, match="revoked"):
        reg.check(pub, "shared:x", write=True)
    reg.check(pub, None)  # the principal itself is still valid
    reg.rotate("t")
    with pytest.raises(Unauthenticated, match="rotated"):
        reg.check(p, "t", write=True)
    q = reg.delete("t")
    assert q.name == "t"
    reg.create("t")  # a new principal under the same name is not the old one
    with pytest.raises(Unauthenticated):
        reg.check(p, "t", write=True)
    p2 = reg.authenticate(reg.rotate("t"))
    reg.check(p2, "t", write=True)
    reg.delete("t")
    with pytest.raises(Unauthenticated, match="deleted while this call ran"):
        reg.check(p2, "t", write=True)


def test_a_rotation_waits_for_a_commit_holding_the_registry(tmp_path):
    """A change of rights never lands between the check and the commit it guards."""
    reg = AuthRegistry(tmp_path / "auth.json", clock=lambda: 1.0)
    token = reg.create("t")
    p = reg.authenticate(token)
    done = threading.Event()
    rotator = threading.Thread(target=lambda: (reg.rotate("t"), done.set()))
    with reg.holding(p, "t", write=True):
        rotator.start()
        while not reg._gate._waiting:  # the rotation is waiting for this holder (a state, not a time)
            assert rotator.is_alive()
        assert not done.is_set() and reg.authenticate(token).name == "t"  # not rotated yet
    rotator.join(WAIT)
    assert done.is_set()
    with pytest.raises(Unauthenticated):
        reg.authenticate(token)
    with pytest.raises(Unauthenticated), reg.holding(p, "t", write=True):
        pass
