"""Limits that did not hold, or did not say which limit was hit (prober findings, round 15):

* BlockKeys returned any number of keys (the reply then failed in grpc: "Sent message larger
  than max", counted as OK); token Lookups computed every key before checking the count.
* A request that is not valid protobuf answered INTERNAL "Exception deserializing request!".
* The in-flight byte budget was kept per target namespace, not per caller.
* A long non-ASCII error message outgrew grpc's metadata limit once percent-encoded.
* Past max_message_bytes the client's ResourceExhausted named no limit.
* RegisterRegion with an unknown kind said the kind was missing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from urllib.parse import quote

import grpc
import pytest
from service_harness import SPEC, random_kv, start

from kvstore import server_config, service_data
from kvstore.client import spec_to_pb
from kvstore.errors import PermissionDenied, ResourceExhausted
from kvstore.status import from_rpc_error, to_status
from proto.kvstore.v1 import kvstore_pb2 as pb
from proto.kvstore.v1 import kvstore_pb2_grpc


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _code(call, *args, **kw) -> tuple[str, str]:
    try:
        r = call(*args, timeout=20, **kw)
        if hasattr(r, "__next__"):
            list(r)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""


def _requests(sc, rpc: str, code: str) -> float:
    for family in sc.server.metrics_registry.collect():
        for s in family.samples:
            if s.name == "kvstore_requests_total" and s.labels == {"rpc": rpc, "code": code}:
                return s.value
    return 0.0


@pytest.fixture
def small(tmp_path):
    sc = start(tmp_path, limits={"max_keys_per_call": 100})
    token = sc.admin().create_tenant("t")
    ch = grpc.insecure_channel(sc.target)
    yield sc, kvstore_pb2_grpc.KVStoreStub(ch), _md(token), ch
    ch.close()
    sc.stop()


# -- 1. key count of BlockKeys and token Lookups --------------------------------------------------
def _no_key_computation(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("keys computed past limits.max_keys_per_call")
    monkeypatch.setattr(service_data, "block_keys", refuse)


def test_block_keys_past_max_keys_per_call_is_refused_before_computing_keys(small, monkeypatch):
    sc, kv, md, _ = small
    spec = spec_to_pb(SPEC)
    spec.block_tokens = 1
    ok = kv.BlockKeys(pb.BlockKeysRequest(spec=spec, tokens=pb.TokenIds(ids=[1] * 100)), metadata=md, timeout=20)
    assert len(ok.keys) == 100 * 32
    _no_key_computation(monkeypatch)
    code, details = _code(kv.BlockKeys, pb.BlockKeysRequest(spec=spec, tokens=pb.TokenIds(ids=[1] * 101)),
                          metadata=md)
    assert code == "INVALID_ARGUMENT" and "limits.max_keys_per_call=100" in details
    assert _requests(sc, "BlockKeys", "INVALID_ARGUMENT") == 1


def test_token_lookup_past_max_keys_per_call_is_refused_before_computing_keys(small, monkeypatch):
    _, kv, md, _ = small
    _no_key_computation(monkeypatch)
    target = pb.Target(spec=spec_to_pb(SPEC), tokens=pb.TokenIds(ids=[1] * (SPEC.block_tokens * 101)))
    code, details = _code(kv.Lookup, pb.LookupRequest(target=target), metadata=md)
    assert code == "INVALID_ARGUMENT" and "limits.max_keys_per_call=100" in details


# -- 2. requests that are not valid protobuf ------------------------------------------------------
_IDENT = (lambda b: b)
_CORRUPT = b"\xff\xff\xff\xff"
_BAD_UTF8 = b"\x0a\x02\xc3\x28"  # field 1 (a string: session_id, an admin request's name), not UTF-8


def _raw(ch, path: str, payload: bytes, md, stream: bool = False) -> tuple[str, str]:
    factory = ch.unary_stream if stream else ch.unary_unary
    return _code(factory(path, request_serializer=_IDENT, response_deserializer=_IDENT), payload, metadata=md)


@pytest.mark.parametrize(("method", "payload", "stream"), [
    ("Lookup", _CORRUPT, False), ("Get", _CORRUPT, True), ("Delete", _CORRUPT, False),
    ("OpenSession", _BAD_UTF8, False), ("BlockKeys", _CORRUPT, False),
])
def test_a_malformed_request_is_invalid_argument_after_authentication(small, method, payload, stream):
    sc, _, md, ch = small
    code, details = _raw(ch, f"/kvstore.v1.KVStore/{method}", payload, md, stream)
    assert code == "INVALID_ARGUMENT" and "malformed" in details, details
    assert _requests(sc, method, "INVALID_ARGUMENT") == 1
    code, _ = _raw(ch, f"/kvstore.v1.KVStore/{method}", payload, (), stream)
    assert code == "UNAUTHENTICATED"
    assert _requests(sc, method, "UNAUTHENTICATED") == 1


def test_a_malformed_admin_request_is_invalid_argument_for_the_admin_only(small):
    sc, _, md, ch = small
    path = "/kvstore.v1.Admin/CreateTenant"
    code, details = _raw(ch, path, _BAD_UTF8, _md(sc.admin_token))
    assert code == "INVALID_ARGUMENT" and "malformed" in details, details
    assert _requests(sc, "Admin.CreateTenant", "INVALID_ARGUMENT") == 1
    assert _raw(ch, path, _BAD_UTF8, md)[0] == "PERMISSION_DENIED"  # a tenant's token
    assert _raw(ch, path, _BAD_UTF8, ())[0] == "UNAUTHENTICATED"


# -- 3. in-flight bytes per principal -------------------------------------------------------------
def test_inflight_bytes_are_counted_per_principal_not_per_namespace(tmp_path):
    n = SPEC.block_nbytes
    sc = start(tmp_path, limits={"max_inflight_bytes_per_tenant": 2 * n, "stream_idle_s": 20,
                                 "max_streams_per_principal": 8, "max_calls_per_principal": 8})
    ch = grpc.insecure_channel(sc.target)
    kv = kvstore_pb2_grpc.KVStoreStub(ch)
    hold = threading.Event()
    try:
        adm = sc.admin()
        pub = _md(adm.create_tenant("pub", role="publisher", namespaces=["shared:s1", "shared:s2"]))
        pub2 = _md(adm.create_tenant("pub2", role="publisher", namespaces=["shared:s1"]))

        def stream(tag: int, ns: str, blocks: int):
            keys = b"".join(bytes([tag]) * 31 + bytes([i]) for i in range(blocks))
            yield pb.PutFrame(header=pb.PutHeader(target=pb.Target(spec=spec_to_pb(SPEC), keys=keys, namespace=ns)))
            hold.wait(15)

        held = kv.Put.future(stream(100, "shared:s1", 2), metadata=pub, timeout=20)
        deadline = time.monotonic() + 10
        while not sc.server.data.inflight._used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sc.server.data.inflight._used == {"pub": 2 * n}
        # the same publisher, another namespace: over its own limit
        with pytest.raises(grpc.RpcError) as err:
            kv.Put.future(stream(101, "shared:s2", 1), metadata=pub, timeout=20).result(timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'pub'" in err.value.details() and "shared:s2" not in err.value.details()
        # another publisher of the same namespace: nothing of its own in flight
        other = kv.Put.future(stream(102, "shared:s1", 1), metadata=pub2, timeout=20)
        time.sleep(0.5)
        assert not other.done(), other.exception()
        assert sc.server.data.inflight._used == {"pub": 2 * n, "pub2": n}
        hold.set()
        held.cancel()
        other.cancel()
    finally:
        hold.set()
        ch.close()
        sc.stop()


# -- 4. error messages fit grpc's metadata limit once percent-encoded -----------------------------
def _wire_bytes(message: str) -> int:
    """What grpc sends for a status message: UTF-8, percent-encoded outside printable ASCII."""
    return len(quote(message.encode(), safe="".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)))


@pytest.mark.parametrize("text", ["\U0001F600" * 3000, "\u4e2d" * 5000, "é" * 100_000, "%" * 10_000])
def test_a_long_non_ascii_message_is_cut_by_its_encoded_size(text):
    code, message = to_status(PermissionDenied("namespace " + text))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert _wire_bytes(message) <= 4096
    assert message.startswith("namespace " + text[:50]) and message.endswith("chars)")


def test_a_long_non_ascii_namespace_keeps_its_status(small):
    _, kv, md, _ = small
    target = pb.Target(spec=spec_to_pb(SPEC), keys=b"\x01" * 32, namespace="\U0001F600" * 3000)
    codes = {_code(kv.Lookup, pb.LookupRequest(target=target), metadata=md)[0] for _ in range(20)}
    assert codes == {"PERMISSION_DENIED"}


# -- 5. grpc's message size limit named ----------------------------------------------------------
class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("details", ["SERVER: Received message larger than max (640054 vs. 262144)",
                                     "SERVER: Sent message larger than max (4480005 vs. 4194304)",
                                     "CLIENT: Received message larger than max (5000000 vs. 4194304)"])
def test_a_message_over_the_size_limit_names_max_message_bytes(details):
    exc = from_rpc_error(_Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, details))
    assert isinstance(exc, ResourceExhausted)
    assert exc.resource == "limits.max_message_bytes"
    assert "limits.max_message_bytes" in str(exc) and details in str(exc)


def test_a_lookup_over_the_size_limit_names_max_message_bytes(tmp_path):
    sc = start(tmp_path, limits={"max_message_bytes": 256 * 1024, "chunk_bytes": 128 * 1024,
                                 "max_keys_per_call": 4096})
    try:
        c = sc.tenant("t", local=False)
        with pytest.raises(ResourceExhausted) as err:
            c.lookup(SPEC, [bytes([i % 256, i // 256]) * 16 for i in range(20000)])
        assert err.value.resource == "limits.max_message_bytes"
    finally:
        sc.stop()


# -- 6. RegisterRegion with an unknown kind ------------------------------------------------------
def test_register_region_with_an_unknown_kind_says_so(small):
    _, kv, md, _ = small
    code, details = _code(kv.RegisterRegion, pb.RegisterRegionRequest(kind=99, name="x", size=4096), metadata=md)
    assert code == "INVALID_ARGUMENT" and "unknown" in details and "99" in details, details
    code, details = _code(kv.RegisterRegion, pb.RegisterRegionRequest(name="x", size=4096), metadata=md)
    assert code == "INVALID_ARGUMENT" and "required" in details, details


# -- 7. a full key list fits max_message_bytes (LimitsConfig) ------------------------------------
def test_a_full_key_list_must_fit_in_max_message_bytes():
    with pytest.raises(ValueError, match="max_keys_per_call"):
        server_config.LimitsConfig(max_message_bytes=256 * 1024, chunk_bytes=128 * 1024)
    server_config.LimitsConfig(max_message_bytes=256 * 1024, chunk_bytes=128 * 1024, max_keys_per_call=7000)
    server_config.LimitsConfig()  # the defaults fit


def test_the_largest_key_list_allowed_fits_the_message_limit(tmp_path):
    """At the most keys the validator allows for a message limit, a BlockKeys reply and a token
    Lookup's reply (the keys, and a tier code per stored block) still go out."""
    limit = 64 * 1024
    most = server_config.max_keys_in(limit)
    sc = start(tmp_path, limits={"max_message_bytes": limit, "chunk_bytes": 32 * 1024, "max_keys_per_call": most})
    try:
        c = sc.tenant("t", local=False)
        spec = replace(SPEC, block_tokens=1)
        tokens = list(range(1, most + 1))
        keys = c.block_keys(spec, tokens)
        assert len(keys) == most
        for lo in range(0, most, 64):  # within max_blocks_per_stream and max_stream_bytes
            c.put(spec, keys[lo : lo + 64], random_kv(len(keys[lo : lo + 64]), spec), parent=keys[lo - 1] if lo else None)
        found = c.lookup(spec, token_ids=tokens)
        assert found.num_blocks == most
    finally:
        sc.stop()
