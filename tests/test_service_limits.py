"""Limits, quotas and malformed input: each gets the right status code and a message naming it."""

from __future__ import annotations

import grpc
import pytest
import torch
import xxhash
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore import server_config
from kvstore.client import spec_to_pb
from kvstore.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvstore.server import create_server
from kvstore.shm import ShmRegion
from proto.kvstore.v1 import admin_pb2 as apb
from proto.kvstore.v1 import admin_pb2_grpc, kvstore_pb2_grpc
from proto.kvstore.v1 import kvstore_pb2 as pb

torch.set_num_threads(1)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def sidecar(tmp_path):
    sc = start(tmp_path, limits={"max_keys_per_call": 64, "max_blocks_per_stream": 8,
                                 "max_stream_bytes": 6 * SPEC.block_nbytes})
    yield sc
    sc.stop()


@pytest.fixture
def raw(sidecar):
    """(KVStore stub, Admin stub, tenant metadata, admin metadata)."""
    token = sidecar.admin().create_tenant("raw")
    ch = grpc.insecure_channel(sidecar.target)
    yield (kvstore_pb2_grpc.KVStoreStub(ch), admin_pb2_grpc.AdminStub(ch),
           (("authorization", f"Bearer {token}"),), (("authorization", f"Bearer {sidecar.admin_token}"),))
    ch.close()


