"""RegisterRegion maps only regions kvstore's client created, for a caller that can read them.

Before, the server mapped any POSIX shared-memory segment whose first 16 bytes equalled the
nonce sent: a foreign segment with a zeroed head (common) passed with a zero nonce, and the
tenant then had the server read (PutLocal) and overwrite (GetLocal) that program's memory."""

from __future__ import annotations

import os
import secrets
import threading
from multiprocessing import shared_memory

import grpc
import pytest
import torch
from service_harness import SPEC, fresh_tokens, random_kv

import kvstore.service_resources as res
from kvstore.client import spec_to_pb
from kvstore.errors import PermissionDenied
from kvstore.service_resources import RegionTable
from kvstore.shm import HEADER_BYTES, MAGIC, NONCE_BYTES, NONCE_OFFSET, ShmRegion
from kvstore.shm_attach import attach_posix
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc

torch.set_num_threads(1)
DENIED = grpc.StatusCode.PERMISSION_DENIED
USABLE = 2 * SPEC.block_nbytes


@pytest.fixture
def tenant(sidecar):
    """(KVStore stub, metadata, packed keys of one block this tenant stored)."""
    token = sidecar.admin().create_tenant("prober")
    c = sidecar.client(token, local=False)
    keys = c.block_keys(SPEC, fresh_tokens(1))
    c.put(SPEC, keys, random_kv(1, seed=9))
    ch = grpc.insecure_channel(sidecar.target)
    yield kvstore_pb2_grpc.KVStoreStub(ch), (("authorization", f"Bearer {token}"),), b"".join(keys)
    ch.close()


def _target(keys: bytes) -> pb.Target:
    return pb.Target(spec=spec_to_pb(SPEC), keys=keys)