def _code(call, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        result = call(*args, timeout=5, **kw)
        if hasattr(result, "__next__"):
            list(result)
    return err.value.code(), err.value.details()


def _target(keys=b"\x01" * 32, **spec_kw) -> pb.Target:
    spec = spec_to_pb(SPEC)
    for k, v in spec_kw.items():
        setattr(spec, k, v)
    return pb.Target(spec=spec, keys=keys)


def _chunk(block: int, offset: int, data: bytes, xxh3: int | None = None) -> pb.PutFrame:
    return pb.PutFrame(block=block, offset=offset, data=data,
                       xxh3=xxhash.xxh3_64_intdigest(data) if xxh3 is None else xxh3)


# -- malformed input, one per RPC -------------------------------------------------------------
def test_block_keys_rejects_a_malformed_spec(raw):
    kv, _, md, _ = raw
    code, msg = _code(kv.BlockKeys, pb.BlockKeysRequest(spec=pb.ModelSpec(model="m")), metadata=md)
    assert code == INVALID and "num_layers" in msg


def test_lookup_rejects_ragged_keys_and_a_missing_spec(raw):
    kv, _, md, _ = raw
    assert _code(kv.Lookup, pb.LookupRequest(target=_target(keys=b"\x01" * 33)), metadata=md)[0] == INVALID
    assert _code(kv.Lookup, pb.LookupRequest(target=pb.Target(keys=b"\x01" * 32)), metadata=md)[0] == INVALID
    code, msg = _code(kv.Lookup, pb.LookupRequest(target=_target(dtype="int7")), metadata=md)
    assert code == INVALID and "dtype" in msg


def test_put_rejects_missing_header_wrong_sizes_bad_checksums_and_short_streams(raw):
    kv, _, md, _ = raw
    keys = b"".join(bytes([i]) * 32 for i in range(2))
    header = pb.PutFrame(header=pb.PutHeader(target=_target(keys=keys)))
    block = bytes(SPEC.block_nbytes)
    cases = {
        "no header": [_chunk(0, 0, block)],
        "wrong size": [header, _chunk(0, 0, block + b"x")],
        "bad checksum": [header, _chunk(0, 0, block, xxh3=1)],
        "out of order": [header, _chunk(1, 0, block)],
        "short stream": [header, _chunk(0, 0, block)],
        "extra block": [header, _chunk(0, 0, block), _chunk(1, 0, block), _chunk(2, 0, block)],
    }
    for name, msgs in cases.items():
        code, msg = _code(kv.Put, iter(msgs), metadata=md)
        assert code == INVALID, (name, code, msg)
    assert kv.Lookup(pb.LookupRequest(target=_target(keys=keys)), metadata=md, timeout=5).num_blocks == 0


def test_get_rejects_a_malformed_request(raw):
    kv, _, md, _ = raw
    assert _code(kv.Get, pb.GetRequest(target=_target(keys=b"\x00" * 31)), metadata=md)[0] == INVALID


def test_register_region_rejects_unknown_kinds_sizes_and_foreign_names(raw):
    kv, _, md, _ = raw
    assert _code(kv.RegisterRegion, pb.RegisterRegionRequest(name="x", size=10), metadata=md)[0] == INVALID
    code, msg = _code(kv.RegisterRegion, pb.RegisterRegionRequest(
        kind=pb.REGION_KIND_POSIX_SHM, name="kvs_does_not_exist_anywhere", size=4096), metadata=md)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not on this host" in msg
    code, _ = _code(kv.RegisterRegion, pb.RegisterRegionRequest(
        kind=pb.REGION_KIND_CUDA_IPC, name="x", size=4096), metadata=md)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    region = ShmRegion.create(4096)
    try:
        code, _ = _code(kv.RegisterRegion, pb.RegisterRegionRequest(
            kind=pb.REGION_KIND_POSIX_SHM, name=region.name, size=1 << 20), metadata=md)
        assert code == INVALID  # declared larger than it is
    finally:
        region.close()


def test_a_region_is_registered_only_with_its_nonce_and_by_one_principal(raw, sidecar):
    """Any tenant could name another client's region (its name is in /dev/shm) and have the
    server map it: PutLocal then copied that client's staged KV into the caller's namespace,
    GetLocal wrote into its memory. The nonce the client wrote at the head of its region must
    now match, and a region another principal registered is refused."""
    kv, _, md, _ = raw
    other = sidecar.tenant("victim", local=True)
    assert other.uses_shared_memory
    theirs = other._local.region
    for nonce in (b"\0" * len(theirs.nonce), theirs.nonce):  # a guess, or even the right one
        code, msg = _code(kv.RegisterRegion, pb.RegisterRegionRequest(
            kind=pb.REGION_KIND_POSIX_SHM, name=theirs.name, size=theirs.usable, nonce=nonce), metadata=md)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "another principal" in msg
    mine = ShmRegion.create(4096)
    try:
        code, msg = _code(kv.RegisterRegion, pb.RegisterRegionRequest(
            kind=pb.REGION_KIND_POSIX_SHM, name=mine.name, size=mine.usable, nonce=b"\1" * len(mine.nonce)),
            metadata=md)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "nonce" in msg
        ok = kv.RegisterRegion(pb.RegisterRegionRequest(kind=pb.REGION_KIND_POSIX_SHM, name=mine.name,
                                                        size=mine.usable, nonce=mine.nonce), metadata=md, timeout=5)
        assert ok.nonce == mine.nonce
    finally:
        mine.close()


def test_put_and_get_local_reject_foreign_regions_and_bad_slots(raw):
    kv, _, md, _ = raw
    region = ShmRegion.create(8 * SPEC.block_nbytes)
    try:
        rid = kv.RegisterRegion(pb.RegisterRegionRequest(kind=pb.REGION_KIND_POSIX_SHM, name=region.name,
                                                         size=region.usable, nonce=region.nonce),
                                metadata=md, timeout=5).region_id
        keys = b"".join(bytes([i]) * 32 for i in range(2))
        n = SPEC.block_nbytes
        # an unknown (or another caller's) region is NOT_FOUND, named so the client can
        # register its region again after a server restart
        unknown = pb.PutLocalRequest(target=_target(keys=keys), region_id=rid + 99, offsets=[0, n])
        code, message = _code(kv.PutLocal, unknown, metadata=md)
        assert code == grpc.StatusCode.NOT_FOUND and message.startswith("unknown region")
        get = pb.GetLocalRequest(target=unknown.target, region_id=unknown.region_id, offsets=unknown.offsets)
        assert _code(kv.GetLocal, get, metadata=md)[0] == grpc.StatusCode.NOT_FOUND
        bad = {
            "offset count": pb.PutLocalRequest(target=_target(keys=keys), region_id=rid, offsets=[0]),
            "overlap": pb.PutLocalRequest(target=_target(keys=keys), region_id=rid, offsets=[0, n // 2]),
            "out of range": pb.PutLocalRequest(target=_target(keys=keys), region_id=rid, offsets=[0, 8 * n]),
        }
        for name, req in bad.items():
            assert _code(kv.PutLocal, req, metadata=md)[0] == INVALID, name
            get = pb.GetLocalRequest(target=req.target, region_id=req.region_id, offsets=req.offsets)
            assert _code(kv.GetLocal, get, metadata=md)[0] == INVALID, name
        kv.UnregisterRegion(pb.UnregisterRegionRequest(region_id=rid), metadata=md, timeout=5)
        assert _code(kv.UnregisterRegion, pb.UnregisterRegionRequest(region_id=rid), metadata=md)[0] == \
            grpc.StatusCode.NOT_FOUND
    finally:
        region.close()


def test_session_calls_need_an_id_and_a_known_session(raw):
    kv, _, md, _ = raw
    assert _code(kv.OpenSession, pb.SessionRequest(), metadata=md)[0] == INVALID
    for call in (kv.PauseSession, kv.ResumeSession, kv.CloseSession):
        assert _code(call, pb.SessionRequest(session_id="ghost"), metadata=md)[0] == grpc.StatusCode.NOT_FOUND


def test_prefetch_rejects_unknown_tiers(raw):
    kv, _, md, _ = raw
    assert _code(kv.Prefetch, pb.PrefetchRequest(target=_target(), tier=42), metadata=md)[0] == INVALID


def test_delete_rejects_ragged_keys(raw):
    kv, _, md, _ = raw
    assert _code(kv.Delete, pb.DeleteRequest(keys=b"\x00" * 40), metadata=md)[0] == INVALID


def test_admin_calls_reject_malformed_input(raw):
    _, admin, _, amd = raw
    assert _code(admin.CreateTenant, apb.CreateTenantRequest(name="Bad Name!"), metadata=amd)[0] == INVALID
    assert _code(admin.CreateTenant, apb.CreateTenantRequest(name="p", role=apb.ROLE_PUBLISHER),
                 metadata=amd)[0] == INVALID  # a publisher needs a namespace
    assert _code(admin.CreateTenant, apb.CreateTenantRequest(name="raw"), metadata=amd)[0] == \
        grpc.StatusCode.ALREADY_EXISTS
    assert _code(admin.RotateToken, apb.TenantName(name="nobody"), metadata=amd)[0] == grpc.StatusCode.NOT_FOUND
    assert _code(admin.Grant, apb.GrantRequest(tenant="raw", namespace="not-shared"), metadata=amd)[0] == INVALID
    assert _code(admin.SetPolicy, apb.TenantPolicy(tenant="raw", quota_bytes={"ssd": 1}), metadata=amd)[0] == INVALID
    assert _code(admin.SetPolicy, apb.TenantPolicy(tenant="raw", ttl_s=-1.0), metadata=amd)[0] == INVALID
    assert _code(admin.SetPolicy, apb.TenantPolicy(tenant="nobody"), metadata=amd)[0] == grpc.StatusCode.NOT_FOUND
    assert _code(admin.PurgeModel, apb.PurgeModelRequest(fingerprint=b"short"), metadata=amd)[0] == INVALID
    assert _code(admin.DeleteTenant, apb.TenantName(name="admin"), metadata=amd)[0] == \
        grpc.StatusCode.FAILED_PRECONDITION  # the last admin stays


def test_client_token_ids_that_are_not_int64_are_refused_before_they_are_sent(sidecar):
    """Floats are not rounded, big ints are not wrapped or left to an OverflowError: the
    client says what is wrong, for every verb that takes token ids."""
    c = sidecar.tenant("ids", local=False)
    for bad, reason in (([0.5] * 16, "integers"), ([1 << 70] * 16, "below 2"), ([-1] * 16, "non-negative")):
        with pytest.raises(InvalidArgument, match=reason):
            c.block_keys(SPEC, bad)
        with pytest.raises(InvalidArgument, match=reason):
            c.lookup(SPEC, token_ids=bad)


# -- limits and quotas ---------------------------------------------------------------------------
def test_keys_per_call_limit_is_invalid_argument_naming_the_limit(sidecar):
    c = sidecar.tenant("many", local=False)
    code_msg = None
    with pytest.raises(InvalidArgument) as err:
        c.lookup(SPEC, [bytes(32)] * 65)
    code_msg = str(err.value)
    assert "max_keys_per_call" in code_msg


def test_blocks_per_stream_and_stream_bytes_limits(sidecar):
    c = sidecar.tenant("stream", local=False)
    keys = c.block_keys(SPEC, fresh_tokens(9))
    with pytest.raises(InvalidArgument, match="max_blocks_per_stream"):
        c.put(SPEC, keys, random_kv(9))
    with pytest.raises(ResourceExhausted, match="max_stream_bytes"):
        c.put(SPEC, keys[:7], random_kv(7))
    assert c.lookup(SPEC, keys).num_blocks == 0


def test_quota_is_resource_exhausted(sidecar):
    admin = sidecar.admin()
    c = sidecar.client(admin.create_tenant("quota"))
    small = SPEC.block_nbytes * 2
    admin.set_policy("quota", quota_bytes={"hbm": small, "dram": small, "nvme": small})
    keys = c.block_keys(SPEC, fresh_tokens(8))
    with pytest.raises(ResourceExhausted):
        c.put(SPEC, keys, random_kv(8))
    assert c.lookup(SPEC, keys).num_blocks == 0  # all or nothing


def test_message_size_limit_is_enforced_by_the_transport(tmp_path):
    sc = start(tmp_path, limits={"max_message_bytes": 256 * 1024, "chunk_bytes": 128 * 1024,
                                 "max_keys_per_call": 4096})
    try:
        token = sc.admin().create_tenant("big")
        with grpc.insecure_channel(sc.target, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
            stub = kvstore_pb2_grpc.KVStoreStub(ch)
            code, _ = _code(stub.Lookup, pb.LookupRequest(target=_target(keys=b"\x01" * 32 * 20000)),
                            metadata=(("authorization", f"Bearer {token}"),))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        sc.stop()


# -- configuration and transport security -------------------------------------------------------
def test_plaintext_on_a_non_loopback_address_is_refused(tmp_path):
    cfg = server_config.build({"listen": "0.0.0.0:0", "metrics": {"enabled": False}}, data_dir=tmp_path)
    with pytest.raises(FailedPrecondition, match="plaintext"):
        create_server(cfg, store=object())


def test_config_loads_from_toml_and_rejects_unknown_fields(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text('listen = "127.0.0.1:7000"\n[store]\nhbm_bytes = 1048576\n[limits]\nmax_keys_per_call = 5\n')
    cfg = server_config.load(path, data_dir=tmp_path / "data")
    assert cfg.listen == "127.0.0.1:7000" and cfg.store.hbm_bytes == 1 << 20
    assert cfg.limits.max_keys_per_call == 5 and cfg.data_dir == tmp_path / "data"
    path.write_text('listne = "typo"\n')
    with pytest.raises(InvalidArgument, match="listne"):
        server_config.load(path, data_dir=tmp_path)
    path.write_text('[limits]\nchunk_bytes = 8388608\n')
    with pytest.raises(InvalidArgument, match="chunk_bytes"):
        server_config.load(path, data_dir=tmp_path)


def test_config_byte_fields_take_sizes_written_for_people(tmp_path):
    """``hbm_bytes = "8GiB"``: every *_bytes field takes a size string (binary units, as the
    CLI's --quota); a bad one names the field and says what a size looks like."""
    path = tmp_path / "kvstore.toml"
    path.write_text('[store]\nhbm_bytes = "8GiB"\ndram_bytes = "1.5g"\nnvme_bytes = 4096\n'
                    '[limits]\nchunk_bytes = "1MiB"\nmax_stream_bytes = "2 GB"\n'
                    '[store.remote]\nurls = ["redis://127.0.0.1:6379/0"]\ncapacity_bytes = "1TiB"\n')
    cfg = server_config.load(path, data_dir=tmp_path / "data")
    assert (cfg.store.hbm_bytes, cfg.store.dram_bytes, cfg.store.nvme_bytes) == (8 << 30, 3 << 29, 4096)
    assert (cfg.limits.chunk_bytes, cfg.limits.max_stream_bytes) == (1 << 20, 2 << 30)
    assert cfg.store.remote.capacity_bytes == 1 << 40
    path.write_text('[store]\nhbm_bytes = "8 gallons"\n')
    with pytest.raises(InvalidArgument, match="hbm_bytes(.|\\n)*512MiB, 2GiB"):
        server_config.load(path, data_dir=tmp_path)
    path.write_text('[limits]\nchunk_bytes = "8MiB"\n')  # parsed, then still bounded
    with pytest.raises(InvalidArgument, match="chunk_bytes"):
        server_config.load(path, data_dir=tmp_path)


@pytest.mark.parametrize("listen", ["127.0.0.1:99999", "127.0.0.1", ":50051", "localhost:http", "127.0.0.1:-1"])
def test_a_listen_address_grpc_would_misread_is_refused(tmp_path, listen):
    """grpc binds 127.0.0.1:99999 as port 34463 without a word: the config refuses it."""
    with pytest.raises(InvalidArgument, match="not host:port"):
        server_config.build({"listen": listen}, data_dir=tmp_path)
    with pytest.raises(InvalidArgument, match="not host:port"):
        server_config.build({"metrics": {"listen": listen}}, data_dir=tmp_path)


def test_listen_addresses_grpc_takes_are_kept(tmp_path):
    for listen in ("127.0.0.1:0", "[::1]:65535", "localhost:50051", "unix:/tmp/kvstore.sock"):
        assert server_config.build({"listen": listen}, data_dir=tmp_path).listen == listen


def test_default_data_dir_rules(tmp_path):
    assert server_config.default_data_dir({"KVSTORE_HOME": str(tmp_path / "h")}) == tmp_path / "h"
    assert server_config.default_data_dir({}, cwd=tmp_path) == tmp_path / ".kvstore"


def test_put_answers_invalid_argument_for_frames_that_are_not_protobuf(sidecar, raw):
    _, _, md, _ = raw
    with grpc.insecure_channel(sidecar.target) as ch:
        put = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=None,
                              response_deserializer=pb.PutResponse.FromString)
        code, msg = _code(put, iter([b"\xff\xff\xff"]), metadata=md)
    assert code == INVALID and "malformed PutFrame" in msg


def test_sessions_per_tenant_and_session_ids_are_bounded(tmp_path):
    """A session lives until closed: a tenant could open sessions (and send ids of a MiB) without
    end, each kept in the server's memory."""
    from kvstore.errors import InvalidArgument, ResourceExhausted

    sc = start(tmp_path, limits={"max_sessions_per_tenant": 2, "max_session_id_bytes": 8})
    try:
        a = sc.tenant("sess-a", local=False)
        b = sc.tenant("sess-b", local=False)
        a.open_session("one")
        a.open_session("two")
        a.open_session("two")  # re-opening is no new session
        with pytest.raises(ResourceExhausted, match="max_sessions_per_tenant"):
            a.open_session("three")
        b.open_session("one")  # another tenant's count is its own
        a.close_session("one")
        a.open_session("three")
        with pytest.raises(InvalidArgument, match="max_session_id_bytes=8"):
            a.open_session("x" * 9)
    finally:
        sc.stop()