@pytest.fixture
def foreign():
    """Make a segment as another program would (not through ShmRegion.create); unlinked after."""
    made: list[shared_memory.SharedMemory] = []

    def make(name: str | None, head: bytes = b"") -> shared_memory.SharedMemory:
        shm = shared_memory.SharedMemory(name=name, create=True, size=HEADER_BYTES + USABLE)
        shm.buf[HEADER_BYTES:] = bytes(range(256)) * (USABLE // 256)  # the program's data
        shm.buf[: len(head)] = head
        made.append(shm)
        return shm

    yield make
    for shm in made:
        shm.close()
        shm.unlink()


def _attack(kv, md, stored: bytes, name: str, nonce: bytes) -> tuple[grpc.StatusCode, str]:
    """Register ``name`` and, if the server takes it, read the segment into the caller's
    namespace (PutLocal) and write the caller's block over it (GetLocal); else try the same
    with guessed region ids. The registration's status and message."""
    try:
        rid = kv.RegisterRegion(pb.RegisterRegionRequest(kind=pb.REGION_KIND_POSIX_SHM, name=name, size=USABLE,
                                                         nonce=nonce), metadata=md, timeout=5).region_id
        outcome = (grpc.StatusCode.OK, "")
        ids = [rid]
    except grpc.RpcError as err:
        outcome = (err.code(), err.details())
        ids = [1, 2, secrets.randbits(63)]
    fresh = secrets.token_bytes(32)
    for rid in ids:
        for call, req in ((kv.PutLocal, pb.PutLocalRequest(target=_target(fresh), region_id=rid, offsets=[0])),
                          (kv.GetLocal, pb.GetLocalRequest(target=_target(stored), region_id=rid, offsets=[0]))):
            try:
                call(req, metadata=md, timeout=5)
            except grpc.RpcError as err:
                assert outcome[0] == grpc.StatusCode.OK or err.code() == grpc.StatusCode.NOT_FOUND
    return outcome


def test_a_foreign_segment_with_a_zero_head_is_refused_and_left_untouched(tenant, foreign):
    kv, md, stored = tenant
    shm = foreign(None)  # psm_...: Python's default name, as any program's segment
    before = bytes(shm.buf)
    assert not any(before[:HEADER_BYTES])
    for nonce in (bytes(NONCE_BYTES), b""):
        code, msg = _attack(kv, md, stored, shm.name, nonce)
        assert code == DENIED and "not a kvstore region" in msg, (code, msg)
    assert bytes(shm.buf) == before


@pytest.mark.parametrize("head", ["zeros", "old-layout nonce"])
def test_a_kvs_named_segment_without_the_kvstore_header_is_refused(tenant, foreign, head):
    kv, md, stored = tenant
    nonce = bytes(NONCE_BYTES) if head == "zeros" else secrets.token_bytes(NONCE_BYTES)
    shm = foreign("kvs_" + secrets.token_hex(8), nonce)  # the nonce where the server used to read it
    before = bytes(shm.buf)
    code, msg = _attack(kv, md, stored, shm.name, nonce)
    assert code == DENIED and "no kvstore header" in msg, (code, msg)
    assert bytes(shm.buf) == before


def test_a_kvstore_header_whose_nonce_is_zero_is_refused_with_a_zero_nonce(tenant, foreign):
    kv, md, stored = tenant
    head = bytearray(NONCE_OFFSET + NONCE_BYTES)
    head[: len(MAGIC)] = MAGIC  # a kvstore header whose nonce is all zeros
    shm = foreign("kvs_" + secrets.token_hex(8), bytes(head))
    before = bytes(shm.buf)
    code, _ = _attack(kv, md, stored, shm.name, bytes(NONCE_BYTES))
    assert code == DENIED
    assert bytes(shm.buf) == before


def test_the_registry_refuses_an_all_zero_nonce_whatever_the_region_holds(monkeypatch):
    class Zeroed:
        name, nonce = "kvs_zeroed", bytes(NONCE_BYTES)
        closed = False

        def alive(self) -> bool:
            return True

        def close(self) -> None:
            self.closed = True

    region = Zeroed()
    monkeypatch.setattr(res, "attach_region", lambda kind, name, size, handle: region)
    table = RegionTable(max_per_principal=2, max_bytes=1 << 20)
    with pytest.raises(PermissionDenied, match="all-zero nonce"):
        table.register("t", "posix_shm", region.name, 4096, nonce=bytes(NONCE_BYTES))
    assert region.closed


def test_a_region_registered_by_one_tenant_is_refused_to_another_even_with_its_nonce(sidecar, tenant):
    kv, md, stored = tenant
    victim = sidecar.tenant("holder", local=True)
    assert victim.uses_shared_memory
    theirs = victim._local.region
    before = bytes(theirs.view(0, theirs.usable))
    code, msg = _attack(kv, md, stored, theirs.name, theirs.nonce)  # B read the nonce (same uid)
    assert code == DENIED and "another principal" in msg and "holder" not in msg
    assert bytes(theirs.view(0, theirs.usable)) == before
    keys = victim.block_keys(SPEC, fresh_tokens(1))
    victim.put(SPEC, keys, random_kv(1, seed=4))  # the owner's region still works
    assert victim.lookup(SPEC, keys).num_blocks == 1


def test_two_principals_registering_one_region_at_once_get_it_once(monkeypatch):
    """Both passed the check made before the region was mapped, then both registered it."""
    region = ShmRegion.create(4096)
    both_mapped = threading.Barrier(2, timeout=20)

    def attach(kind, name, size, handle):
        mapped = attach_posix(name, size)
        both_mapped.wait()  # each has passed the first check, neither has inserted
        return mapped

    monkeypatch.setattr(res, "attach_region", attach)
    table = RegionTable(max_per_principal=2, max_bytes=1 << 20)
    ok, refused = [], []

    def register(owner: str) -> None:
        try:
            ok.append(table.register(owner, "posix_shm", region.name, region.usable, nonce=region.nonce))
        except PermissionDenied:
            refused.append(owner)

    try:
        threads = [threading.Thread(target=register, args=(o,)) for o in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(ok) == 1 and len(refused) == 1
    finally:
        table.close()
        region.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a segment of another uid needs root")
def test_a_kvstore_region_of_another_user_is_refused(tenant):
    """A server running as root could open any user's segment; it maps only its own uid's."""
    kv, md, stored = tenant
    region = ShmRegion.create(USABLE)
    try:
        os.chown(f"/dev/shm/{region.name}", 65534, -1)
        before = bytes(region.view(0, region.usable))
        code, msg = _attack(kv, md, stored, region.name, region.nonce)
        assert code == DENIED and "another user" in msg, (code, msg)
        assert bytes(region.view(0, region.usable)) == before
    finally:
        region.close()


def test_a_region_made_by_the_client_still_registers(tenant):
    kv, md, _ = tenant
    region = ShmRegion.create(USABLE)
    try:
        assert len(region.nonce) == NONCE_BYTES and any(region.nonce)
        resp = kv.RegisterRegion(pb.RegisterRegionRequest(kind=pb.REGION_KIND_POSIX_SHM, name=region.name,
                                                          size=region.usable, nonce=region.nonce),
                                 metadata=md, timeout=5)
        assert resp.nonce == region.nonce and resp.region_id
    finally:
        region.close()
